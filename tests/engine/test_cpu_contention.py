"""The engine's kernel threads with a busy neighbour: a step completes while another process keeps one of the
engine's cores busy, with the same tokens as on quiet cores. A guard against deadlock and lost wake-ups in
the thread pool (csrc/kernels/cpu/thread_pool.cpp), not a timing claim: the figures are in
benchmark/results/cpu-speed.md ("Shared cores and CPU quotas")."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lmkit import EngineConfig, GenerationConfig, pipeline

from tests.factories import make_tiny_model

BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to share one of them")
def test_steps_complete_with_a_core_held_busy(tmp_path):
    # big enough that every kernel splits its work over the team
    make_tiny_model(tmp_path / "m", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)
    # Two runs' tokens are compared: without drafts, whose rows (and, in bf16 arithmetic, the last bits of every
    # row's logits) would follow how the requests' steps happened to line up.
    config = EngineConfig(device="cpu", num_threads=2, cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, speculative="off")
    prompts = [[(7 * i) % 250 + 1 for i in range(300)], [5, 6, 7], list(range(40, 100))]
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    with pipeline(tmp_path / "m", config) as pipe:
        quiet = [r.token_ids for r in pipe(prompts, gen)]
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(min(os.sched_getaffinity(0)))])
        try:
            time.sleep(0.2)
            start = time.monotonic()
            contended = [r.token_ids for r in pipe(prompts, gen)]
            elapsed = time.monotonic() - start
        finally:
            busy.kill()
            busy.wait()
    assert contended == quiet
    assert elapsed < 120, f"3 requests of 48 tokens took {elapsed:.1f} s beside a busy process"
