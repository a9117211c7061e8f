"""speculative='mtp': drafts from the multi-token-prediction head Qwen3.5 / Qwen3-Next ship (tests/factories.py
add_mtp_head writes a random one). The oracle of the head is written here from transformers' own modules (it has
no MTP head: it drops mtp.* on load): fc over [norm(embed(next token)); norm(the model's final hidden state)], one
decoder layer of the model's full-attention class with the mtp.layers.0 weights under a causal mask, mtp.norm, the
model's lm_head, float64. With every proposal verified, the engine's drafts are that head's argmax exactly when its
count of accepted drafts is the one a walk of the greedy answer with the oracle's drafts predicts, step by step
(the adaptive switch-off included). The lm_head keeps 6 live rows so that random weights give drafts that are
sometimes right. Then: the tokens of speculation off, with chunked prefill, prefix hits, preemption, n = 3 and
sampling, and no block or state slot leaked."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit._ext import _engine
from tests.factories import QWEN3_5, QWEN3_5_MOE, TOKEN_IDS, add_mtp_head, build_case, write_qwen3_5_multimodal
from tests.helpers import (SPEC_STRESS_POOL, assert_blocks_free, run_with_random_cancellations, spec_stress_requests,
                           speculation_keeps_tokens, submit_all)

BASE = dict(device="cpu", dtype="float32", cache_max_entry_count=96, cache_block_seq_len=16, max_batch_size=8)
FIXED = dict(speculative_adaptive=False)  # every proposal verified, whatever steps cost

LIVE_TOKENS = 6  # lm_head rows left non-zero: greedy answers and drafts among these ids


def mtp_model(folder, kind: str, seed: int):
    """A tiny Qwen3.5 (dense, moe) or Qwen3-Next (next) with a random MTP head, its lm_head cut to LIVE_TOKENS
    rows; returns the HF model, float64."""
    import transformers

    if kind == "next":
        build_case("qwen3_next", folder)
    else:
        config_class, text = {"dense": ("Qwen3_5Config", QWEN3_5), "moe": ("Qwen3_5MoeConfig", QWEN3_5_MOE)}[kind]
        write_qwen3_5_multimodal(folder, config_class, dict(text, num_hidden_layers=4, max_position_embeddings=512,
                                                            **TOKEN_IDS), seed=seed)
    add_mtp_head(folder, seed + 1)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"][LIVE_TOKENS:] = 0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    arch = transformers.AutoConfig.from_pretrained(str(folder)).architectures[0]
    model = getattr(transformers, arch).from_pretrained(str(folder), dtype=torch.float64).eval()
    return model, tensors


def reference_drafts(model, tensors, tokens: list[int]) -> list[int]:
    """The oracle head's argmax at every position p < len(tokens) - 1: its draft of tokens[p + 2] from the final
    hidden state at p and the token at p + 1."""
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    cfg = text.config
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped kernels take no float64
    x = torch.tensor([tokens])
    T = len(tokens) - 1
    f64 = lambda name: tensors[name].to(torch.float64)  # noqa: E731

    def norm(name):
        n = type(text.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps).to(torch.float64)
        n.load_state_dict({"weight": f64(name)})
        return n

    last = max(i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention")
    layer = type(text.layers[last])(cfg, last).to(torch.float64).eval()
    state = {k[len("mtp.layers.0."):]: f64(k) for k in tensors if k.startswith("mtp.layers.0.")}
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    if experts and "mlp.experts.gate_up_proj" in layer.state_dict():  # transformers keeps experts fused
        e = lambda i, w: state.pop(f"mlp.experts.{i}.{w}.weight")  # noqa: E731
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e(i, "gate_proj"), e(i, "up_proj")])
                                                          for i in experts])
        state["mlp.experts.down_proj"] = torch.stack([e(i, "down_proj") for i in experts])
    layer.load_state_dict(state)
    with torch.no_grad():
        h = text(input_ids=x[:, :T], use_cache=False).last_hidden_state  # after the final norm
        e = text.embed_tokens(x[:, 1:T + 1])
        z = torch.nn.functional.linear(torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(e),
                                                  norm("mtp.pre_fc_norm_hidden.weight")(h)], dim=-1),
                                       f64("mtp.fc.weight"))
        positions = torch.arange(T)[None]
        if cfg.model_type.startswith("qwen3_5"):  # its rotary embedding takes the three mrope rows
            positions = positions[None].expand(3, 1, -1)
        mask = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
        out = layer(z, position_embeddings=text.rotary_emb(z, positions), attention_mask=mask,
                    position_ids=torch.arange(T)[None])
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(norm("mtp.norm.weight")(out))
    return logits[0].argmax(-1).tolist()


def walk(tokens: list[int], num_prompt: int, drafts: list[int]) -> tuple[int, int]:
    """(verifications, accepted drafts) of a greedy answer decoded with one head draft a step, every proposal
    verified, the proposer switched off under a per-token acceptance of 0.1 and probed every 16 steps
    (engine/speculative.h SpecState, in float32 as there)."""
    f = np.float32
    kept, examined, idle = f(3.0), f(4.0), 0
    j, verifications, accepted = num_prompt - 1, 0, 0  # j: the last position the previous step kept
    max_new = len(tokens) - num_prompt
    while j + 2 - num_prompt < max_new:
        if kept / examined < f(0.1):
            idle += 1
            if idle < 16:
                j += 1  # a step without a draft
                continue
            idle = 0
        verifications += 1
        hit = tokens[j + 2] == drafts[j]
        kept = f(0.8) * kept + f(hit)
        examined = f(0.8) * examined + f(1.0)
        accepted += hit
        j += 2 if hit else 1
    return verifications, accepted


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_mtp_drafts_are_the_heads_argmax(kind, tmp_path):
    model, tensors = mtp_model(tmp_path, kind, seed=80)
    rng = np.random.default_rng(81)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (5, 23, 40, 9)]
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    with pipeline(tmp_path, EngineConfig(**BASE, speculative="off")) as pipe:
        expected = [r.token_ids for r in pipe(prompts, gen)]
    total = 0
    # without prompt pacing each prompt is one step (the walk starts after it)
    with pipeline(tmp_path, EngineConfig(**BASE, **FIXED, speculative="mtp", decode_slowdown=0)) as pipe:
        for prompt, answer in zip(prompts, expected):  # one at a time: each one's counts
            before = pipe.engine.metrics()
            assert pipe([prompt], gen)[0].token_ids == answer
            m = pipe.engine.metrics()
            got = (m.num_verifications["mtp"] - before.num_verifications["mtp"],
                   m.num_accepted_draft_tokens["mtp"] - before.num_accepted_draft_tokens["mtp"])
            assert got == walk(prompt + answer, len(prompt), reference_drafts(model, tensors, prompt + answer))
            total += got[1]
        assert m.num_draft_tokens["ngram"] == 0 and m.num_draft_tokens["suffix"] == 0
        pipe.engine.check_integrity()
    assert total >= 4  # the drafts were right often enough for the counts to tell the head's argmax
    # all four at once: one prefill step and then decode steps of four sequences (the head's batch of several)
    walks = [walk(p + a, len(p), reference_drafts(model, tensors, p + a)) for p, a in zip(prompts, expected)]
    with pipeline(tmp_path, EngineConfig(**BASE, **FIXED, speculative="mtp", decode_slowdown=0)) as pipe:
        assert [r.token_ids for r in pipe(prompts, gen)] == expected
        m = pipe.engine.metrics()
    assert (m.num_verifications["mtp"], m.num_accepted_draft_tokens["mtp"]) == tuple(map(sum, zip(*walks)))


def test_prefix_hits_carry_the_heads_kv(tmp_path):
    """A later request whose prompt continues an earlier one's (with the token it answered: the head's K/V at a
    block's last row read the token after it) starts from its cached blocks and drafts exactly as the reference
    does over its whole sequence. (The earlier request ends with its prefill, and the engine still writes the
    head's K/V of its rows; this random head's attention hardly reads far positions, so leaving them unwritten
    does not show here: the check is that hits read the right blocks of the head's layer.)"""
    model, tensors = mtp_model(tmp_path, "dense", seed=86)
    rng = np.random.default_rng(87)
    first = rng.integers(0, 256, size=32).tolist()  # two blocks of 16
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    config = EngineConfig(**BASE, **FIXED, speculative="mtp", decode_slowdown=0, enable_prefix_caching=True)
    with pipeline(tmp_path, config) as pipe:
        token = pipe([first], GenerationConfig(max_new_tokens=1, ignore_eos=True))[0].token_ids
        second = first + token + rng.integers(0, 256, size=7).tolist()
        before = pipe.engine.metrics()
        answer = pipe([second], gen)[0].token_ids
        m = pipe.engine.metrics()
    assert m.num_prefix_hit_tokens - before.num_prefix_hit_tokens >= 16  # (a hybrid's hit: where a state snapshot is)
    got = (m.num_verifications["mtp"] - before.num_verifications["mtp"],
           m.num_accepted_draft_tokens["mtp"] - before.num_accepted_draft_tokens["mtp"])
    assert got == walk(second + answer, len(second), reference_drafts(model, tensors, second + answer))


def test_mtp_drafts_with_chunked_prefill_prefix_hits_preemption_and_n(tmp_path):
    """A pool that preempts, prefix caching, prompts longer than the step budget, n = 3 seeded completions,
    penalties and logprobs: the tokens of speculation off (what the head drafts, right or wrong, never changes
    them; that its K/V come back with prefix hits: test_prefix_hits_carry_the_heads_kv)."""
    mtp_model(tmp_path, "dense", seed=82)
    rng = np.random.default_rng(83)
    prompts, gens = spec_stress_requests(rng)
    base = dict(BASE, **SPEC_STRESS_POOL)

    def run(spec: str):
        with pipeline(tmp_path, EngineConfig(**base, **FIXED, speculative=spec)) as pipe:
            out = submit_all(pipe.engine, prompts, gens)
            out += submit_all(pipe.engine, prompts, gens)  # again: prefix hits
            m = pipe.engine.metrics()
            pipe.engine.check_integrity()
            # nothing held: every block free or cached for prefix hits, every state slot free or a snapshot
            assert m.num_active_blocks == 0 and m.num_free_blocks + m.num_cached_blocks == m.num_total_blocks
            assert m.num_free_state_slots + m.num_state_snapshots == m.num_total_state_slots
        return out, m

    expected, m0 = run("off")
    got, m = run("mtp")
    assert got == expected
    assert m.num_preemptions > 0 and m.num_prefix_hit_tokens > 0
    assert 0 < m.num_accepted_draft_tokens["mtp"] < m.num_draft_tokens["mtp"]


BF16 = [pytest.mark.skipif(not _engine.cpu_bf16_available(), reason="bf16 dot products need AVX512_BF16")]


@pytest.mark.parametrize("settings", [pytest.param(dict(dtype="bfloat16"), marks=BF16, id="bf16"),
                                      pytest.param(dict(dtype="float32", quant_policy=8), id="int8-kv"),
                                      pytest.param(dict(dtype="bfloat16", quant_policy=4), marks=BF16,
                                                   id="bf16-int4-kv")])
def test_mtp_drafts_on_the_fast_paths(settings, tmp_path):
    """bf16 compute and int8 / int4 KV (the head's pool layer stored as its shape layer's), a MoE head: the tokens
    of speculation off, with drafts kept."""
    mtp_model(tmp_path, "moe", seed=88)
    rng = np.random.default_rng(89)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (5, 23, 40, 9)]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    m = speculation_keeps_tokens(tmp_path, {**BASE, **settings}, prompts, gen, "mtp")
    assert m.num_accepted_draft_tokens["mtp"] > 0


