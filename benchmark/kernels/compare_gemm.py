"""Ours (bench_cpu_kernels gemm) vs PyTorch fp32 F.linear on the same prefill shapes, best of several
interleaved rounds (the machine may be shared, so each side keeps its fastest run).

    python benchmark/kernels/compare_gemm.py [--threads 2] [--rounds 3] [--smoke]
        (after run.sh has built the binary; LMKIT_BENCH_BUILD names its folder, default /tmp/lmkit_bench_kernels)

Our kernels run on the CPU's best ISA. --smoke: one round of the benchmark's smoke mode, one timed torch
call per shape (the tests run it against the ctest build so that neither side can rot).
"""
import argparse
import os
import re
import subprocess
import sys
import time

import torch

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--smoke", action="store_true")
args = ap.parse_args()
binary = os.path.join(os.environ.get("LMKIT_BENCH_BUILD", "/tmp/lmkit_bench_kernels"), "bench_cpu_kernels")
if not os.path.exists(binary):
    sys.exit(f"{binary} is missing: build it with benchmark/kernels/run.sh (or set LMKIT_BENCH_BUILD)")
torch.set_num_threads(args.threads)
rounds = 1 if args.smoke else args.rounds

ours: dict = {}
theirs: dict = {}
pattern = re.compile(r"gemm \[(\d+) x (\d+)\] x \[(\d+) x \d+\]\^T (\w+)\s*:\s*([\d.]+) ms\s+([\d.]+) GFLOP/s")
for _ in range(rounds):
    run = subprocess.run([binary, "-", str(args.threads), "smoke" if args.smoke else "gemm"], capture_output=True,
                         text=True)
    if run.returncode != 0:
        sys.exit(f"{binary} failed ({run.returncode}): {run.stdout[-500:]}{run.stderr[-500:]}")
    for M, K, N, dt, _ms, gflops in pattern.findall(run.stdout):
        key = (int(M), int(N), int(K), dt)
        ours[key] = max(ours.get(key, 0.0), float(gflops))
    for M, N, K in {(k[0], k[1], k[2]) for k in ours}:
        x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
        torch.nn.functional.linear(x, w)
        ts = []
        for _ in range(1 if args.smoke else 5 if N * M > 10_000_000 else 21):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            ts.append(time.perf_counter() - t0)
        theirs[(M, N, K)] = max(theirs.get((M, N, K), 0.0), 2 * M * N * K / min(ts) / 1e9)
if not ours:
    sys.exit(f"no gemm lines in the output of {binary}")

print(f"torch {torch.__version__}, {args.threads} threads, best of {rounds} rounds, GFLOP/s")
print(f"{'shape (M x K) x (N x K)^T':32} {'torch f32':>10} {'ours F32':>9} {'ours F16':>9} {'ours BF16':>9}")
for M, N, K in sorted({(k[0], k[1], k[2]) for k in ours}, key=lambda s: (-s[0], s[1])):
    row = [ours.get((M, N, K, dt), float("nan")) for dt in ("F32", "F16", "BF16")]
    print(f"[{M} x {K}] x [{N} x {K}]^T{'':{max(0, 14 - len(str(N)) - len(str(K)))}} {theirs[(M, N, K)]:10.1f} "
          + " ".join(f"{v:9.1f}" for v in row))
