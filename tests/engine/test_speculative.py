"""Speculative decoding (engine/speculative.h): greedy output token for token the same with and without it, for
every proposer and family, with chunked prefill, prefix-cache hits, preemption, n > 1, structured output and
cancellations in flight; sampled output keeps its distribution (chi-square against the float64 reference); a
proposer that is always wrong costs only probes; every KV block comes back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmkit import EngineConfig, GenerationConfig, StructuredOutput, pipeline
from lmkit._ext import _engine
from tests.factories import build_case
from tests.helpers import (assert_blocks_free, assert_draws_follow, hf_greedy, reference_distribution,
                           run_with_random_cancellations, submit_all)

BASE = dict(device="cpu", dtype="float32", cache_max_entry_count=96, cache_block_seq_len=16, max_batch_size=8)
FIXED = dict(speculative_adaptive=False)  # every proposal verified: the tests see every path, whatever steps cost


def corrupted(tokens: list[int], every: int, rng) -> list[int]:
    """tokens with every ``every``-th one replaced: a prediction right in runs and wrong between them."""
    out = list(tokens)
    for i in range(every - 1, len(out), every):
        out[i] = int((out[i] + 1 + rng.integers(0, 200)) % 256)
    return out


def generate(folder, config: EngineConfig, prompts, gens) -> tuple[list[list[int]], object]:
    with pipeline(folder, config) as pipe:
        out = [tokens for tokens, _ in submit_all(pipe.engine, prompts, gens)]
        pipe.engine.check_integrity()
        return out, pipe.engine.metrics()


def verify_corrupted_predictions(folder, prompts, expected, new_tokens: int, rng):
    """expected again with each prompt's expected tokens as its prediction, right in runs of 4 and wrong between
    them (drafts kept and rejected at every offset), every proposal verified; returns (metrics, the configs)."""
    predicted = [GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, prediction=corrupted(e, 5, rng))
                 for e in expected]
    got, m = generate(folder, EngineConfig(**BASE, **FIXED, speculative="ngram", num_speculative_tokens=6), prompts,
                      predicted)
    assert got == expected
    accepted, proposed = m.num_accepted_draft_tokens["prediction"], m.num_draft_tokens["prediction"]
    assert 0 < accepted < proposed, (accepted, proposed)
    return m, predicted


def periodic_prompts(rng, n: int) -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookup finds continuations in them) and plain random ones."""
    prompts = []
    for i in range(n):
        unit = rng.integers(0, 256, size=int(rng.integers(3, 9))).tolist()
        prompts.append((unit * 12)[: int(rng.integers(20, 60))] if i % 2 == 0 else
                       rng.integers(0, 256, size=int(rng.integers(5, 40))).tolist())
    return prompts


@pytest.mark.parametrize("case", ["llama32_tied", "mistral_window", "qwen3", "gemma2", "gemma3", "phi3",
                                  "qwen3_moe", "mixtral_window"])
def test_greedy_is_identical_with_every_proposer(tmp_path, case):
    """Each family (dense, windowed, soft-capped, MoE): the same greedy tokens with speculation off, with n-gram
    lookup alone, and with a prediction that is right in runs of 4 and wrong between them (so drafts are accepted
    and rejected at every offset); the drafts were verified, some kept and some not."""
    build_case(case, tmp_path)
    rng = np.random.default_rng(3)
    prompts = periodic_prompts(rng, 6)
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    expected, _ = generate(tmp_path, EngineConfig(**BASE, speculative="off"), prompts, gen)
    got, m = generate(tmp_path, EngineConfig(**BASE, **FIXED, speculative="ngram"), prompts, gen)
    assert got == expected
    m, _ = verify_corrupted_predictions(tmp_path, prompts, expected, 40, rng)
    assert m.mean_accepted_length("prediction") > 1.0


FAST_PATHS = [pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _engine.cpu_bf16_available(), reason="bf16 dot products need AVX512_BF16")), "gguf"]


