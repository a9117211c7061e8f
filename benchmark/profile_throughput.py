"""Throughput and latency of the engine driven directly (no HTTP), at one or more concurrency levels.

    python benchmark/profile_throughput.py --concurrency 1 4 16 64 [--workload sharegpt|fixed|shared-prefix]
        [--num-prompts N] [--model PATH] [--enable-prefix-caching] [--csv results.csv]
    python benchmark/profile_throughput.py --baseline PKGDIR[:LABEL] [--rounds 3] [--concurrency 1 16]

Every request runs to its drawn output length (ignore_eos, as the peers' benchmarks do). Prints and
appends to CSV: request throughput, input/output tokens/s, TTFT, TPOT (per request: (e2e - ttft) /
(output - 1)), ITL (every gap between tokens) and end-to-end latency (mean, p50, p90, p99), peak KV
usage and prefix hit rate. With --csv and more than one level, a PNG of throughput and latency
percentiles against concurrency is written beside the CSV (matplotlib, when installed).

--baseline PKGDIR[:LABEL] (another build's lmkit package folder, see baseline.py; repeatable) compares
builds instead: every level runs once per round in a fresh process of each build, the builds back to back
(even rounds in reverse order), and the table gives the medians over --rounds and this build's speed over
each baseline's (> 1: this build is faster; latencies: the baseline's / this build's). Defaults for it:
levels 1 and 16, 4 x concurrency requests per level (at least 16; the first ones of the same draw).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from baseline import Baseline, lmkit_location  # noqa: E402
from bench_decode_prefill import cpu_description  # noqa: E402
from cli_args import count  # noqa: E402
from summary import STAT_KEYS, append_csv, summarize  # noqa: E402

RESULT_TAG = "@@profile_throughput_result "


def plot_concurrency(rows: list[dict], path: Path, title: str) -> None:
    """Throughput vs concurrency and latency percentiles vs concurrency, side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(c, [r["output_tok_s"] for r in rows], "o-", label="output tok/s")
    left.plot(c, [r["request_throughput"] * 100 for r in rows], "s--", label="requests/s x 100")
    left.set(xscale="log", xlabel="concurrency", ylabel="throughput", title="throughput")
    for key, style in (("ttft", "o-"), ("tpot", "s-"), ("itl", "^-")):
        for p, alpha in (("p50", 1.0), ("p99", 0.5)):
            right.plot(c, [r[key][p] * 1e3 for r in rows], style, alpha=alpha, label=f"{key.upper()} {p}")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency percentiles")
    for ax in (left, right):
        ax.set_xticks(c, [str(x) for x in c])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_level(engine, requests: list, concurrency: int) -> dict:
    from lmkit import GenerationConfig

    sem = asyncio.Semaphore(concurrency)
    stats = []
    peak_kv = 0.0

    async def one(req):
        async with sem:
            gen = GenerationConfig(max_new_tokens=req.output_len, ignore_eos=True)
            start = engine.engine.now()
            times = []
            async for r in engine.generate(req.prompt_ids, gen):
                if r.token_ids:
                    times.extend([engine.engine.now()] * len(r.token_ids))
                if r.finish_reason is not None and r.finish_reason != "length":
                    raise RuntimeError(f"request ended with {r.finish_reason}: {r.error}")
            stats.append((start, times, len(req.prompt_ids)))

    async def sample_kv():  # KV usage sampled off the token path (every 50 ms)
        nonlocal peak_kv
        while True:
            peak_kv = max(peak_kv, engine.engine.metrics().kv_usage)
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample_kv())
    t0 = engine.engine.now()
    await asyncio.gather(*(one(r) for r in requests))
    elapsed = engine.engine.now() - t0
    sampler.cancel()
    ttft = [t[0] - s for s, t, _ in stats]
    e2e = [t[-1] - s for s, t, _ in stats]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for s, t, _ in stats if len(t) > 1]
    itl = [b - a for _, t, _ in stats for a, b in zip(t, t[1:])]
    out_tokens = sum(len(t) for _, t, _ in stats)
    in_tokens = sum(n for _, _, n in stats)
    return {
        "concurrency": concurrency, "num_requests": len(requests), "elapsed_s": elapsed,
        "request_throughput": len(requests) / elapsed, "input_tok_s": in_tokens / elapsed,
        "output_tok_s": out_tokens / elapsed, "ttft": summarize(ttft), "tpot": summarize(tpot),
        "itl": summarize(itl), "e2e": summarize(e2e), "peak_kv_usage": peak_kv,
    }


