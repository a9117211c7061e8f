"""Decode throughput of the engine alone (no asyncio, no detokenization) as the batch grows: b prompts
of 4 tokens submitted at once, 64 tokens each (greedy, or sampled with --sampling); output tokens/s and
mean step time.

    python benchmark/bench_batch_decode.py [--model PATH] [--batches 1 4 8 16 32 64] [--new-tokens 64]
        [--sampling greedy t1 top_p top_k_top_p]
"""

from __future__ import annotations

import argparse
import threading
import time

# name -> GenerationConfig fields: the sampler's cost per row shows against greedy
SAMPLING = {
    "greedy": {},
    "t1": dict(do_sample=True, temperature=1.0),
    "top_p": dict(do_sample=True, top_p=0.95),
    "top_k_top_p": dict(do_sample=True, top_k=40, top_p=0.9),
}


def main(argv: list[str] | None = None) -> None:
    from lmkit import EngineConfig, GenerationConfig
    from lmkit.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sampling", nargs="+", choices=sorted(SAMPLING), default=["greedy"])
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    args = ap.parse_args(argv)
    engine = Engine(args.model, EngineConfig(max_batch_size=max(args.batches), cache_max_entry_count=0.3,
                                             session_len=2048, num_threads=args.threads, dtype=args.dtype))
    try:
        print(f"{'sampling':>12}{'batch':>6}{'tok/s':>9}{'ms/step':>9}")
        for mode in args.sampling:
            for b in args.batches:
                done = threading.Semaphore(0)

                def on_output(out, done=done):
                    if out.finished:
                        done.release()

                start, steps0 = time.perf_counter(), engine.metrics().num_steps
                for i in range(b):
                    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, random_seed=i,
                                           **SAMPLING[mode])
                    engine.submit([100 + i, 200, 300, 400], gen, on_output)
                for _ in range(b):
                    done.acquire()
                elapsed, steps = time.perf_counter() - start, engine.metrics().num_steps - steps0
                print(f"{mode:>12}{b:>6}{b * args.new_tokens / elapsed:9.1f}{elapsed / steps * 1e3:9.1f}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
