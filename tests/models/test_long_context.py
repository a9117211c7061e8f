"""Long contexts (issue 66, point 4) against HF transformers fp32: tiny random models with the rope scalings of
the 128k-token families (Llama 3's llama3, Qwen3's yarn, Phi's LongRoPE; tests/factories.py LONG_CONTEXT_CASES)
served prompts of LONG_TOKENS tokens, past each pretraining length, in 4,096-token chunks over 64-token blocks:
every compared logit row (prompt and decode) within 1e-4 relative of HF's over the same sequence and the greedy
tokens HF's, with an fp32 cache; with int8 / int4 caches the fake-quantized reference's; a second prompt sharing
all but the last 2,000 tokens served from the prefix cache with HF's logprobs. One 131,000-token session
(positions past 2^16, where an fp32 angle keeps few fraction bits) of a one-layer, one-head llama3 model as HF
computes it. A pool too small for the
context refuses it with the numbers. The figures at 32k and 128k: benchmark/bench_long_context.py.

    pytest tests/models/test_long_context.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import LONG_CONTEXT_CASES, LONGEST_CONTEXT_CASES, build_case
from tests.helpers import kv_quantized_logits

LONG_TOKENS = 34_000  # past Qwen3's 32,768 too
LONGEST_TOKENS = 131_000  # the 128k test: its own one-head model, fp32 KV
NEW_TOKENS = 8
CHUNK_TOKENS = 4096
REL_TOL = 1e-4
ROWS_EVERY = 997  # prompt rows compared: every 997th, the last 64 and every decode row


@pytest.fixture(scope="module", params=sorted(LONG_CONTEXT_CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_case(request.param, folder, LONG_CONTEXT_CASES)


def serve(folder, prompts: list[list[int]], gens: list[GenerationConfig] | None = None, **config) -> tuple[list, int]:
    """Each prompt in turn through one engine (fp32, 4,096-token prefill chunks, prefix caching), NEW_TOKENS
    greedy tokens with every row's logits (or as ``gens`` say); (responses, prefix-hit tokens), the engine's
    blocks checked after."""
    settings = dict(device="cpu", dtype="float32", max_batch_size=1, cache_block_seq_len=64,
                    max_prefill_token_num=CHUNK_TOKENS, enable_prefix_caching=True, speculative="off",
                    session_len=max(len(p) for p in prompts) + NEW_TOKENS)
    gens = gens or [GenerationConfig(max_new_tokens=NEW_TOKENS, output_logits=True, ignore_eos=True)] * len(prompts)
    with pipeline(folder, EngineConfig(**{**settings, **config})) as pipe:
        out = [pipe(p, gen) for p, gen in zip(prompts, gens)]
        hits = pipe.engine.metrics().num_prefix_hit_tokens
        pipe.engine.check_integrity()
    for r in out:
        assert r.error is None and r.finish_reason == "length", (r.finish_reason, r.error)
    return out, hits


def compared_rows(prompt_len: int) -> np.ndarray:
    """Row r holds the logits that predict token r + 1."""
    last = prompt_len + NEW_TOKENS - 1
    return np.unique(np.concatenate([np.arange(0, last, ROWS_EVERY), np.arange(prompt_len - 64, last)]))


def hf_rows(ref, full: list[int], rows: np.ndarray, bits: int = 0) -> np.ndarray:
    if bits:
        return kv_quantized_logits(ref, full, bits)[rows]
    with torch.no_grad():
        return ref(torch.tensor([full])).logits[0, rows].numpy()


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def assert_rows_match(name: str, response, prompt: list[int], want: np.ndarray, rows: np.ndarray) -> None:
    got = response.logits[rows]
    err = row_errors(got, want)
    bad = np.flatnonzero(err > REL_TOL)
    assert bad.size == 0, (f"{name}: {bad.size} of {len(rows)} rows off by more than {REL_TOL:g}; first at position "
                           f"{rows[bad[0]]} ({err[bad[0]]:.3g}), worst {err.max():.3g} at {rows[err.argmax()]}")
    decode = want[rows >= len(prompt) - 1]
    assert decode.argmax(-1).tolist() == response.token_ids, f"{name}: greedy tokens are not HF's argmax"


@pytest.mark.slow
def test_long_prompt_matches_hf(case):
    """A LONG_TOKENS prompt (every row's logits), then one sharing all but its last 2,000 tokens, its prefix
    cached (the logprobs of its greedy tokens: a cached row has no logits): both as HF."""
    name, folder, ref = case
    rng = np.random.default_rng(LONG_CONTEXT_CASES[name].seed)
    first = rng.integers(0, 256, size=LONG_TOKENS).tolist()
    second = first[:-2000] + rng.integers(0, 256, size=1000).tolist()
    gens = [GenerationConfig(max_new_tokens=NEW_TOKENS, output_logits=True, ignore_eos=True),
            GenerationConfig(max_new_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)]
    (a, b), hits = serve(folder, [first, second], gens)
    rows = compared_rows(len(first))
    assert_rows_match(name, a, first, hf_rows(ref, first + a.token_ids, rows), rows)
    assert hits >= (LONG_TOKENS - 2000) // 64 * 64 - 64, f"{name}: only {hits} prefix-hit tokens"
    decode_rows = np.arange(len(second) - 1, len(second) - 1 + NEW_TOKENS)
    want = torch.log_softmax(torch.from_numpy(hf_rows(ref, second + b.token_ids, decode_rows)), -1).numpy()
    assert want.argmax(-1).tolist() == b.token_ids, f"{name}, prefix cached: greedy tokens are not HF's argmax"
    for k, (token, alternatives) in enumerate(zip(b.token_ids, b.logprobs)):
        got = np.array([alternatives[t] for t in sorted(alternatives)])
        expect = want[k, sorted(alternatives)]
        assert np.abs(got - expect).max() <= 1e-4, (f"{name}, prefix cached: new token {k}: logprobs {got} "
                                                    f"against HF's {expect}")


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_long_prompt_kv_quantized_matches_fake_quant_reference(case, bits):
    """int8 / int4 KV over LONG_TOKENS: nearer HF with K/V fake-quantized the same way (2e-3 / 1e-2 relative over
    the rows) than 5x its distance to the fp model."""
    name, folder, ref = case
    if name != "llama3":
        pytest.skip("one rope scaling is enough for the KV precisions (test_long_prompt_matches_hf covers each)")
    prompt = np.random.default_rng(bits).integers(0, 256, size=LONG_TOKENS).tolist()
    (r,), _ = serve(folder, [prompt], quant_policy=bits)
    rows = compared_rows(len(prompt))
    full = prompt + r.token_ids
    want, fp = hf_rows(ref, full, rows, bits), hf_rows(ref, full, rows)
    got = r.logits[rows]
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    err_fp = float(np.linalg.norm(got - fp) / np.linalg.norm(fp))
    bound = 2e-3 if bits == 8 else 1e-2
    assert err <= bound and err < err_fp / 5, (
        f"{name}: int{bits} KV over {LONG_TOKENS} tokens: rel err {err:.3g} to the fake-quantized reference "
        f"(bound {bound:g}), {err_fp:.3g} to the fp model")


@pytest.mark.slow
def test_a_128k_session_matches_hf(tmp_path):
    """LONGEST_TOKENS in one session (positions past 2^16 and up to 131,007), fp32 KV: a one-layer, one-head model
    with the llama3 scaling (the attention over 131k keys is the cost, on both sides)."""
    ref = build_case("llama3_one_head", tmp_path, LONGEST_CONTEXT_CASES)
    prompt = np.random.default_rng(7).integers(0, 256, size=LONGEST_TOKENS).tolist()
    (r,), _ = serve(tmp_path, [prompt], enable_prefix_caching=False)
    rows = compared_rows(len(prompt))
    assert_rows_match(f"llama3, {LONGEST_TOKENS} tokens", r, prompt, hf_rows(ref, prompt + r.token_ids, rows), rows)


def test_a_context_the_pool_cannot_hold_is_refused_naming_the_numbers(case):
    """A LONG_TOKENS prompt on a pool of 16k tokens: refused at once (error kind does_not_fit) with the blocks it
    needs and the pool's; the engine serves the next request."""
    name, folder, _ = case
    if name != "llama3":
        pytest.skip("admission does not depend on the rope")
    config = EngineConfig(device="cpu", dtype="float32", max_batch_size=1, cache_block_seq_len=64,
                          cache_max_entry_count=256, session_len=LONG_TOKENS + NEW_TOKENS)
    with pipeline(folder, config) as pipe:
        r = pipe([5] * LONG_TOKENS, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert r.finish_reason == "error" and r.error_kind == "does_not_fit", (r.finish_reason, r.error)
        assert f"prompt {LONG_TOKENS}" in r.error and "the whole KV pool has 256 blocks" in r.error, r.error
        ok = pipe([5] * 100, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert ok.finish_reason == "length" and len(ok.token_ids) == NEW_TOKENS
        pipe.engine.check_integrity()