@pytest.mark.slow
@pytest.mark.parametrize("path", FAST_PATHS)
def test_greedy_is_identical_on_the_fast_paths(path):
    """The bundled SmolLM2 on bf16 dot products (dtype bfloat16, the default on AVX512_BF16 CPUs) and as the shipped
    Q4_1 GGUF on int8 activations: the kernels are batch-invariant (a draft row scores as its decode step would,
    csrc/tests/test_cpu_kernels.cpp), so greedy output is token for token the same with speculation, with drafts
    accepted and rejected, alone and batched."""
    from lmkit.model_path import default_gguf_path, default_model_dir

    model = default_model_dir() if path == "bfloat16" else default_gguf_path()
    config = dict(device="cpu", dtype="bfloat16" if path == "bfloat16" else "auto", max_batch_size=8)
    rng = np.random.default_rng(11)
    prompts = periodic_prompts(rng, 4)
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    expected, _ = generate(model, EngineConfig(**config, speculative="off"), prompts, gen)
    predicted = [GenerationConfig(max_new_tokens=48, ignore_eos=True, prediction=corrupted(e, 6, rng))
                 for e in expected]
    got, m = generate(model, EngineConfig(**config, **FIXED, speculative="ngram"), prompts, predicted)
    assert got == expected
    assert 0 < m.num_accepted_draft_tokens["prediction"] < m.num_draft_tokens["prediction"]
    alone = [generate(model, EngineConfig(**config, **FIXED, speculative="ngram"), [p], g)[0][0]
             for p, g in zip(prompts[:2], predicted[:2])]
    assert alone == expected[:2]


def test_suffix_proposes_earlier_answers(tiny_llama):
    """speculative='suffix': a second request whose answer repeats an earlier one takes its drafts from the store of
    finished answers (most of them kept); the tokens are those of speculation off; 'ngram' keeps no store."""
    folder, _ = tiny_llama
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, size=20).tolist() for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    expected, _ = generate(folder, EngineConfig(**BASE, speculative="off"), prompts, gen)
    with pipeline(folder, EngineConfig(**BASE, **FIXED, speculative="suffix")) as pipe:
        first = [tokens for tokens, _ in submit_all(pipe.engine, prompts, gen)]
        again = [tokens for tokens, _ in submit_all(pipe.engine, prompts, gen)]
        m = pipe.engine.metrics()
    assert first == again == expected
    assert m.num_accepted_draft_tokens["suffix"] > 0.7 * 3 * 47, m.num_accepted_draft_tokens
    with pipeline(folder, EngineConfig(**BASE, **FIXED, speculative="ngram")) as pipe:
        submit_all(pipe.engine, prompts, gen)
        submit_all(pipe.engine, prompts, gen)
        assert pipe.engine.metrics().num_draft_tokens["suffix"] == 0


HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.mark.parametrize("case", HYBRIDS)
def test_hybrid_models_roll_their_state_back(tmp_path, capfd, case):
    """Gated DeltaNet hybrids: a rejected draft's row ran through the recurrent layers, and the sequence goes on from
    the checkpoint of its last row kept. Greedy tokens are HF's (transformers fp32) with a prediction right in runs
    of 4 and wrong between them (drafts kept and rejected at every offset, four sequences in a step), and with
    the adaptive rule (its step timings run on a state slot and checkpoints); the pool has a checkpoint slot per
    draft of two sequences, and every slot is free after."""
    ref = build_case(case, tmp_path)
    rng = np.random.default_rng(62)
    prompts = periodic_prompts(rng, 4)
    expected = [hf_greedy(ref, p, 32, None) for p in prompts]
    m, predicted = verify_corrupted_predictions(tmp_path, prompts, expected, 32, rng)
    assert m.num_total_state_slots == BASE["max_batch_size"] + 2 * 6 == m.num_free_state_slots
    got, m = generate(tmp_path, EngineConfig(**BASE, speculative="ngram"), prompts, predicted)
    assert got == expected
    assert "timing steps for speculative decoding failed" not in capfd.readouterr().err


def test_hybrid_drafts_with_chunked_prefill_prefix_hits_preemption_and_n(tmp_path):
    """A hybrid in a pool that holds the n = 3 request alone (preemption recomputes the state; at 20 blocks one
    arrival order of the requests, in a full-suite run, left none; at 16 each of 12 runs preempted 8 times or more),
    prefix caching (the same prompts twice: the second round's hits start from snapshots, beside the checkpoint
    slots), prompts longer than the step budget, n = 3 seeded completions, penalties and logprobs: the tokens of
    speculation off, drafts kept and rejected."""
    build_case("qwen3_5", tmp_path)
    rng = np.random.default_rng(63)
    doc = (rng.integers(0, 256, size=7).tolist() * 10)[:48]
    prompts = [doc + p for p in periodic_prompts(rng, 6)]
    base = dict(BASE, cache_max_entry_count=16, max_prefill_token_num=24, max_batch_size=6, enable_prefix_caching=True)

    def run(spec: str, gens):
        with pipeline(tmp_path, EngineConfig(**base, **(FIXED if spec != "off" else {}), speculative=spec)) as pipe:
            out = submit_all(pipe.engine, prompts, gens)
            out += submit_all(pipe.engine, prompts, gens)  # again: hits on the snapshots of the first round
            m = pipe.engine.metrics()
            pipe.engine.check_integrity()
        return [tokens for tokens, _ in out], m

    gens = [GenerationConfig(max_new_tokens=40, ignore_eos=True, n=3 if i == 0 else 1, logprobs=2,
                             repetition_penalty=1.3 if i == 1 else 1.0, min_new_tokens=10 if i == 2 else 0,
                             do_sample=i == 0, random_seed=5, temperature=0.7)
            for i in range(len(prompts))]
    expected, m0 = run("off", gens)
    predicted = [GenerationConfig(**{**g.__dict__, "prediction": corrupted(expected[i + 2 * (i > 0)], 4, rng)})
                 for i, g in enumerate(gens)]
    got, m = run("ngram", predicted)
    assert got == expected
    assert m0.num_preemptions > 0 and m.num_preemptions > 0 and m.num_prefix_hit_tokens > 0
    assert 0 < m.num_accepted_draft_tokens["prediction"] < m.num_draft_tokens["prediction"]


