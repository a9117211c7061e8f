"""The CUDA backend's linear kernels against fp16 dense GEMM (cuBLAS, as torch.matmul calls it), on the
linear shapes of Llama-2-7B, at M = 1 to 256 rows (ISSUE 6: Marlin holds ~3.9x up to M 16-32).

    python benchmark/kernels/bench_cuda_gemm.py [--group-size 128] [--rows 1 4 16 32 64 128 256] [--csv FILE] [--smoke]

Per (shape, M), the time of one call of:
  int4 skinny   our int4 linear on the skinny tensor-core kernel (the engine's path up to its int4 skinny rows);
                alt: the same with the other load schedule (set_skinny_pipeline)
  int4 other    our int4 linear with the skinny kernel off (dequantized, then cuBLAS; the WMMA GEMM without
                cuBLAS): the engine's path above its int4 skinny rows
  fp16 skinny   our dense fp16 linear on the skinny kernel (the engine's path up to its dense skinny rows), alt
  cuBLAS fp16   torch.matmul in fp16
then int4 skinny over cuBLAS, and the bytes of weights each skinny kernel reads per second against the copy
bandwidth. Every figure is a CUDA graph of many calls, replayed, over enough copies of the weights to be
several times the L2 cache (each call reads its weights from device memory, as a decode step does), the
median of the replays divided by the calls. Random weights (AWQ tensors of the right shapes); needs a GPU,
torch with CUDA and the CUDA build.
"""

from __future__ import annotations

import argparse
import csv
import math
from datetime import date
from pathlib import Path

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


_SIDE = []


def graph_us(calls: list, replays: int) -> float:
    """Median time of one of `calls` (zero-argument launches on torch's current stream), captured in a graph on
    the stream they warmed up on (linear()'s int4 scratch is per stream, made outside a capture)."""
    import torch

    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    side = _SIDE[0]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:3]:
            fn()  # warm-up outside the capture (module load, cuBLAS handles)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2] * 1e3 / len(calls)


def rotation(items: list, make) -> list:
    """make(item) for 24 calls or two passes over `items`, whichever is more, cycling through them."""
    return [make(items[i % len(items)]) for i in range(max(24, 2 * len(items)))]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="one small shape, few replays")
    args = ap.parse_args(argv)
    import torch

    from lmkit import _engine

    cu = _engine.cuda
    if not (cu.is_built and cu.is_available() and torch.cuda.is_available()):
        raise SystemExit("needs a CUDA GPU, torch with CUDA and lmkit built with the CUDA backend")
    shapes = {"small": (512, 1024)} if args.smoke else SHAPES
    rows_list = [1, 16] if args.smoke else args.rows
    replays = 3 if args.smoke else args.replays
    bandwidth = cu.measure_copy_bandwidth(1 << 28 if args.smoke else 1 << 30, 10)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    g = args.group_size
    saved_rows, saved_pipe = cu.skinny_rows(), cu.skinny_pipeline()
    print(f"{cu.device_name()}, {date.today()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; L2 {l2 >> 20} MiB; "
          f"int4 group {g}; engine's skinny rows (int4, dense) {saved_rows}, pipelined loads {saved_pipe} "
          f"(alt: the other setting); dense GEMM backend {cu.dense_gemm_backend()}")
    print(f"{'shape':>8}{'M':>5}{'int4 skinny us':>16}{'alt':>7}{'int4 other us':>15}{'fp16 skinny us':>16}{'alt':>7}"
          f"{'cuBLAS us':>11}{'int4/cuBLAS':>13}{'int4 GB/s':>11}{'fp16 GB/s':>11}")
    out = []
    big = 1 << 20
    try:
        for name, (n, k) in shapes.items():
            qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32)
            qzeros = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), dtype=torch.int32)
            scales = (torch.rand(k // g, n) * 0.01 + 0.001).to(torch.float16)
            first = cu.upload_int4(qweight.numpy(), qzeros.numpy(), scales.numpy(), g, "F16")
            w4 = [first] + [cu.upload_int4(qweight.numpy(), qzeros.numpy(), scales.numpy(), g, "F16")
                            for _ in range(math.ceil(4 * l2 / first.size_bytes) - 1)]
            dense = (torch.rand(n, k) * 0.02 - 0.01).half()
            copies_dense = math.ceil(4 * l2 / (n * k * 2))
            wd = [cu.upload_dense(dense.numpy(), "F16") for _ in range(copies_dense)]
            dense_gpu = [dense.cuda() for _ in range(copies_dense)]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda").half()
                y = torch.empty(m, n, device="cuda", dtype=torch.float16)

                def ours(w):
                    return lambda: cu.linear(x.data_ptr(), m, w, 0, y.data_ptr(), "F16",
                                             stream=torch.cuda.current_stream().cuda_stream)

                cu.set_skinny_rows(big, big)
                t4 = graph_us(rotation(w4, ours), replays)
                td = graph_us(rotation(wd, ours), replays)
                cu.set_skinny_pipeline(not saved_pipe)
                t4b = graph_us(rotation(w4, ours), replays)
                tdb = graph_us(rotation(wd, ours), replays)
                cu.set_skinny_pipeline(saved_pipe)
                cu.set_skinny_rows(0, 0)
                t4o = graph_us(rotation(w4, ours), replays)
                cu.set_skinny_rows(*saved_rows)
                tc = graph_us(rotation(dense_gpu, lambda d: lambda: torch.matmul(x, d.T, out=y)), replays)
                row = {"shape": name, "n": n, "k": k, "m": m, "int4_skinny_us": t4, "int4_skinny_alt_us": t4b,
                       "int4_other_us": t4o, "fp16_skinny_us": td, "fp16_skinny_alt_us": tdb, "cublas_us": tc,
                       "speedup": tc / t4,
                       "int4_gb_s": first.size_bytes / (t4 * 1e-6) / 1e9, "fp16_gb_s": n * k * 2 / (td * 1e-6) / 1e9}
                out.append(row)
                print(f"{name:>8}{m:>5}{t4:16.1f}{t4b:7.1f}{t4o:15.1f}{td:16.1f}{tdb:7.1f}{tc:11.1f}{row['speedup']:12.2f}x"
                      f"{row['int4_gb_s']:11.0f}{row['fp16_gb_s']:11.0f}", flush=True)
            del w4, wd, dense_gpu
    finally:
        cu.set_skinny_rows(*saved_rows)
        cu.set_skinny_pipeline(saved_pipe)
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not args.csv.exists()
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "group_size", "copy_gb_s", *out[0].keys()])
            for r in out:
                w.writerow([date.today(), cu.device_name(), g, f"{bandwidth / 1e9:.0f}",
                            *(f"{v:.3f}" if isinstance(v, float) else v for v in r.values())])
    return out


if __name__ == "__main__":
    main()
