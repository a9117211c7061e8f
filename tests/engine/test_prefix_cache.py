"""Prefix caching: greedy output is identical with and without the cache, hits are counted, blocks
become cached (not leaked), and preemption under a small pool keeps the output unchanged."""

from __future__ import annotations

import numpy as np

from lmkit import EngineConfig, GenerationConfig, pipeline


def test_prefix_cache_output_identical_and_hits(tiny_llama):
    folder, _ = tiny_llama
    rng = np.random.default_rng(11)
    doc = rng.integers(0, 256, size=70).tolist()
    prompts = [doc + rng.integers(0, 256, size=n).tolist() for n in (1, 5, 17, 40)] + [doc[:64], doc[:33]]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    base = dict(device="cpu", cache_max_entry_count=64, cache_block_seq_len=16, max_batch_size=8)
    with pipeline(folder, EngineConfig(**base)) as pipe:
        expected = [pipe(p, gen).token_ids for p in prompts]
    with pipeline(folder, EngineConfig(**base, enable_prefix_caching=True)) as pipe:
        first = [pipe(p, gen).token_ids for p in prompts]  # one by one: later ones hit earlier blocks
        again = [r.token_ids for r in pipe(prompts, gen)]  # all at once, everything cached
        m = pipe.engine.metrics()
        assert m.num_prefix_hit_tokens >= 5 * 64, m.num_prefix_hit_tokens
        assert m.num_cached_blocks > 0
        assert m.num_free_blocks + m.num_cached_blocks == m.num_total_blocks
        pipe.engine.check_integrity()
    assert first == expected
    assert again == expected


def test_preemption_keeps_greedy_output(tiny_llama):
    """A pool too small for all requests at full length forces preemption and recomputation."""
    folder, _ = tiny_llama
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (20, 30, 12, 25, 40, 8)]
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    with pipeline(folder, EngineConfig(device="cpu", cache_max_entry_count=64, cache_block_seq_len=16)) as pipe:
        expected = [pipe(p, gen).token_ids for p in prompts]
    for caching in (False, True):
        config = EngineConfig(device="cpu", cache_max_entry_count=12, cache_block_seq_len=16, max_batch_size=6,
                              enable_prefix_caching=caching)
        with pipeline(folder, config) as pipe:
            got = [r.token_ids for r in pipe(prompts, gen)]
            assert pipe.engine.metrics().num_preemptions > 0
        assert got == expected, f"prefix caching={caching}"