def test_hybrid_cancellations_in_flight_free_every_checkpoint(tmp_path):
    """Random cancellations (whole requests or one completion, waiting, mid-prefill or verifying drafts) of a
    speculating hybrid: every block, state slot and checkpoint slot comes back."""
    build_case("qwen3_5", tmp_path)
    with pipeline(tmp_path, EngineConfig(**BASE, **FIXED, speculative="ngram")) as pipe:
        run_with_random_cancellations(pipe.engine, random.Random(10), num_requests=40, max_prompt=40,
                                      predictions=True)
        m = pipe.engine.metrics()
        assert m.num_verifications["prediction"] > 0
        assert m.num_free_state_slots == m.num_total_state_slots
        assert_blocks_free(pipe.engine)
        pipe.engine.check_integrity()


def test_cuda_refuses_ngram_by_name():
    with pytest.raises(ValueError, match="CUDA backend does not verify"):
        EngineConfig(device="cuda", speculative="ngram")


def test_chunked_prefill_prefix_hits_preemption_and_n(tiny_llama):
    """A pool too small for all requests (preemption and recomputation), prefix caching, prompts longer than the
    step budget, n = 3 completions with seeds, penalties and logprobs: the tokens and logprobs of speculation off."""
    folder, _ = tiny_llama
    rng = np.random.default_rng(5)
    doc = (rng.integers(0, 256, size=7).tolist() * 10)[:64]
    prompts = [doc + p for p in periodic_prompts(rng, 6)]
    gens = [GenerationConfig(max_new_tokens=48, ignore_eos=True, n=3 if i == 0 else 1, logprobs=2,
                             repetition_penalty=1.3 if i == 1 else 1.0, min_new_tokens=10 if i == 2 else 0,
                             prediction=None if i % 2 else (doc * 2)[:50])
            for i in range(len(prompts))]
    base = dict(BASE, cache_max_entry_count=20, max_prefill_token_num=24, max_batch_size=6, enable_prefix_caching=True)

    def run(spec: str):
        with pipeline(folder, EngineConfig(**base, **(FIXED if spec != "off" else {}), speculative=spec)) as pipe:
            out = submit_all(pipe.engine, prompts, gens)
            m = pipe.engine.metrics()
            pipe.engine.check_integrity()
        return out, m

    expected, m0 = run("off")
    got, m = run("ngram")
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    # a preempted request recomputes its generated tokens as prompt rows (the prefill attention kernel, where they
    # were decode rows), and the two runs are preempted at other steps: later logits may differ in the last bits
    for (_, lp), (_, lp0) in zip(got, expected):
        np.testing.assert_allclose(lp, lp0, atol=3e-4)
    assert m0.num_preemptions > 0 and m.num_prefix_hit_tokens > 0
    assert sum(m.num_accepted_draft_tokens.values()) > 0


