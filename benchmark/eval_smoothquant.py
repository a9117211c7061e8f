"""SmoothQuant W8A8 quality and cost on one model: fp vs plain W8A8 vs lmkit SmoothQuant, perplexity on held-out
text, and the engine's greedy agreement with the fp model.

    python benchmark/eval_smoothquant.py              # SmolLM2-135M-Instruct, 128 x 512 of the default calibration
                                                      # text (shakespeare+pydoc)
    python benchmark/eval_smoothquant.py --llmcompressor-python /tmp/llmc/bin/python   # also llm-compressor's W8A8
                                                      # recipe on the same windows (benchmark/run_llmcompressor.py)
    python benchmark/eval_smoothquant.py --smoke      # tiny settings, to check the script runs

Rows: plain W8A8 (int8 weights per channel, per-token int8 activations, no smoothing: round-to-nearest, then with
GPTQ rounding), SmoothQuant with the fixed migration strength 0.5 and round-to-nearest (the paper's and LMDeploy's
smooth_quant default), the strength searched per group with GPTQ rounding, and lmkit's default (searched,
round-to-nearest).

Perplexity (``lmkit.lite.ppl``, torch reference path, fp32 compute, activations fake-quantized per token by
compressed-tensors as the checkpoints declare): the first 2,048 tokens of Hamlet and of the held-out pydoc topics
in 4 disjoint windows of 512 (as eval_awq.py). "gap closed" = (plain RTN - x) / (plain RTN - fp). The engine column:
greedy tokens of lmkit's engine on the W8A8 folder (int8 activations per 32 values, VNNI / AMX-INT8 / AVX2 dot
products) that equal the fp model's, over 8 prompts x 32 tokens.
Prints a markdown table and writes JSON (machine, date, settings, figures) to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_awq import EVAL_SETS, ROOT, machine, perplexities  # noqa: E402

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "To be, or not to be,", "The capital of France is",
           "import numpy as np\n", "Once upon a time", "HAMLET. Who's there?", "The three laws of motion are"]


def greedy_tokens(model, new_tokens: int) -> list[list[int]]:
    from lmkit import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(dtype="float32", device="cpu", max_batch_size=8, session_len=512)
    with pipeline(model, config) as pipe:
        results = pipe(PROMPTS, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
    return [r.token_ids for r in results]


def run_llmcompressor(args, source: Path) -> tuple[Path, float]:
    """llm-compressor's W8A8 checkpoint of ``source`` on lmkit's calibration windows (run_llmcompressor.py)."""
    import shutil
    import subprocess

    from transformers import AutoTokenizer

    from lmkit.lite.calib import mixed_windows
    from lmkit.lite.corpora import calibration_corpora

    windows = mixed_windows(AutoTokenizer.from_pretrained(source), calibration_corpora(args.calib_dataset),
                            args.calib_samples, args.calib_seqlen, seed=0)
    out = args.work_dir / "llmcompressor"
    shutil.rmtree(out, ignore_errors=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / "llmcompressor_windows.json").write_text(json.dumps(windows.tolist()))
    run = subprocess.run([args.llmcompressor_python, str(Path(__file__).with_name("run_llmcompressor.py")),
                          str(source), str(args.work_dir / "llmcompressor_windows.json"), str(out)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llm-compressor failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return out, json.loads(run.stdout.strip().splitlines()[-1])["quantize_seconds"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--calib-dataset", default=None, help="default: SmoothQuantConfig's (shakespeare+pydoc)")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--eval-seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--llmcompressor-python", default=None,
                        help="a Python with llmcompressor installed: also its W8A8 recipe on the same windows")
    parser.add_argument("--only-llmcompressor", action="store_true", help="skip lmkit's rows (fp is kept)")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: checks the script, not the model")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmark" / "results" / "smoothquant")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (default: WORK_DIR/figures.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calib_samples, args.calib_seqlen, args.eval_tokens, args.eval_seqlen, args.new_tokens = 4, 128, 256, 128, 4

    from lmkit.lite import SmoothQuantConfig, quantize_smooth_quant
    from lmkit.model_path import resolve_model

    if args.calib_dataset is None:
        args.calib_dataset = SmoothQuantConfig(work_dir=args.work_dir).calib_dataset
    source = resolve_model(args.model)
    info = {"machine": machine(), "model": str(source), "settings": vars(args) | {"work_dir": str(args.work_dir)}}
    print(f"# {source.name}: fp vs plain W8A8 vs lmkit SmoothQuant (W8A8 int8, compressed-tensors)", flush=True)
    reference = greedy_tokens(source, args.new_tokens)
    rows = []

    def add(label, model_dir, seconds):
        t = time.perf_counter()
        ppl = perplexities(model_dir, args.eval_seqlen, args.eval_tokens)
        tokens = greedy_tokens(model_dir, args.new_tokens)
        same = sum(a == b for got, want in zip(tokens, reference) for a, b in zip(got, want))
        rows.append({"method": label, "quantize_seconds": seconds, "ppl": ppl, "greedy_match": same,
                     "greedy_total": sum(map(len, reference)), "eval_seconds": round(time.perf_counter() - t, 1)})
        print(f"  {label:50s} " + "  ".join(f"{n} {ppl[n]['ppl']:.3f}" for n in EVAL_SETS)
              + f"  engine greedy {same}/{rows[-1]['greedy_total']}"
              + (f"  ({seconds:.0f} s to quantize)" if seconds else ""), flush=True)

    add("fp (fp16 weights, fp32 compute)", source, None)
    variants = [("W8A8, no smoothing, round-to-nearest", "plain-rtn", dict(smooth=False, rounding="nearest")),
                ("W8A8, no smoothing, GPTQ", "plain-gptq", dict(smooth=False, rounding="gptq")),
                ("SmoothQuant alpha 0.5, round-to-nearest", "sq-0.5-rtn", dict(alpha=0.5, rounding="nearest")),
                ("SmoothQuant alpha searched, GPTQ", "sq-gptq", dict(rounding="gptq")),
                ("lmkit default (alpha searched, round-to-nearest)", "sq", dict(rounding="nearest"))]
    for label, folder, overrides in ([] if args.only_llmcompressor else variants):
        settings = dict(work_dir=args.work_dir / folder, calib_dataset=args.calib_dataset,
                        calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen, overwrite=True)
        settings.update(overrides)
        start = time.perf_counter()
        result = quantize_smooth_quant(source, SmoothQuantConfig(**settings))
        add(label, result.work_dir, round(time.perf_counter() - start, 1))

    if args.llmcompressor_python:
        add("llm-compressor 0.14 (SmoothQuant 0.8 + GPTQ)", *run_llmcompressor(args, source))

    fp = {n: rows[0]["ppl"][n]["ppl"] for n in EVAL_SETS}
    plain = {n: rows[1]["ppl"][n]["ppl"] for n in EVAL_SETS}
    print()
    print(f"| method | Hamlet ppl ({rows[0]['ppl']['hamlet']['num_tokens']} tok) | gap closed | "
          f"pydoc ppl ({rows[0]['ppl']['pydoc']['num_tokens']} tok) | gap closed | engine greedy = fp | quantize time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cells = []
        for n in EVAL_SETS:
            p = row["ppl"][n]["ppl"]
            gap = plain[n] - fp[n]
            closed = "" if row is rows[0] else f"{(plain[n] - p) / gap:.0%}" if gap > 0 else "n/a"
            row.setdefault("gap_closed", {})[n] = None if not closed or gap <= 0 else (plain[n] - p) / gap
            cells += [f"{p:.3f}", closed]
        secs = f"{row['quantize_seconds']:.0f} s" if row["quantize_seconds"] else ""
        print(f"| {row['method']} | " + " | ".join(cells)
              + f" | {row['greedy_match']}/{row['greedy_total']} | {secs} |")
    info["rows"] = rows
    info["machine"]["load_average_end"] = os.getloadavg()
    out = args.json or args.work_dir / "figures.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2, default=str) + "\n")
    print(f"\nfigures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
