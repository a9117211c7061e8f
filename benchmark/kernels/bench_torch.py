"""PyTorch fp32 F.linear on the prefill/decode shapes of bench_cpu_kernels.cpp, for comparison."""
import sys
import time

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
for M, N, K in [(512, 1536, 576), (512, 576, 1536), (512, 49152, 576), (512, 576, 576), (512, 192, 576),
                (128, 1536, 576), (16, 1536, 576), (1, 49152, 576), (4, 49152, 576), (8, 49152, 576)]:
    x = torch.randn(M, K)
    w = torch.randn(N, K) * 0.05
    reps = 5 if N * M > 10_000_000 else 21
    torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        ts.append(time.perf_counter() - t0)
    t = min(ts)
    print(f"torch linear [{M} x {K}] x [{N} x {K}]^T f32: {t * 1e3:8.3f} ms  {2 * M * N * K / t / 1e9:6.1f} GFLOP/s")
