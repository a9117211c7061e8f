"""The recurrent-state pool with a hybrid model (Qwen3.5: Gated DeltaNet layers and attention layers) against HF
transformers fp32: preemption recomputes the state (greedy output unchanged), n > 1 forks copy it at their fork
position, prefix hits start from a snapshot and give the same tokens as a cold run, and aborts, abandoned
requests and random cancellations leave every state slot free (the autouse leak check counts them too)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import build_case
from tests.helpers import assert_blocks_free, hf_greedy, run_with_random_cancellations

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    ref = build_case("qwen3_5", folder)
    rng = np.random.default_rng(62)
    doc = rng.integers(0, 256, size=37).tolist()
    prompts = [doc + rng.integers(0, 256, size=n).tolist() for n in (3, 20, 41)] + \
              [rng.integers(0, 256, size=n).tolist() for n in (5, 16, 29)]
    expected = [hf_greedy(ref, p, NEW_TOKENS, None) for p in prompts]
    return folder, prompts, expected


def config(**overrides) -> EngineConfig:
    return EngineConfig(**{**dict(device="cpu", dtype="float32", cache_max_entry_count=64, cache_block_seq_len=16,
                                  max_batch_size=8, session_len=256), **overrides})


def test_preemption_recomputes_the_state(hybrid):
    folder, prompts, expected = hybrid
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for caching in (False, True):
        with pipeline(folder, config(cache_max_entry_count=9, max_batch_size=6, max_prefill_token_num=24,
                                     enable_prefix_caching=caching)) as pipe:
            got = [r.token_ids for r in pipe(prompts, gen)]
            m = pipe.engine.metrics()
            pipe.engine.check_integrity()
        assert m.num_preemptions > 0, f"prefix caching={caching}: the pool was large enough for all"
        assert got == expected, f"prefix caching={caching}"


def test_forks_copy_the_state_at_their_fork_position(hybrid):
    """n = 3 greedy completions of prompts of 40 to 78 tokens (fork positions 32 to 64, reached by chunks that stop
    there) and of 5 tokens (fork position 0): each completion is HF's."""
    folder, prompts, expected = hybrid
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    with pipeline(folder, config(max_prefill_token_num=24)) as pipe:
        for prompt, want in zip(prompts, expected):
            responses = pipe(prompt, gen)
            assert [r.token_ids for r in responses] == [want] * 3, f"{len(prompt)}-token prompt"


def test_prefix_hits_start_from_a_snapshot(hybrid):
    """Prompts sharing a 37-token prefix, one by one and then together: hits of whole blocks with the state at
    each prompt's last full block; every output is HF's, and the snapshots stay within their slots."""
    folder, prompts, expected = hybrid
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with pipeline(folder, config(enable_prefix_caching=True)) as pipe:
        first = [pipe(p, gen).token_ids for p in prompts]
        again = [r.token_ids for r in pipe(prompts, gen)]
        m = pipe.engine.metrics()
        pipe.engine.check_integrity()
    assert first == expected and again == expected
    assert m.num_prefix_hit_tokens >= 32 + 48 + 64, m.num_prefix_hit_tokens  # the second round at least
    assert m.num_total_state_slots == 16 and 0 < m.num_state_snapshots <= 16


def test_cancellations_leave_every_state_slot_free(hybrid):
    """Random cancellations (whole requests or one completion, waiting, mid-prefill or decoding) and n > 1."""
    folder, _, _ = hybrid
    rng = random.Random(62)
    with pipeline(folder, config(max_prefill_token_num=16, enable_prefix_caching=True)) as pipe:
        engine = pipe.engine
        run_with_random_cancellations(engine, rng, 150, 60, n_choices=(1, 1, 2, 3))
        engine.check_integrity()
        m = engine.metrics()
        assert m.num_running == 0 and m.num_waiting == 0
        assert m.num_free_blocks + m.num_cached_blocks == m.num_total_blocks  # cached: kept for prefix hits
        assert m.num_free_state_slots + m.num_state_snapshots == m.num_total_state_slots
    with pipeline(folder, config(max_prefill_token_num=16)) as pipe:  # without prefix caching: all free
        for rid, q in [pipe.engine.submit_to_queue(list(range(1, 50)), GenerationConfig(max_new_tokens=8, n=2))
                       for _ in range(6)]:
            pipe.engine.cancel(rid)
        assert_blocks_free(pipe.engine)
        assert pipe.engine.metrics().num_free_state_slots == 8


def test_memory_caps_the_state_pool_and_the_running_sequences(hybrid, tmp_path, monkeypatch, caplog):
    """A host whose memory leaves room for 3 state slots (max_batch_size 8 with prefix caching wants 16): the pool
    has 3, at most 3 sequences run at once, the six prompts still all give HF's tokens, the start-up line says
    why, and the engine's reservation counts the state pool."""
    import logging

    from lmkit import memory
    from lmkit.memory import MemoryLimit, Reservations

    folder, prompts, expected = hybrid
    monkeypatch.setenv("LMKIT_RUNTIME_DIR", str(tmp_path / "runtime"))
    with pipeline(folder, config(enable_prefix_caching=True)) as pipe:
        pool = pipe.engine.kv_pool
    per_slot = pool.state.bytes_per_slot
    assert pool.state.num_slots == 16 and per_slot > 0
    left = math.ceil(3.5 * per_slot / memory.STATE_POOL_SHARE)  # a quarter of it holds 3 slots
    total = math.ceil((left + pool.weight_bytes) / 0.5)
    monkeypatch.setattr(memory, "memory_limit", lambda: MemoryLimit(total, "test"))
    caplog.set_level(logging.INFO, logger="lmkit")
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with pipeline(folder, config(enable_prefix_caching=True, cache_max_entry_count=0.5)) as pipe:
        [record] = Reservations(tmp_path / "runtime").live()
        assert record.kv_bytes == pipe.engine.kv_pool.kv_bytes + 3 * per_slot
        got = [r.token_ids for r in pipe(prompts, gen)]
        m = pipe.engine.metrics()
        pipe.engine.check_integrity()
    assert m.num_total_state_slots == 3
    assert got == expected
    assert any("recurrent-state pool: 3 slots" in r.getMessage() and "at most 3 sequences run at once" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