def test_structured_output_verifies_the_drafts_its_grammar_allows(tiny_llama):
    """Grammar-constrained requests take drafts: each draft row samples under the grammar's mask after the drafts
    before it (the matcher consumes them on the mask worker and rolls back), drafts the grammar refuses are cut
    before they are verified, and the output is speculation off's, greedy and seeded, token for token (a row
    sampled under another row's mask would draw another token, or one the grammar refuses); a grammar that starts
    after a token takes no draft past it until its matcher starts."""
    folder, _ = tiny_llama
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    regex = StructuredOutput(regex="(ab|cd|ef){12,24}x")
    schema = StructuredOutput(json={"type": "object", "properties": {"k": {"type": "array", "items": {
        "type": "integer"}, "maxItems": 6}}, "required": ["k"], "additionalProperties": False})
    free, _ = generate(folder, EngineConfig(**BASE, speculative="off"), [prompt],
                       GenerationConfig(max_new_tokens=8, ignore_eos=True))
    gens = [GenerationConfig(max_new_tokens=40, structured_output=regex),
            GenerationConfig(max_new_tokens=40, structured_output=schema),
            GenerationConfig(max_new_tokens=40, structured_output=regex, do_sample=True, temperature=0.9,
                             random_seed=3),
            # free text until its 4th token, the grammar after it (reasoning's end): drafts stop at that token
            GenerationConfig(max_new_tokens=40, structured_output=regex, structured_output_after_token=free[0][3])]
    expected, _ = generate(folder, EngineConfig(**BASE, speculative="off"), [prompt] * 4, gens)
    assert free[0][3] in expected[3] and len(expected[3]) > 20
    with pipeline(folder, EngineConfig(**BASE)) as pipe:
        a, c, e = (pipe.engine.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "ace")

    def half_right(tokens):  # every 3rd pair start swapped for another: allowed, then the pair's second refused
        return [(c if t == a else a) if i % 3 == 2 and t in (a, c, e) else t for i, t in enumerate(tokens)]
    for predictions in ([list(e) for e in expected], [half_right(e) for e in expected]):
        predicted = [GenerationConfig(**{**g.__dict__, "prediction": pred}) for g, pred in zip(gens, predictions)]
        got, m = generate(folder, EngineConfig(**BASE, **FIXED, speculative="ngram"), [prompt] * 4, predicted)
        assert got == expected
        assert m.num_accepted_draft_tokens["prediction"] > 20, m.num_accepted_draft_tokens
    assert m.num_accepted_draft_tokens["prediction"] < m.num_draft_tokens["prediction"]


def test_opt_out_and_logits_take_no_drafts(tiny_llama):
    """A request with speculative=False and one that reads every row's logits decode one token a step, beside a
    speculating one, with the output of speculation off."""
    folder, _ = tiny_llama
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    opted_out = GenerationConfig(max_new_tokens=20, ignore_eos=True, speculative=False, prediction=prompt)
    logits = GenerationConfig(max_new_tokens=20, ignore_eos=True, output_logits=True, prediction=prompt)
    plain = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    expected, _ = generate(folder, EngineConfig(**BASE, speculative="off"), [prompt] * 3, [opted_out, logits, plain])
    with pipeline(folder, EngineConfig(**BASE, **FIXED, speculative="ngram")) as pipe:
        assert [pipe(prompt, g).token_ids for g in (opted_out, logits)] == expected[:2]
        m = pipe.engine.metrics()
        assert sum(m.num_verifications.values()) == 0
        assert pipe(prompt, plain).token_ids == expected[2]


def test_cancellations_in_flight_leave_nothing_behind(tiny_llama):
    folder, _ = tiny_llama
    with pipeline(folder, EngineConfig(**BASE, **FIXED, speculative="suffix")) as pipe:
        run_with_random_cancellations(pipe.engine, random.Random(9), num_requests=40, max_prompt=40)
        assert sum(pipe.engine.metrics().num_verifications.values()) > 0
        assert_blocks_free(pipe.engine)
        pipe.engine.check_integrity()