def test_mtp_cancellations_in_flight_free_every_block_and_slot(tmp_path):
    mtp_model(tmp_path, "dense", seed=84)
    with pipeline(tmp_path, EngineConfig(**BASE, **FIXED, speculative="mtp")) as pipe:
        run_with_random_cancellations(pipe.engine, random.Random(11), num_requests=30, max_prompt=40)
        m = pipe.engine.metrics()
        assert m.num_verifications["mtp"] > 0
        assert m.num_free_state_slots == m.num_total_state_slots
        assert_blocks_free(pipe.engine)
        pipe.engine.check_integrity()


def test_mtp_needs_a_head(tmp_path):
    folder = tmp_path / "m"
    write_qwen3_5_multimodal(folder, "Qwen3_5Config", dict(QWEN3_5, num_hidden_layers=4, max_position_embeddings=512,
                                                           **TOKEN_IDS), seed=85)
    with pytest.raises(ValueError, match=r"speculative='mtp' needs a model with a multi-token-prediction head .*"
                                         r"Qwen3_5ForConditionalGeneration here has none: use speculative='ngram'"):
        pipeline(folder, EngineConfig(**BASE, speculative="mtp"))
    with pytest.raises(ValueError, match="CUDA backend does not verify"):
        EngineConfig(device="cuda", speculative="mtp")
    shutil.rmtree(folder)
