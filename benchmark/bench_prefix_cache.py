"""TTFT with and without prefix caching, side by side in one run: requests that share one long
document (default 1,024 tokens) and differ in a short question, sent one after another.

    python benchmark/bench_prefix_cache.py [--prefix-len 1024] [--num-prompts 8] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from profile_throughput import run_level  # noqa: E402


def measure(model, caching: bool, args) -> dict:
    from lmkit import AsyncEngine, EngineConfig

    engine = AsyncEngine(model, EngineConfig(enable_prefix_caching=caching, num_threads=args.threads, dtype=args.dtype,
                                             cache_max_entry_count=0.3, session_len=4096))
    try:
        reqs = workloads.shared_prefix(engine.tokenizer, args.num_prompts + 1, args.prefix_len, args.suffix_len,
                                       args.output_len, seed=1)
        asyncio.run(run_level(engine, reqs[:1], 1))  # the first request fills the cache (when on)
        row = asyncio.run(run_level(engine, reqs[1:], 1))
        row["hit_rate"] = engine.metrics().prefix_hit_rate
        return row
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="compute dtype (bfloat16: CPU linear layers as bf16 dot products / AMX tiles)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prefix_len, args.suffix_len, args.output_len, args.num_prompts = 128, 8, 2, 2
    off = measure(args.model, False, args)
    on = measure(args.model, True, args)
    ratio = off["ttft"]["mean"] / on["ttft"]["mean"]
    print(f"dtype {args.dtype}; shared prefix {args.prefix_len} tokens + {args.suffix_len}-token question, {args.num_prompts} requests "
          f"one at a time, {date.today()}")
    print(f"{'':16}{'TTFT mean':>11}{'TTFT p50':>10}{'hit rate':>10}")
    for name, r in (("no cache", off), ("prefix cache", on)):
        print(f"{name:16}{r['ttft']['mean'] * 1e3:9.1f}ms{r['ttft']['p50'] * 1e3:8.1f}ms{r['hit_rate']:10.3f}")
    print(f"TTFT ratio (no cache / cache): {ratio:.1f}x")
    return {"off": off, "on": on, "ratio": ratio}


if __name__ == "__main__":
    main()
