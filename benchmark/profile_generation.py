"""Decode speed and TTFT over a grid of batch size x (input, output) lengths, with the fraction of the
memory-bandwidth roofline each cell reaches (LMDeploy's profile_generation, plus the roofline).

    python benchmark/profile_generation.py [--model PATH] [--batch 1 4 16] [--io 128x128 512x128]
        [--threads 2] [--device cpu|cuda] [--quant-policy 0|8|4] [--bandwidth GB/s] [--csv FILE] [--smoke]

Per cell: `batch` requests of `input` random-vocabulary tokens each, submitted at once, each generating
exactly `output` tokens (ignore_eos); first a warm-up cell per batch size (the grid's shortest input, 4 new
tokens), so that no measured cell pays a one-time cost (on CUDA: a batch size's graph capture, cuBLAS's
first GEMMs for prefill and logits over more rows than the skinny kernel takes). TTFT: mean over the batch. Decode
tok/s: the tokens after each request's first, over the time from the last first token to the last token (the
steady decode phase, every request in the batch). Roofline: a decode step must read the weights its forward
uses once (as packed: int4 / int8 / fp16; every weight of a dense model, the routed experts of a mixture of
experts: the engine's `num_weight_bytes_read` over its steps in the cell) plus each sequence's K/V (mean
context x `Engine.kv_bytes_per_block` / block size), so at bandwidth B the step takes at least bytes / B and
decode tok/s is at most batch x B / bytes; the fraction is measured / that bound.
B: --bandwidth, else measured here as the copy bandwidth of --threads threads (numpy, 256 MiB
buffers, read + write bytes counted, best of 5), or on --device cuda as the GPU's device-to-device copy
bandwidth (1 GiB buffers, timed with CUDA events). With --csv, a PNG of the roofline chart is written
beside it (matplotlib, when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from summary import append_csv  # noqa: E402


def kv_label(engine, kv_per_token: float, device: str) -> str:
    """The KV cache's element type, from its bytes per token: int4 / int8 (quant_policy, plus their scales),
    bf16 (dtype auto or bfloat16 on a CPU with AVX512_BF16) or fp32 at quant_policy 0 on the CPU."""
    spec = engine.spec
    per_value = kv_per_token / (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim)
    if device == "cuda" and per_value == 2:
        return "fp16/bf16"
    return "fp32" if per_value == 4 else "bf16" if per_value == 2 else "int8" if per_value > 1 else "int4"


def copy_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of `threads` threads each copying its part of a buffer (read + write bytes counted)."""
    n = mib * 2**20 // 8
    src, dst = np.ones(n), np.zeros(n)
    chunks = np.array_split(np.arange(n), threads)
    bounds = [(c[0], c[-1] + 1) for c in chunks]

    def work(lo, hi):
        np.copyto(dst[lo:hi], src[lo:hi])  # numpy releases the GIL for the copy

    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=work, args=b) for b in bounds]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 8 / best


async def run_cell(engine, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    from lmkit import GenerationConfig

    rng = np.random.default_rng(seed)
    vocab = engine.tokenizer.vocab_size
    gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True)

    async def one(prompt):
        start, stamps = engine.engine.now(), []
        async for r in engine.generate(prompt, gen):
            stamps.extend([engine.engine.now()] * len(r.token_ids))
            if r.finish_reason not in (None, "length"):
                raise RuntimeError(f"request ended with {r.finish_reason}: {r.error}")
        return start, stamps

    prompts = [rng.integers(100, vocab - 100, input_len).tolist() for _ in range(batch)]
    results = await asyncio.gather(*(one(p) for p in prompts))
    ttft = [stamps[0] - start for start, stamps in results]
    first_all = max(stamps[0] for _, stamps in results)
    end = max(stamps[-1] for _, stamps in results)
    decode_tokens = sum(sum(1 for t in stamps[1:] if t > first_all) for _, stamps in results)
    return {"ttft_s": float(np.mean(ttft)), "decode_tok_s": decode_tokens / (end - first_all) if end > first_all else 0.0}


def parse_io(text: str) -> tuple[int, int]:
    try:
        i, o = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INPUTxOUTPUT such as 128x128, got {text!r}") from None
    if i < 1 or o < 2:
        raise argparse.ArgumentTypeError(f"input must be >= 1 and output >= 2 tokens, got {text!r}")
    return i, o


