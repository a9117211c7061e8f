"""Prompt logprobs (GenerationConfig.prompt_logprobs) == HF transformers' fp32 log_softmax of the same prompt:
whole prefill, chunked prefill (a chunk smaller than the prompt), a prefix-cache hit (the cached rows are
recomputed, never missing), several prompts in one batch, max_new_tokens 0, and n > 1 (scored once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import make_tiny_model

TOP = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plp") / "qwen2"
    ref = make_tiny_model(folder, "qwen2", num_key_value_heads=1, seed=7)
    return folder, ref


def hf_logprobs(ref, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()  # [len(prompt), vocab]


def check(entries, prompt: list[int], expect: np.ndarray, top: int = TOP) -> None:
    """entries: Response.prompt_logprobs of prompt; expect: HF's log_softmax rows."""
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], expect[p - 1]
        token = prompt[p]
        assert next(iter(entry)) == token  # the prompt's own token first
        assert abs(entry[token] - row[token]) <= 1e-4, (p, entry[token], row[token])
        best = np.argsort(-row, kind="stable")[:top]
        alternatives = {t: lp for t, lp in entry.items() if t != token or t in best}
        assert set(alternatives) == set(best.tolist()), p
        for t in best:
            assert abs(entry[int(t)] - row[t]) <= 1e-4


@pytest.mark.parametrize("max_prefill", [8192, 16, 7])
def test_prompt_logprobs_match_hf(model, max_prefill):
    folder, ref = model
    rng = np.random.default_rng(max_prefill)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 2, 23, 70)]
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4,
                          max_prefill_token_num=max_prefill)
    gen = GenerationConfig(max_new_tokens=3, prompt_logprobs=TOP, logprobs=2, ignore_eos=True)
    with pipeline(folder, config) as pipe:
        responses = pipe(prompts, gen)
        for prompt, r in zip(prompts, responses):
            check(r.prompt_logprobs, prompt, hf_logprobs(ref, prompt))
            assert len(r.token_ids) == 3 and len(r.logprobs) == 3
        pipe.async_engine.engine.check_integrity()


def test_prefix_cache_hit_recomputes_the_rows(model):
    folder, ref = model
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 256, size=48).tolist()
    first, second = shared + [1, 2, 3], shared + [4, 5]
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=2,
                          enable_prefix_caching=True)
    with pipeline(folder, config) as pipe:
        pipe(first, GenerationConfig(max_new_tokens=2))  # publishes the shared blocks
        plain = pipe(second, GenerationConfig(max_new_tokens=2))
        hits_before = pipe.async_engine.engine.metrics().num_prefix_hit_tokens
        assert hits_before >= 48, "the second prompt should hit the cache without prompt_logprobs"
        r = pipe(second, GenerationConfig(max_new_tokens=2, prompt_logprobs=0))
        check(r.prompt_logprobs, second, hf_logprobs(ref, second), top=0)
        assert r.token_ids == plain.token_ids
        pipe.async_engine.engine.check_integrity()


def test_max_new_tokens_zero_scores_only_the_prompt(model):
    folder, ref = model
    prompt = np.random.default_rng(9).integers(0, 256, size=40).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=8, cache_block_seq_len=16,
                          max_batch_size=2)
    with pipeline(folder, config) as pipe:
        r = pipe(prompt, GenerationConfig(max_new_tokens=0, prompt_logprobs=1))
        assert r.token_ids == [] and r.text == "" and r.finish_reason == "length"
        check(r.prompt_logprobs, prompt, hf_logprobs(ref, prompt), top=1)
        streamed = list(pipe.stream_infer([prompt], GenerationConfig(max_new_tokens=0, prompt_logprobs=1)))
        assert streamed[-1].finish_reason == "length"
        joined = [e for d in streamed if d.prompt_logprobs for e in d.prompt_logprobs]
        assert joined == r.prompt_logprobs
        m = pipe.async_engine.engine.metrics()
        assert m.num_running == 0 and m.num_free_blocks == m.num_total_blocks  # nothing held after
        pipe.async_engine.engine.check_integrity()


def test_n_completions_score_the_prompt_once(model):
    folder, ref = model
    prompt = np.random.default_rng(11).integers(0, 256, size=30).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=32, cache_block_seq_len=16,
                          max_batch_size=4)
    gen = GenerationConfig(max_new_tokens=4, n=3, do_sample=True, random_seed=1, prompt_logprobs=2)
    with pipeline(folder, config) as pipe:
        responses = pipe(prompt, gen)
    assert [r.sample_index for r in responses] == [0, 1, 2]
    check(responses[0].prompt_logprobs, prompt, hf_logprobs(ref, prompt), top=2)
    assert responses[1].prompt_logprobs is None and responses[2].prompt_logprobs is None


def test_preempted_request_hands_out_each_row_once(model):
    """A pool too small for both requests at once: the newer one is preempted and recomputed; its prompt's
    logprobs still come exactly once per token. Either request fills the pool by itself (96 tokens = 6
    blocks), so a preemption follows whenever the newer one arrives before the older has finished. The
    pipeline submits them back to back, but a step of this tiny model takes ~30 us, so on a fast core the
    older one can finish first: the pair is run again (checked every time) until a round has preempted."""
    folder, ref = model
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (20, 60)]
    expected = [hf_logprobs(ref, prompt) for prompt in prompts]
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=6, cache_block_seq_len=16,
                          max_batch_size=2, max_prefill_token_num=16, session_len=96)
    with pipeline(folder, config) as pipe:
        for _ in range(20):
            responses = pipe(prompts, GenerationConfig(max_new_tokens=76, prompt_logprobs=1, ignore_eos=True))
            for prompt, r, expect in zip(prompts, responses, expected):
                check(r.prompt_logprobs, prompt, expect, top=1)
            if pipe.async_engine.engine.metrics().num_preemptions > 0:
                break
        assert pipe.async_engine.engine.metrics().num_preemptions > 0, "the pool should have forced a preemption"
        pipe.async_engine.engine.check_integrity()