def test_an_always_wrong_proposer_costs_only_probes(tiny_llama):
    """A prediction that is never right: after its first rejections it stops proposing and probes every 16 steps
    (the other proposers go on by their own acceptance)."""
    folder, _ = tiny_llama
    prompt = [9, 10, 11, 12]
    gen = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    expected, _ = generate(folder, EngineConfig(**BASE, speculative="off"), [prompt], gen)
    wrong = [(t + 7) % 256 for t in expected[0]]  # every token wrong (realignment on it never matches either)
    got, m = generate(folder, EngineConfig(**BASE, **FIXED, speculative="ngram"), [prompt],
                      GenerationConfig(max_new_tokens=200, ignore_eos=True, prediction=wrong))
    assert got == expected
    assert m.num_accepted_draft_tokens["prediction"] == 0
    # 4 + 4 + 2 + 2 drafts until its acceptance falls under the threshold, then probes of 2
    assert m.num_verifications["prediction"] <= 4 + 200 // 16, m.num_verifications
    assert m.num_draft_tokens["prediction"] <= 12 + 2 * (200 // 16), m.num_draft_tokens


@pytest.mark.parametrize("filters", [dict(temperature=0.5), dict(temperature=0.6, top_p=0.8),
                                     dict(temperature=0.5, top_k=12, min_p=0.05)],
                         ids=["temperature", "top_p", "top_k+min_p"])
def test_verified_samples_keep_the_distribution(tiny_llama_pipe, tiny_llama, filters):
    """The second token of completions whose first token is f, with the prediction [f, d]: every such token was
    drawn by a verification (d kept when the row's draw is d, which happens with probability p(d); otherwise the
    draw is the token), and their frequencies match the float64 reference of p(. | prompt, f) (chi-square,
    p > 1e-4; seeded, so fixed once it passes)."""
    folder, _ = tiny_llama
    prompt = [66, 67, 68]  # a prompt whose first token is likely at these temperatures (p(f) 0.25-0.4)
    first = tiny_llama_pipe(prompt, GenerationConfig(max_new_tokens=1, output_logits=True)).logits[-1]
    f = int(np.argmax(first))
    logits = tiny_llama_pipe(prompt + [f], GenerationConfig(max_new_tokens=1, output_logits=True)).logits[-1]
    expect = reference_distribution(logits, **filters)
    d = int(np.argsort(-expect)[1])  # the second most likely: kept often, rejected often
    # 32 completions at a time: each gets its draft within the engine's 32 draft rows a step
    with pipeline(folder, EngineConfig(**{**BASE, "max_batch_size": 32}, **FIXED, speculative="ngram")) as pipe:
        second = []
        for seed in range(320):
            gen = GenerationConfig(max_new_tokens=2, do_sample=True, n=32, random_seed=seed, ignore_eos=True,
                                   prediction=[f, d], speculative=True, **filters)
            second += [o.token_ids[1] for o in pipe(prompt, gen) if o.token_ids[0] == f]
        m = pipe.engine.metrics()
    # every such second token was drawn by a verification; a completion whose prompt's last token was computed
    # alone (prompt pacing cut its chunk there) may also have verified [f, d] from that row
    assert m.num_verifications["prediction"] >= len(second)
    assert 0 < m.num_accepted_draft_tokens["prediction"] < len(second)
    assert len(second) > 2000, len(second)
    assert_draws_follow(second, expect, filters)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _engine.cpu_bf16_available(), reason="bf16 dot products need AVX512_BF16"))])
def test_seeded_sampling_gives_the_same_text_with_drafts(tiny_llama, dtype):
    """A seeded sampled request takes drafts by default and gives the text it gives without them, token for token
    (its draws are seeded by position and a verified row's logits are its one-token step's to the bit);
    speculative=False takes none."""
    folder, _ = tiny_llama
    rng = np.random.default_rng(21)
    prompts = periodic_prompts(rng, 4)
    config = {**BASE, "dtype": dtype}
    gens = [GenerationConfig(max_new_tokens=30, do_sample=True, temperature=0.8, top_p=0.9, random_seed=s, n=2,
                             ignore_eos=True) for s in range(4)]
    expected, _ = generate(folder, EngineConfig(**config, speculative="off"), prompts, gens)
    predicted = [GenerationConfig(**{**g.__dict__, "prediction": corrupted(expected[2 * i], 3, rng)})
                 for i, g in enumerate(gens)]
    got, m = generate(folder, EngineConfig(**config, **FIXED, speculative="ngram"), prompts, predicted)
    assert got == expected
    assert 0 < m.num_accepted_draft_tokens["prediction"] < m.num_draft_tokens["prediction"]
    opted_out = [GenerationConfig(**{**g.__dict__, "speculative": False}) for g in predicted]
    got, m = generate(folder, EngineConfig(**config, **FIXED, speculative="ngram"), prompts, opted_out)
    assert got == expected
    assert sum(m.num_verifications.values()) == 0


def test_adaptive_speculates_where_it_pays(tiny_llama):
    """ngram with the default adaptive rule: on a tiny model a step's extra rows cost little, so the drafts of
    repetitive prompts are verified and kept; the greedy tokens are those of speculation off. auto is off. (One
    engine thread: the step timings it starts with are taken beside another test worker's engine, and two
    threads each on two busy cores time steps at random.)"""
    folder, _ = tiny_llama
    rng = np.random.default_rng(31)
    prompts = [p for p in periodic_prompts(rng, 8)][::2]  # the repeating ones
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    expected, _ = generate(folder, EngineConfig(**BASE, speculative="off"), prompts, gen)
    got, m = generate(folder, EngineConfig(**BASE, num_threads=1, speculative="ngram"), prompts, gen)
    assert got == expected
    assert m.num_accepted_draft_tokens["ngram"] > 0, m
    _, m = generate(folder, EngineConfig(**BASE), prompts, gen)
    assert sum(m.num_verifications.values()) == 0