def make_requests(args, tokenizer, num: int, seed: int) -> list:
    if args.dataset:
        return workloads.sharegpt_file(args.dataset, tokenizer, num, seed)
    if args.workload == "sharegpt":
        return workloads.sharegpt_like(tokenizer, num, seed)
    if args.workload == "fixed":
        return workloads.fixed(tokenizer, num, args.input_len, args.output_len, seed)
    return workloads.shared_prefix(tokenizer, num, args.prefix_len, args.input_len, args.output_len, seed)


def num_prompts(args, concurrency: int) -> int:
    """Requests of one level: --num-prompts; else 128, the same at every level (fewer let the longest
    request dominate); with --baseline 4 x concurrency, at least 16, so that a comparison round takes
    minutes (the seeded draw makes a smaller level's requests the first ones of a larger level's)."""
    if args.num_prompts:
        return args.num_prompts
    return max(16, 4 * concurrency) if args.baselines else 128


def measure(args) -> dict:
    """Loads the engine and runs the levels of args.concurrency in turn: their rows, the model's name, the
    KV cache's, the prefix hit rate, and the lmkit package folder that ran them."""
    from lmkit import AsyncEngine, EngineConfig

    engine = AsyncEngine(args.model, EngineConfig(
        device=args.device, max_batch_size=args.max_batch_size, cache_max_entry_count=args.cache_max_entry_count,
        enable_prefix_caching=args.enable_prefix_caching, num_threads=args.threads, session_len=4096,
        quant_policy=args.quant_policy, kv_policy=args.kv_policy, dtype=args.dtype,
        **({} if args.decode_slowdown is None else {"decode_slowdown": args.decode_slowdown})))
    kv = f"kv_policy {Path(args.kv_policy).name}" if args.kv_policy else \
        {0: "fp16/bf16" if args.device == "cuda" else "bf16" if args.dtype == "bfloat16" else "fp32", 8: "int8",
         4: "int4"}[args.quant_policy]  # dtype bfloat16 keeps K/V in bf16 where the layout fits (even sizes)
    rows = []
    try:
        warm = make_requests(args, engine.tokenizer, 1, seed=10_000)
        asyncio.run(run_level(engine, [workloads.Request(warm[0].prompt_ids[:16], 4)], 1))
        for c in args.concurrency:
            requests = make_requests(args, engine.tokenizer, num_prompts(args, c), args.seed)
            rows.append(asyncio.run(run_level(engine, requests, c)))
            # the requests' fingerprint: builds compared must have drawn the same ones (their own tokenizer)
            rows[-1]["requests_sha"] = hashlib.sha256(
                json.dumps([(r.prompt_ids, r.output_len) for r in requests]).encode()).hexdigest()[:12]
        m = engine.metrics()
    finally:
        engine.close()
    return {"rows": rows, "model": Path(str(engine.engine.model_path)).name, "kv": kv,
            "prefix_hit_rate": m.prefix_hit_rate, "lmkit_location": lmkit_location()}


def describe_run(args, model: str, kv: str) -> str:
    workload = workloads.describe(args.workload, args.dataset)
    line = (f"model {model}, workload {workload}, prefix caching {args.enable_prefix_caching}, KV {kv}, dtype "
            f"{args.dtype}, {args.threads or len(os.sched_getaffinity(0))} threads, {date.today()}")
    return line + (f"\ncpu {cpu_description()}" if args.device != "cuda" else "")