def plot_roofline(rows: list[dict], bandwidth: float, path: Path, title: str) -> None:
    """Measured decode tok/s against the bandwidth bound, per cell (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    bound = np.array([r["bound_tok_s"] for r in rows])
    got = np.array([r["decode_tok_s"] for r in rows])
    lim = (min(bound.min(), got.min()) * 0.7, max(bound.max(), got.max()) * 1.4)
    ax.plot(lim, lim, "k-", lw=1, label=f"roofline ({bandwidth / 1e9:.1f} GB/s)")
    ax.plot(lim, [x * 0.5 for x in lim], "k:", lw=1, label="50% of roofline")
    for r in rows:
        ax.scatter(r["bound_tok_s"], r["decode_tok_s"], s=30)
        ax.annotate(f"b{r['batch']} {r['input']}x{r['output']}", (r["bound_tok_s"], r["decode_tok_s"]),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="bandwidth bound, decode tok/s",
           ylabel="measured decode tok/s", title=title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF or AWQ folder (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--io", type=parse_io, nargs="+", default=[(128, 128), (512, 128)],
                    help="INPUTxOUTPUT token lengths")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    ap.add_argument("--quant-policy", type=int, choices=[0, 4, 8], default=0, help="KV cache: 0 fp, 8 int8, 4 int4")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s of the device (default: measured copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=None, help="append rows here; the roofline PNG goes beside it")
    ap.add_argument("--smoke", action="store_true", help="one tiny cell, for tests")
    args = ap.parse_args(argv)
    if args.bandwidth is not None and args.bandwidth <= 0:
        ap.error(f"--bandwidth must be > 0 GB/s, got {args.bandwidth}")
    if args.smoke:
        args.batch, args.io = [2], [(8, 4)]

    from lmkit import AsyncEngine, EngineConfig, _engine

    threads = args.threads or len(os.sched_getaffinity(0))
    if args.bandwidth:
        bandwidth = args.bandwidth * 1e9
    elif args.device == "cuda":
        bandwidth = _engine.cuda.measure_copy_bandwidth(1 << 30, 20)
    else:
        bandwidth = copy_bandwidth(threads, 32 if args.smoke else 256)
    longest = max(i + o for i, o in args.io)
    engine = AsyncEngine(args.model, EngineConfig(
        device=args.device, num_threads=threads, max_batch_size=max(args.batch), session_len=longest,
        max_prefill_token_num=max(8192, max(args.batch) * max(i for i, _ in args.io)), quant_policy=args.quant_policy))
    weight_bytes = engine.engine.linear_weight_bytes
    kv_per_token = engine.engine.kv_bytes_per_block / engine.engine.config.cache_block_seq_len
    rows = []
    try:
        shortest = min(i for i, _ in args.io)
        for b in args.batch:  # warm-up: see the docstring
            asyncio.run(run_cell(engine, b, shortest, 4, seed=10_000))
        for b in args.batch:
            for i, o in args.io:
                before = engine.metrics()
                cell = asyncio.run(run_cell(engine, b, i, o, args.seed))
                after = engine.metrics()
                # weights a step read, on average over the cell (every weight for a dense model; a mixture
                # of experts reads the experts its routing ran); prefill steps included, so an upper bound
                steps = after.num_steps - before.num_steps
                read = (after.num_weight_bytes_read - before.num_weight_bytes_read) / steps if steps else weight_bytes
                step_bytes = read + b * (i + o / 2) * kv_per_token  # mean context over the decode
                bound = b * bandwidth / step_bytes
                rows.append({"batch": b, "input": i, "output": o, **cell, "bound_tok_s": bound,
                             "roofline_fraction": cell["decode_tok_s"] / bound, "read_mib_per_step": read / 2**20})
    finally:
        engine.close()

    name = Path(str(engine.engine.model_path)).name
    kv = kv_label(engine.engine, kv_per_token, args.device)
    machine = _engine.cuda.device_name() if args.device == "cuda" else cpu_description()
    print(f"model {name}, KV {kv}, {threads} threads, {machine}, {date.today()}; "
          f"weights {weight_bytes / 2**20:.1f} MiB in all, KV {kv_per_token / 1024:.1f} KiB per token; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s ({'given' if args.bandwidth else 'measured copy'})")
    print(f"{'batch':>6}{'input':>7}{'output':>7}{'TTFT ms':>10}{'decode tok/s':>14}{'read MiB/step':>15}"
          f"{'bound tok/s':>13}{'roofline':>10}")
    for r in rows:
        print(f"{r['batch']:>6}{r['input']:>7}{r['output']:>7}{r['ttft_s'] * 1e3:10.1f}{r['decode_tok_s']:14.1f}"
              f"{r['read_mib_per_step']:15.1f}{r['bound_tok_s']:13.1f}{r['roofline_fraction']:10.1%}")
    if args.csv:
        append_csv(args.csv, ["date", "model", "cpu", "threads", "kv_cache", "batch", "input", "output", "ttft_ms",
                              "decode_tok_s", "bandwidth_gb_s", "bound_tok_s", "roofline_fraction"],
                   [[date.today(), name, machine, threads, kv, r["batch"], r["input"], r["output"],
                     f"{r['ttft_s'] * 1e3:.2f}", f"{r['decode_tok_s']:.2f}", f"{bandwidth / 1e9:.2f}",
                     f"{r['bound_tok_s']:.2f}", f"{r['roofline_fraction']:.4f}"] for r in rows])
        try:
            png = args.csv.with_suffix(".roofline.png")
            plot_roofline(rows, bandwidth, png, f"{name}, KV {kv}, {machine}")
            print(f"roofline chart: {png}")
        except ImportError:
            print("matplotlib not installed: no chart (pip install matplotlib)")
    return rows


if __name__ == "__main__":
    main()
