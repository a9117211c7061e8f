"""Decode throughput of the engine alone (no asyncio, no detokenization) as the batch grows: b prompts
of 4 tokens submitted at once, 64 greedy tokens each; output tokens/s and mean step time.

    python benchmark/bench_batch_decode.py [--model PATH] [--batches 1 4 8 16 32 64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import threading
import time


def main(argv: list[str] | None = None) -> None:
    from lmkit import EngineConfig, GenerationConfig
    from lmkit.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    engine = Engine(args.model, EngineConfig(max_batch_size=max(args.batches), cache_max_entry_count=0.3,
                                             session_len=2048, num_threads=args.threads))
    try:
        print(f"{'batch':>6}{'tok/s':>9}{'ms/step':>9}")
        for b in args.batches:
            done = threading.Semaphore(0)

            def on_output(out, done=done):
                if out.finished:
                    done.release()

            start, steps0 = time.perf_counter(), engine.metrics().num_steps
            for i in range(b):
                engine.submit([100 + i, 200, 300, 400],
                              GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True), on_output)
            for _ in range(b):
                done.acquire()
            elapsed, steps = time.perf_counter() - start, engine.metrics().num_steps - steps0
            print(f"{b:>6}{b * args.new_tokens / elapsed:9.1f}{elapsed / steps * 1e3:9.1f}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