def report(args, result: dict) -> None:
    """Prints one build's levels; with --csv appends them there and plots them beside it."""
    rows, name, kv = result["rows"], result["model"], result["kv"]
    workload = workloads.describe(args.workload, args.dataset)
    print(describe_run(args, name, kv))
    print(f"{'conc':>5}{'reqs':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>9}{'E2E p50':>9}{'KV peak':>8}")
    for r in rows:
        print(f"{r['concurrency']:>5}{r['num_requests']:>6}{r['request_throughput']:8.2f}{r['output_tok_s']:11.1f}"
              f"{r['ttft']['p50'] * 1e3:8.0f}ms{r['ttft']['p99'] * 1e3:8.0f}ms{r['tpot']['p50'] * 1e3:8.1f}ms"
              f"{r['tpot']['p99'] * 1e3:8.1f}ms{r['itl']['p99'] * 1e3:7.0f}ms{r['e2e']['p50']:8.2f}s"
              f"{r['peak_kv_usage']:8.2f}")
    print(f"prefix hit rate {result['prefix_hit_rate']:.3f}")
    if args.csv:
        append_csv(args.csv, ["date", "model", "workload", "prefix_caching", "concurrency", "num_requests",
                              "request_throughput", "input_tok_s", "output_tok_s"]
                   + [f"{k}_{p}_ms" for k in ("ttft", "tpot", "itl", "e2e") for p in STAT_KEYS]
                   + ["peak_kv_usage", "prefix_hit_rate", "kv_cache"],
                   [[date.today(), name, workload, args.enable_prefix_caching, r["concurrency"], r["num_requests"],
                     f"{r['request_throughput']:.3f}", f"{r['input_tok_s']:.1f}", f"{r['output_tok_s']:.1f}"]
                    + [f"{r[k][p] * 1e3:.2f}" for k in ("ttft", "tpot", "itl", "e2e") for p in STAT_KEYS]
                    + [f"{r['peak_kv_usage']:.3f}", f"{result['prefix_hit_rate']:.3f}", kv] for r in rows])
        if len(rows) > 1:
            try:
                png = args.csv.with_suffix(".concurrency.png")
                plot_concurrency(rows, png, f"{name}, {workload} workload, dtype {args.dtype}, KV {kv}, {date.today()}")
                print(f"plots: {png}")
            except ImportError:
                print("matplotlib not installed: no plots (pip install matplotlib)")


