"""W4A16 GEMM of the CUDA backend against fp16 dense GEMM (cuBLAS, as torch.matmul calls it), on the
linear shapes of Llama-2-7B, at M = 1, 16, 64, 256 rows (ISSUE 6: Marlin holds ~3.9x up to M 16-32).

    python benchmark/kernels/bench_cuda_gemm.py [--group-size 128] [--csv FILE] [--smoke]

Per (shape, M): median time of our int4 linear (GEMV up to 8 rows, tensor-core GEMM above), of our own
fp16 tensor-core GEMM (wmma) and of torch.matmul fp16 (cuBLAS), the speed-up of int4 over cuBLAS, and the
int4 kernel's achieved bandwidth (weight bytes read / time) against the measured copy bandwidth.
Random weights (AWQ tensors of the right shapes); needs a GPU, torch with CUDA and the CUDA build.
"""

from __future__ import annotations

import argparse
import csv
from datetime import date
from pathlib import Path

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


def time_ms(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="one small shape, few repeats")
    args = ap.parse_args(argv)
    import torch

    from lmkit import _engine

    cu = _engine.cuda
    if not (cu.is_built and cu.is_available() and torch.cuda.is_available()):
        raise SystemExit("needs a CUDA GPU, torch with CUDA and lmkit built with the CUDA backend")
    shapes = {"small": (512, 1024)} if args.smoke else SHAPES
    rows_list = [1, 16] if args.smoke else args.rows
    repeats = 3 if args.smoke else args.repeats
    bandwidth = cu.measure_copy_bandwidth(1 << 28 if args.smoke else 1 << 30, 10)
    g = args.group_size
    print(f"{cu.device_name()}, {date.today()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; int4 group {g}; "
          f"dense GEMM backend of the engine: {cu.dense_gemm_backend()}")
    print(f"{'shape':>8}{'M':>5}{'int4 us':>10}{'wmma fp16 us':>14}{'cuBLAS fp16 us':>16}{'int4/cuBLAS':>13}{'int4 GB/s':>11}")
    out = []
    for name, (n, k) in shapes.items():
        qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32)
        qzeros = torch.full((k // g, n // 8), 0x77777777, dtype=torch.int32)
        scales = torch.full((k // g, n), 0.01, dtype=torch.float16)
        w4 = cu.upload_int4(qweight.numpy(), qzeros.numpy(), scales.numpy(), g, "F16")
        dense = (torch.rand(n, k) * 0.02 - 0.01).half()
        wd = cu.upload_dense(dense.numpy(), "F16")
        dense_gpu = dense.cuda()
        for m in rows_list:
            x = torch.randn(m, k, device="cuda").half()
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            t4 = time_ms(lambda: cu.linear(x.data_ptr(), m, w4, 0, y.data_ptr(), "F16"), repeats)
            cu.set_dense_gemm_backend("wmma")
            tw = time_ms(lambda: cu.linear(x.data_ptr(), m, wd, 0, y.data_ptr(), "F16"), repeats)
            cu.set_dense_gemm_backend("cublas")
            tc = time_ms(lambda: torch.matmul(x, dense_gpu.T, out=y), repeats)
            gbs = w4.size_bytes / (t4 * 1e-3) / 1e9
            row = {"shape": name, "n": n, "k": k, "m": m, "int4_us": t4 * 1e3, "wmma_us": tw * 1e3,
                   "cublas_us": tc * 1e3, "speedup": tc / t4, "int4_gb_s": gbs}
            out.append(row)
            print(f"{name:>8}{m:>5}{row['int4_us']:10.1f}{row['wmma_us']:14.1f}{row['cublas_us']:16.1f}"
                  f"{row['speedup']:12.2f}x{gbs:11.0f}")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not args.csv.exists()
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "group_size", *out[0].keys()])
            for r in out:
                w.writerow([date.today(), cu.device_name(), g, *(f"{v:.3f}" if isinstance(v, float) else v
                                                                for v in r.values())])
    return out


if __name__ == "__main__":
    main()
