#!/bin/bash
# Builds the CPU kernels with the per-file flags of CMakeLists.txt plus the benchmark, then runs it.
#   benchmark/kernels/run.sh [isa: avx512|avx2|generic] [threads] [only: bw|gemv|gemv576|gemv1.2b|gguf|gemm|awq|q4prefill|q8prefill|attn|decode16|elem]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${LMKIT_BENCH_BUILD:-/tmp/lmkit_bench_kernels}
mkdir -p "$OUT"
F="-O3 -DNDEBUG -std=c++17 -pthread -I$ROOT/csrc"
objs=()
for f in "$ROOT"/csrc/kernels/cpu/*.cpp; do
  b=$(basename "$f" .cpp); X=""
  [ "$b" = isa_avx2 ] && X="-mavx2 -mfma -mf16c"
  [ "$b" = isa_avx512 ] && X="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c"
  g++ $F $X -c "$f" -o "$OUT/$b.o"
  objs+=("$OUT/$b.o")
done
# the AWQ rows read their weights through the checkpoint layouts' Int4Source (which reads MXFP4 ones too)
for b in int4_layouts mxfp4; do
  g++ $F -c "$ROOT/csrc/model/$b.cpp" -o "$OUT/$b.o"
  objs+=("$OUT/$b.o")
done
g++ $F "$ROOT/benchmark/kernels/bench_cpu_kernels.cpp" "${objs[@]}" -o "$OUT/bench_cpu_kernels"
"$OUT/bench_cpu_kernels" "${1:-avx512}" "${2:-2}" "${3:-}"
