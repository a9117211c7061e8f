"""Decode latency of running requests when a long prompt arrives, side by side in one run: unpaced
(decode_slowdown 0) with the whole prompt in one step, unpaced with chunked prefill (a small
max_prefill_token_num), and with prompt pacing (the default decode_slowdown: chunks sized by step time).

    python benchmark/bench_chunked_prefill.py [--long-prompt 4096] [--chunk 512] [--decoders 4]

Reports the inter-token latency (p50 and max) of the decoding requests before and while the long
prompt is being prefilled, and the time of that prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402


async def scenario(engine, args) -> dict:
    from lmkit import GenerationConfig

    reqs = workloads.fixed(engine.tokenizer, args.decoders, 32, 10_000, seed=2)
    long_req = workloads.fixed(engine.tokenizer, 1, args.long_prompt, 1, seed=3)[0]
    stamps: list[list[float]] = [[] for _ in reqs]
    window: dict[str, float] = {}
    stop = asyncio.Event()

    async def decode(i, req):
        gen = GenerationConfig(max_new_tokens=req.output_len, ignore_eos=True)
        agen = engine.generate(req.prompt_ids, gen)
        async for r in agen:
            stamps[i].extend([engine.engine.now()] * len(r.token_ids))
            if stop.is_set():
                break
        await agen.aclose()

    async def long_prompt():
        while min(len(s) for s in stamps) < 10:  # decoders are in steady state
            await asyncio.sleep(0.01)
        window["start"] = engine.engine.now()
        async for r in engine.generate(long_req.prompt_ids, GenerationConfig(max_new_tokens=1, ignore_eos=True)):
            if r.finish_reason:
                window["end"] = engine.engine.now()
        await asyncio.sleep(1.0)
        stop.set()

    await asyncio.gather(*(decode(i, r) for i, r in enumerate(reqs)), long_prompt())
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (during if b > window["start"] and a < window["end"] else before if b <= window["start"] else []).append(b - a)
    return {"before": before, "during": during, "prefill_s": window["end"] - window["start"]}


def run(model, budget: int, slowdown: float | None, args) -> dict:
    from lmkit import AsyncEngine, EngineConfig

    paced = {} if slowdown is None else {"decode_slowdown": slowdown}
    engine = AsyncEngine(model, EngineConfig(max_prefill_token_num=budget, num_threads=args.threads, dtype=args.dtype,
                                             session_len=args.long_prompt + 64, cache_max_entry_count=0.3, **paced))
    try:
        return asyncio.run(scenario(engine, args))
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="compute dtype (bfloat16: CPU linear layers as bf16 dot products / AMX tiles)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.long_prompt, args.chunk, args.decoders = 256, 64, 2
    print(f"dtype {args.dtype}; {args.decoders} decoding requests; a {args.long_prompt}-token prompt arrives; {date.today()}")
    print(f"{'policy':>22}{'ITL p50 before':>16}{'ITL p50 during':>16}{'ITL max during':>16}{'prefill':>9}")
    whole = args.long_prompt + 64
    for label, budget, slowdown in ((f"whole ({whole})", whole, 0.0), (f"chunks of {args.chunk}", args.chunk, 0.0),
                                    ("paced (default)", whole, None)):
        r = run(args.model, budget, slowdown, args)
        print(f"{label:>22}{np.median(r['before']) * 1e3:14.1f}ms{np.median(r['during']) * 1e3:14.1f}ms"
              f"{max(r['during']) * 1e3:14.1f}ms{r['prefill_s']:8.2f}s")


if __name__ == "__main__":
    main()
