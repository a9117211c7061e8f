"""Ours (bench_cpu_kernels gemm) vs PyTorch fp32 F.linear on the prefill shapes, best of several
interleaved rounds (the machine may be shared, so each side keeps its fastest run).

    python benchmark/kernels/compare_gemm.py [threads] [rounds]     (after run.sh has built the binary)
"""
import os
import re
import subprocess
import sys
import time

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
binary = os.path.join(os.environ.get("LMKIT_BENCH_BUILD", "/tmp/lmkit_bench_kernels"), "bench_cpu_kernels")
torch.set_num_threads(threads)

ours: dict = {}
theirs: dict = {}
pattern = re.compile(r"gemm \[(\d+) x (\d+)\] x \[(\d+) x \d+\]\^T (\w+)\s*:\s*([\d.]+) ms\s+([\d.]+) GFLOP/s")
for _ in range(rounds):
    out = subprocess.run([binary, "avx512", str(threads), "gemm"], capture_output=True, text=True).stdout
    for M, K, N, dt, _ms, gflops in pattern.findall(out):
        key = (int(M), int(N), int(K), dt)
        ours[key] = max(ours.get(key, 0.0), float(gflops))
    for M, N, K in {(k[0], k[1], k[2]) for k in ours}:
        x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
        torch.nn.functional.linear(x, w)
        ts = []
        for _ in range(5 if N * M > 10_000_000 else 21):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            ts.append(time.perf_counter() - t0)
        theirs[(M, N, K)] = max(theirs.get((M, N, K), 0.0), 2 * M * N * K / min(ts) / 1e9)

print(f"{threads} threads, best of {rounds} rounds, GFLOP/s")
print(f"{'shape (M x K) x (N x K)^T':32} {'torch f32':>10} {'ours F32':>9} {'ours F16':>9} {'ours BF16':>9}")
for M, N, K in sorted({(k[0], k[1], k[2]) for k in ours}, key=lambda s: (-s[0], s[1])):
    row = [ours.get((M, N, K, dt), float("nan")) for dt in ("F32", "F16", "BF16")]
    print(f"[{M} x {K}] x [{N} x {K}]^T{'':{max(0, 14 - len(str(N)) - len(str(K)))}} {theirs[(M, N, K)]:10.1f} "
          + " ".join(f"{v:9.1f}" for v in row))