def run_worker(args, baseline: Baseline | None, concurrency: int) -> dict:
    """measure() of one level in a fresh process of this build (baseline None) or of ``baseline``'s."""
    env = baseline.env(dict(os.environ)) if baseline else None
    cmd = [sys.executable, __file__, *args.forwarded, "--worker", str(concurrency)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    who = baseline.label if baseline else "this build"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            error = baseline.check(result["lmkit_location"]) if baseline else None
            if error:
                raise RuntimeError(f"{who}: {error}")
            return result
    raise RuntimeError(f"the worker of {who} at concurrency {concurrency} exited with {proc.returncode}, no result")


def compare(args) -> None:
    """Every level of this build and of each baseline, interleaved over --rounds; prints the medians and this
    build's speed over each baseline's (of the medians, and of each round's back-to-back pair)."""
    builds = [None, *args.baselines]

    def label(b: Baseline | None) -> str:
        return b.label if b else "this build"

    runs: dict[tuple[str, int], list[dict]] = {}
    locations: dict[str, str] = {}
    for k in range(args.rounds):
        for c in args.concurrency:
            for b in (builds if k % 2 == 0 else builds[::-1]):
                print(f"profile_throughput: concurrency {c}, {label(b)} (round {k + 1}/{args.rounds}) ...",
                      file=sys.stderr, flush=True)
                result = run_worker(args, b, c)
                runs.setdefault((label(b), c), []).append(result["rows"][0])
                locations[label(b)] = result["lmkit_location"]
    print(describe_run(args, result["model"], result["kv"]))
    print(f"medians of {args.rounds} round(s), each level of each build in its own process; speed ratios "
          f"this build / baseline (> 1: this build faster; latencies: baseline / this build)")
    figures = {"out tok/s": lambda r: r["output_tok_s"], "TTFT p50": lambda r: r["ttft"]["p50"],
               "TPOT p50": lambda r: r["tpot"]["p50"], "E2E p50": lambda r: r["e2e"]["p50"]}
    wide = max(len(f"this build / {label(b)}") for b in builds) + 1
    print(f"{'conc':>5} {'build':{wide}}{'reqs':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}{'E2E p50':>9}"
          f"   per round: out tok/s (ratios: out tok/s / TPOT p50)")
    for c in args.concurrency:
        med = {(b, f): statistics.median(get(r) for r in runs[(label(b), c)]) for b in builds
               for f, get in figures.items()}
        for b in builds:
            rs = runs[(label(b), c)]
            print(f"{c:>5} {label(b):{wide}}{rs[0]['num_requests']:>5}{med[b, 'out tok/s']:11.1f}"
                  f"{med[b, 'TTFT p50'] * 1e3:8.0f}ms{med[b, 'TPOT p50'] * 1e3:8.1f}ms{med[b, 'E2E p50']:8.2f}s   "
                  + " ".join(f"{r['output_tok_s']:.1f}" for r in rs))
        for b in args.baselines:
            speed = {f: (med[None, f] / med[b, f]) ** (1 if f == "out tok/s" else -1) for f in figures}
            per_round = [f"{x['output_tok_s'] / y['output_tok_s']:.3f}/{y['tpot']['p50'] / x['tpot']['p50']:.3f}"
                         for x, y in zip(runs[("this build", c)], runs[(b.label, c)])]
            print(f"{'':>5} {'this build / ' + b.label:{wide}}{'':>5}{speed['out tok/s']:10.3f}x"
                  f"{speed['TTFT p50']:9.3f}x{speed['TPOT p50']:9.3f}x{speed['E2E p50']:8.3f}x   " + " ".join(per_round))
    for who, where in locations.items():
        print(f"  {who}: lmkit from {where}")
    for c in args.concurrency:
        drawn = {label(b): {r["requests_sha"] for r in runs[(label(b), c)]} for b in builds}
        if len({sha for shas in drawn.values() for sha in shas}) > 1:
            print(f"WARNING: the builds drew different requests at concurrency {c} ({drawn}): not comparable")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--concurrency", type=count, nargs="+", default=None,
                    help="levels (default: 1 4 16 64; with --baseline 1 16)")
    ap.add_argument("--num-prompts", type=count, default=None,
                    help="per level (default: 128, the same prompts at every level; fewer let the longest request "
                         "dominate; with --baseline 4 x concurrency, at least 16)")
    ap.add_argument("--workload", choices=["sharegpt", "fixed", "shared-prefix"], default="sharegpt")
    ap.add_argument("--dataset", type=Path, default=None, help="a ShareGPT JSON file instead of the generator")
    ap.add_argument("--input-len", type=count, default=128, help="fixed: prompt tokens; shared-prefix: suffix tokens")
    ap.add_argument("--output-len", type=count, default=128)
    ap.add_argument("--prefix-len", type=count, default=1024)
    ap.add_argument("--max-batch-size", type=count, default=64)
    ap.add_argument("--cache-max-entry-count", type=float, default=0.5)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--quant-policy", type=int, choices=[0, 4, 8], default=0, help="KV cache: 0 fp, 8 int8, 4 int4")
    ap.add_argument("--kv-policy", default=None, help="per-layer KV precision file (lmkit lite calibrate)")
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--decode-slowdown", type=float, default=None,
                    help="EngineConfig.decode_slowdown (prompt pacing; 0: off); default: the engine's")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="compute dtype (bfloat16: CPU linear layers as bf16 dot products, AVX512_BF16 CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--baseline", action="append", default=[], metavar="PKGDIR[:LABEL]",
                    help="another build's lmkit package folder (see baseline.py): compare this build with it, "
                         "level by level, interleaved; repeatable")
    ap.add_argument("--rounds", type=count, default=1, help="with --baseline: rounds of every level of every build "
                                                          "(medians over them)")
    ap.add_argument("--smoke", action="store_true", help="a few tiny requests, for tests")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # one level, result on stdout
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    try:
        args.baselines = [Baseline.parse(b) for b in args.baseline]
    except ValueError as e:
        ap.error(str(e))
    if args.baselines and args.csv:
        ap.error("--csv records one build's sweep; with --baseline the comparison is printed only")
    if args.rounds > 1 and not args.baselines:
        ap.error("--rounds interleaves builds: it needs --baseline")
    args.concurrency = args.concurrency or ([1, 16] if args.baselines else [1, 4, 16, 64])
    if args.smoke:
        args.concurrency, args.num_prompts = [1, 2], 2
        args.workload, args.input_len, args.output_len, args.prefix_len = "fixed", 16, 4, 32
    if args.worker is not None:
        args.concurrency = [args.worker]
        print(RESULT_TAG + json.dumps(measure(args)), flush=True)
        return []
    if args.baselines:
        args.forwarded = argv
        compare(args)
        return []
    result = measure(args)
    report(args, result)
    return result["rows"]


if __name__ == "__main__":
    main()
