"""Cost of structured output: decode tok/s and TTFT of JSON-schema-constrained requests against the same
requests unconstrained with the same output lengths, at batch 1 and 16 streams; grammar compile time cold and
cached.

    python benchmark/bench_structured.py [--model smollm2] [--batch 1 16] [--threads 2] [--repeats 3]

Per batch size: `batch` chat requests (different prompts) sampled at temperature 1 under a tool-call schema
(a function name from an enum, nested arguments); then the same prompts unconstrained with ignore_eos and each
request's max_new_tokens set to the length its constrained twin produced, so both runs generate the same tokens
per request. tok/s = generated tokens / (last token - first token of the batch's first request), best of --repeats;
TTFT: mean over the batch, the lowest of --repeats. Compile: a fresh GrammarCache (the tokenizer built once before timing), then the
same schema again (cache hit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_flights", "book_hotel"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                "guests": {"type": "integer", "minimum": 1, "maximum": 8},
                "options": {"type": "array", "maxItems": 3,
                            "items": {"enum": ["breakfast", "parking", "late_checkout", "window"]}},
            },
            "required": ["city", "date", "guests", "options"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Oslo", "Rome", "Lima", "Kyoto", "Accra", "Quito", "Perth", "Cairo", "Dublin", "Hanoi",
          "Lyon", "Porto", "Riga", "Seoul", "Tunis"]


def prompts(batch: int) -> list[list[dict]]:
    return [[{"role": "system", "content": "Answer with one tool call as JSON."},
             {"role": "user", "content": f"Book a hotel in {CITIES[i % len(CITIES)]} for {i % 4 + 1} guests on "
                                         f"2026-0{i % 9 + 1}-1{i % 10}."}] for i in range(batch)]


async def run_batch(engine, items, gens) -> tuple[float, float, list[int], list[str]]:
    """(decode tok/s, mean TTFT s, tokens per request, finish reasons)."""
    start = time.perf_counter()
    firsts, lasts, counts, finishes = [], [], [], []

    async def one(prompt, gen):
        first = None
        n = 0
        finish = None
        async for r in engine.generate(prompt, gen):
            if r.token_ids and first is None:
                first = time.perf_counter()
            n = r.generate_token_len
            finish = r.finish_reason or finish
        firsts.append(first)
        lasts.append(time.perf_counter())
        counts.append(n)
        finishes.append(finish)

    await asyncio.gather(*(one(p, g) for p, g in zip(items, gens)))
    decode_s = max(lasts) - min(firsts)
    decode_tokens = sum(counts) - len(counts)
    return decode_tokens / decode_s, sum(f - start for f in firsts) / len(firsts), counts, finishes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from lmkit import AsyncEngine, EngineConfig, GenerationConfig, StructuredOutput
    from lmkit.structured import GrammarCache

    engine = AsyncEngine(args.model, EngineConfig(device="cpu", max_batch_size=max(args.batch),
                                                  cache_max_entry_count=0.2, session_len=1024,
                                                  num_threads=args.threads))
    e = engine.engine
    constraint = StructuredOutput(json=TOOL_CALL)
    cache = GrammarCache(e.tokenizer.to_json(), e.spec.vocab_size, e.spec.eos_token_ids)
    cache._grammar_tokenizer()  # the vocabulary, once per engine, outside the timing
    t = time.perf_counter()
    cache.compile(constraint)
    cold_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    cache.compile(constraint)
    cached_ms = (time.perf_counter() - t) * 1e3
    e.compile_grammar(constraint)

    print(f"# structured output overhead: {args.model}, {cpu_description()}, {args.threads} threads, {date.today()}")
    print(f"compile (tool-call schema): cold {cold_ms:.1f} ms, cached {cached_ms:.3f} ms")
    print("| batch | constrained tok/s | unconstrained tok/s | ratio | TTFT constrained ms | TTFT free ms | tokens/req |")
    print("|---|---|---|---|---|---|---|")

    async def cell(batch: int):
        items = prompts(batch)
        best_c = best_u = None
        ttft_c, ttft_u = [], []
        for rep in range(args.repeats + 1):  # the first is a warm-up
            gens = [GenerationConfig(max_new_tokens=200, do_sample=True, temperature=1.0, random_seed=1000 * rep + i,
                                     structured_output=constraint) for i in range(batch)]
            c = await run_batch(engine, items, gens)  # the engine's grammar cache has the schema (a 0.05 ms hit)
            assert all(f == "stop" for f in c[3]), c[3]
            free = [GenerationConfig(max_new_tokens=n, ignore_eos=True, do_sample=True, temperature=1.0,
                                     random_seed=i) for i, n in enumerate(c[2])]
            u = await run_batch(engine, items, free)
            if rep == 0:
                continue
            ttft_c.append(c[1])
            ttft_u.append(u[1])
            best_c = c if best_c is None or c[0] > best_c[0] else best_c
            best_u = u if best_u is None or u[0] > best_u[0] else best_u
        print(f"| {batch} | {best_c[0]:.1f} | {best_u[0]:.1f} | {best_c[0] / best_u[0]:.1%} | {min(ttft_c) * 1e3:.0f} | "
              f"{min(ttft_u) * 1e3:.0f} | {sum(best_c[2]) / batch:.0f} |")

    for b in args.batch:
        asyncio.run(cell(b))
    engine.close()


if __name__ == "__main__":
    main()
