"""The KV disk store (EngineConfig.kv_cache_dir), side by side in one run:

1. the second turn of a long conversation (default 16,384 tokens of context): its TTFT recomputed from nothing
   (a fresh engine without cache), read back from the disk store after a restart of the engine, and served from
   the in-memory prefix cache as today (the same engine that ran the first turn). The first generated token must be
   the same in all three.
   Then, after another restart, the same second turn submitted beside a short request that streams its
   tokens: the stream's longest gap between two tokens while the turn's prefix is read back, with the store's
   per-step read cap (kv_cache_read_mib_per_step, default) and without it (0: the read in one step).
   --cold-cache (root, Linux) drops the page cache before the turn is submitted, so its blocks come from the disk.
2. zero cost on a miss: a workload without shared prefixes (distinct prompts, a pool small enough that every prompt
   evicts older blocks, which the store then writes) with and without the store, alternating runs: the speed ratio
   (store / no store; the issue asks >= 0.98).

    python benchmark/bench_kv_store.py [--model PATH] [--context-tokens 16384] [--threads N] [--smoke]

TTFT here is the wall time of a request for one token (prefill + one sampled token), one request at a time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from cli_args import count  # noqa: E402


def _one_token(pipe, ids: list[int]) -> tuple[float, int]:
    from lmkit import GenerationConfig

    start = time.perf_counter()
    r = pipe(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    return time.perf_counter() - start, r.token_ids[0]


def conversation(model, args, store: Path) -> dict:
    """TTFT of turn 2 three ways; returns seconds and first tokens."""
    from lmkit import EngineConfig, GenerationConfig, pipeline

    rng = random.Random(7)
    base = dict(num_threads=args.threads, dtype=args.dtype, session_len=args.context_tokens + 512,
                max_prefill_token_num=args.prefill_chunk)
    with pipeline(model, EngineConfig(**base, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        turn1 = workloads._text_ids(pipe.engine.tokenizer, rng, args.context_tokens)
        answer = pipe(turn1, GenerationConfig(max_new_tokens=32, ignore_eos=True)).token_ids
        turn2 = turn1 + answer + workloads._text_ids(pipe.engine.tokenizer, rng, 32)
        pool_s, pool_token = _one_token(pipe, turn2)  # the in-memory prefix cache, as today
        blocks = pipe.engine.num_total_blocks
    # the engine shut down: its cached blocks are on disk now
    with pipeline(model, EngineConfig(**base, enable_prefix_caching=True, kv_cache_dir=str(store))) as pipe:
        store_s, store_token = _one_token(pipe, turn2)
        m = pipe.engine.metrics()
    with pipeline(model, EngineConfig(**base)) as pipe:
        cold_s, cold_token = _one_token(pipe, turn2)
    beside = {mib: beside_a_stream(model, base, store, turn2, mib, args.cold_cache) for mib in (64.0, 0.0)}
    return dict(turn2_tokens=len(turn2), cold_s=cold_s, store_s=store_s, pool_s=pool_s, blocks=blocks,
                store_hit_tokens=m.num_store_hit_tokens, store_read_bytes=m.num_store_read_bytes,
                same_token=cold_token == store_token == pool_token, beside=beside)


def drop_page_cache() -> None:
    """Writes dirty pages and drops the page cache (Linux, root): the next reads of the store come from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def beside_a_stream(model, base: dict, store: Path, turn2: list[int], read_mib: float, cold: bool) -> dict:
    """A fresh engine on the store: a 32-token request and the long turn submitted together (the short one is
    admitted first); the short stream's longest gap between tokens (its first token included, from submission)
    and the turn's TTFT, with kv_cache_read_mib_per_step = read_mib."""
    from lmkit import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(**base, enable_prefix_caching=True, kv_cache_dir=str(store),
                          kv_cache_read_mib_per_step=read_mib)
    with pipeline(model, config) as pipe:
        short = workloads._text_ids(pipe.engine.tokenizer, random.Random(11), 32)
        pipe(short[:8], GenerationConfig(max_new_tokens=2, ignore_eos=True))  # warm-up
        if cold:
            drop_page_cache()
        stamps: dict[int, list[float]] = {0: [], 1: []}
        start = time.perf_counter()
        for r in pipe.stream_infer([short, turn2], GenerationConfig(max_new_tokens=64, ignore_eos=True)):
            stamps[r.index].extend([time.perf_counter()] * len(r.token_ids))
            if stamps[1] and len(stamps[0]) >= 64:
                break
        m = pipe.engine.metrics()
    times = [start] + stamps[0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return dict(max_gap_s=max(gaps), median_gap_s=statistics.median(gaps[1:]), turn_ttft_s=stamps[1][0] - start,
                lookups=m.num_store_lookups - m.num_store_missed_lookups, hit_tokens=m.num_store_hit_tokens)


def thread_cpu_seconds(name: str) -> float:
    """CPU seconds (user + system) of this process's threads called `name` (Linux /proc; 0 elsewhere)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total


def no_shared_prefix(model, args, store: bool, seed: int) -> tuple[float, dict]:
    """Seconds for a batch of distinct prompts, with or without the store (prefix caching on in both)."""
    from lmkit import EngineConfig, GenerationConfig, pipeline

    rng = random.Random(1000 + seed)
    directory = tempfile.mkdtemp(prefix="lmkit-bench-kvstore-") if store else None
    block = 64
    # a pool of 2 prompts' worth of blocks per running slot: every admission evicts older prompts' blocks
    blocks = 2 * args.concurrency * ((args.prompt_tokens + args.output_tokens) // block + 2)
    config = EngineConfig(num_threads=args.threads, dtype=args.dtype, enable_prefix_caching=True,
                          cache_max_entry_count=blocks, max_batch_size=args.concurrency, session_len=4096,
                          kv_cache_dir=directory)
    try:
        with pipeline(model, config) as pipe:
            prompts = [workloads._text_ids(pipe.engine.tokenizer, rng, args.prompt_tokens)
                       for _ in range(args.num_prompts)]
            gen = GenerationConfig(max_new_tokens=args.output_tokens, ignore_eos=True)
            pipe(prompts[:1], gen)  # warm-up (its blocks stay; nothing later shares them)
            start, cpu_start = time.perf_counter(), time.process_time()
            for i in range(1, len(prompts), args.concurrency):
                pipe(prompts[i:i + args.concurrency], gen)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            writer_seconds = thread_cpu_seconds("lmkit-kvstore")
            m = pipe.engine.metrics()
        return seconds, dict(written=m.num_store_written_blocks, dropped=m.num_store_dropped_blocks,
                             hits=m.num_prefix_hit_tokens, lookups=m.num_store_lookups, cpu_s=cpu_seconds,
                             writer_cpu_s=writer_seconds)
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    ap.add_argument("--context-tokens", type=count, default=16384, help="tokens of the conversation's first turn")
    ap.add_argument("--prefill-chunk", type=count, default=8192, help="max_prefill_token_num")
    ap.add_argument("--prompt-tokens", type=count, default=512, help="no-shared-prefix workload: tokens per prompt")
    ap.add_argument("--output-tokens", type=count, default=32)
    ap.add_argument("--num-prompts", type=count, default=17)
    ap.add_argument("--concurrency", type=count, default=4)
    ap.add_argument("--repeats", type=count, default=3, help="alternating runs of each side (median reported)")
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--skip-conversation", action="store_true")
    ap.add_argument("--cold-cache", action="store_true",
                    help="drop the page cache (root) before the turn that reads the store beside a stream")
    ap.add_argument("--skip-zero-cost", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.context_tokens, args.prompt_tokens, args.output_tokens, args.num_prompts = 640, 128, 4, 9
        args.concurrency, args.repeats = 2, 1
    from lmkit.model_path import resolve_model

    model = resolve_model(args.model)
    result: dict = {}
    print(f"model {model.name}, dtype {args.dtype}, threads {args.threads or 'auto'}, {date.today()}")
    if not args.skip_conversation:
        store = Path(tempfile.mkdtemp(prefix="lmkit-bench-kvstore-"))
        try:
            c = conversation(model, args, store)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        result["conversation"] = c
        print(f"second turn of a {c['turn2_tokens']}-token conversation, TTFT (one request):")
        print(f"  recomputed (cold)          {c['cold_s']:8.3f} s")
        print(f"  disk store after restart   {c['store_s']:8.3f} s   ({c['cold_s'] / c['store_s']:.1f}x faster; "
              f"{c['store_hit_tokens']} tokens, {c['store_read_bytes'] / 2**20:.0f} MiB read)")
        print(f"  in-memory prefix cache     {c['pool_s']:8.3f} s   ({c['cold_s'] / c['pool_s']:.1f}x faster)")
        print(f"  same first token: {c['same_token']}")
        print("the same turn beside a 32-token request streaming 64 tokens (fresh engines on the store):")
        for mib, b in c["beside"].items():
            cap = f"read cap {mib:g} MiB a step" if mib else "no read cap        "
            print(f"  {cap}: the stream's longest gap {b['max_gap_s'] * 1e3:8.1f} ms (median "
                  f"{b['median_gap_s'] * 1e3:.1f} ms), the turn's TTFT {b['turn_ttft_s']:.3f} s, its prefix read in "
                  f"{b['lookups']} step(s), {b['hit_tokens']} tokens")
    if not args.skip_zero_cost:
        runs: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        info = {}
        for r in range(args.repeats):
            for store in ((False, True) if r % 2 == 0 else (True, False)):
                seconds, info[store] = no_shared_prefix(model, args, store, r)
                runs[store].append(seconds)
                cpu[store].append(info[store]["cpu_s"])
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        cpu_off, cpu_on = statistics.median(cpu[False]), statistics.median(cpu[True])
        result["zero_cost"] = dict(off_s=runs[False], on_s=runs[True], ratio=off / on, store=info[True],
                                   cpu_off_s=cpu[False], cpu_on_s=cpu[True], cpu_ratio=cpu_off / cpu_on)
        print(f"no shared prefix: {args.num_prompts - 1} prompts of {args.prompt_tokens} tokens, "
              f"{args.output_tokens} out, {args.concurrency} at a time, {args.repeats} alternating runs:")
        print(f"  without store {off:8.3f} s (median of {[round(x, 3) for x in runs[False]]})")
        print(f"  with store    {on:8.3f} s (median of {[round(x, 3) for x in runs[True]]}; "
              f"{info[True]['written']} blocks written, {info[True]['dropped']} dropped; the writer thread's CPU "
              f"{info[True]['writer_cpu_s']:.2f} s in the last run)")
        print(f"  speed ratio (store / no store): {off / on:.3f}")
        print(f"  process CPU seconds: without {cpu_off:.2f} (median of {[round(x, 2) for x in cpu[False]]}), with "
              f"{cpu_on:.2f} (median of {[round(x, 2) for x in cpu[True]]}); ratio {cpu_off / cpu_on:.3f} (less "
              f"sensitive to other load on the host than wall time)")
    return result


if __name__ == "__main__":
    main()
