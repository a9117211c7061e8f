"""FP4 checkpoints on the CPU against the dense, FP8 and int4 forms of the same model, side by side in one run:
batch-1 greedy decode tokens/s (after the first token), the time to the first token of a --prefill-token prompt,
the bytes of the packed linear weights, and (unless --no-kl) each form's KL divergence from the dense model on
Hamlet (lite/kl.py: mean KL, same top token, perplexity).

    python benchmark/bench_fp4.py [--model smollm2] [--work-dir DIR] [--rounds 2] [--threads 2] [--csv out.csv]
    python benchmark/bench_fp4.py --model llama-1.2b ...   # make_dummy_model's 1.2B Llama shape, random weights

The forms, each written once into --work-dir by lmkit lite (data-free, round to nearest, so that only the format
differs): dense (the checkpoint, dtype auto: bf16 compute where the CPU has AVX512_BF16), int8 (the dense checkpoint
with EngineConfig(quantization="int8"): rounded to int8 per 32 as it loads, nothing written), fp8 (lite fp8,
weight-only: decoded to the compute dtype at load), int4 (lite awq --rtn, group 32: 4.625 bits), nvfp4 and mxfp4
(lite fp4). The engines run with their defaults (int8 activations on the quantized forms). Rounds are interleaved
(every form once per round) and the best of --repeats within a round is kept; the table gives the median over
rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description, prompt_ids  # noqa: E402
from summary import append_csv  # noqa: E402

FORMS = ("dense", "int8", "fp8", "int4", "nvfp4", "mxfp4")


def source_model(name: str, work_dir: Path) -> Path:
    """The dense checkpoint: the bundled SmolLM2 (``smollm2``), make_dummy_model's shape ``llama-1.2b`` (random
    weights, written once), or a folder."""
    from lmkit.model_path import resolve_model

    if name == "llama-1.2b":
        from make_dummy_model import make_dummy_model

        out = work_dir / "dense-llama-1.2b"
        if not (out / "config.json").exists():
            make_dummy_model(out, "llama-1.2b", tokenizer=resolve_model("smollm2"))
        return out
    return resolve_model(name)


def make_form(form: str, source: Path, work_dir: Path) -> tuple[Path, float]:
    """The folder of ``form`` (written by lmkit lite unless it is there) and the seconds writing it took."""
    from lmkit.lite.export import COMPLETE_MARKER

    if form in ("dense", "int8"):
        return source, 0.0
    out = work_dir / f"{form}-{source.name}"
    if (out / COMPLETE_MARKER).exists():
        return out, 0.0
    start = time.perf_counter()
    if form == "fp8":
        from lmkit.lite import Fp8Config, quantize_fp8

        quantize_fp8(source, Fp8Config(work_dir=out, scheme="weight-only", device="cpu", overwrite=True))
    elif form == "int4":
        from lmkit.lite import AwqConfig, quantize_awq

        quantize_awq(source, AwqConfig(work_dir=out, w_group_size=32, calib_samples=0, device="cpu", overwrite=True))
    else:
        from lmkit.lite import Fp4Config, quantize_fp4

        quantize_fp4(source, Fp4Config(work_dir=out, format=form, device="cpu", overwrite=True))
    return out, time.perf_counter() - start


def bench_form(folder: Path, threads: int, new_tokens: int, prefill_len: int, repeats: int,
               quantization: str = "none") -> dict:
    from lmkit import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(device="cpu", num_threads=threads, max_batch_size=4, speculative="off",
                          session_len=max(2048, prefill_len + 16), cache_max_entry_count=prefill_len // 64 + 64,
                          quantization=quantization)
    with pipeline(folder, config) as pipe:
        ids = prompt_ids(pipe.tokenizer, prefill_len)
        short = ids[:16]
        gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        pipe(short, GenerationConfig(max_new_tokens=8, ignore_eos=True))  # warm-up
        decode, prefill = [], []
        for _ in range(repeats):
            stamps = [(time.perf_counter(), r.generate_token_len) for r in pipe.stream_infer(short, gen)
                      if r.token_ids]
            (t0, n0), (t1, n1) = stamps[0], stamps[-1]
            decode.append((n1 - n0) / (t1 - t0))
            start = time.perf_counter()
            pipe(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
            prefill.append(time.perf_counter() - start)
        return {"decode_tok_s": max(decode), "ttft_ms": 1e3 * min(prefill),
                "weight_mib": pipe.engine.linear_weight_bytes / 2**20}


def kl_of(dense: Path, folder: Path, max_tokens: int, threads: int, quantization: str = "none") -> dict:
    """KL of ``folder`` (with ``quantization`` at load) from ``dense``, both in lmkit float32 / dtype auto."""
    if quantization == "none":
        from lmkit.lite.config import KlConfig
        from lmkit.lite.kl import kl_divergence

        r = kl_divergence(dense, folder, KlConfig(max_tokens=max_tokens, dtype="auto", num_threads=threads))
        return {"mean_kl": r.mean_kl, "same_top1": r.same_top1, "ppl": r.ppl_model, "ppl_dense": r.ppl_reference}
    from bench_gguf_kl import Tally, lmkit_logits, windows

    wins = windows(dense, max_tokens, 512)
    tally = Tally()
    for (_, targets), ref, got in zip(wins, lmkit_logits(dense, wins, threads, 512),
                                      lmkit_logits(folder, wins, threads, 512, quantization=quantization)):
        tally.add(ref, got, targets)
    t = tally.row()
    return {"mean_kl": t["mean_kl"], "same_top1": t["same_top1"], "ppl": t["ppl"], "ppl_dense": t["ppl_fp"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (bundled), llama-1.2b (random weights), or a folder")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/lmkit-bench-fp4"))
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)}")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the TTFT figure")
    ap.add_argument("--kl-tokens", type=int, default=2048, help="tokens of Hamlet for the KL measure")
    ap.add_argument("--no-kl", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one round, 16 new tokens, a 64-token prompt, no KL")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if unknown := sorted(set(forms) - set(FORMS)):
        ap.error(f"unknown forms {unknown}; choose from {', '.join(FORMS)}")
    if args.smoke:
        args.rounds, args.repeats, args.new_tokens, args.prefill, args.no_kl = 1, 1, 16, 64, True
    args.work_dir.mkdir(parents=True, exist_ok=True)

    source = source_model(args.model, args.work_dir)
    folders, made = {}, {}
    for form in forms:
        folders[form], made[form] = make_form(form, source, args.work_dir)
        if made[form]:
            print(f"# wrote {form} in {made[form]:.1f} s: {folders[form]}", flush=True)
    runs: dict[str, list[dict]] = {form: [] for form in forms}
    for r in range(args.rounds):
        for form in forms:
            runs[form].append(bench_form(folders[form], args.threads, args.new_tokens, args.prefill, args.repeats,
                                         "int8" if form == "int8" else "none"))
            print(f"# round {r + 1} {form}: {json.dumps(runs[form][-1])}", flush=True)
    kl = {form: kl_of(source, folders[form], args.kl_tokens, args.threads, "int8" if form == "int8" else "none")
          for form in forms if form != "dense"} if not args.no_kl else {}

    print(f"\n{cpu_description()}, {args.threads} threads, {source.name}, {date.today()}; median of {args.rounds} "
          f"round(s), best of {args.repeats} each; decode of {args.new_tokens} tokens, TTFT of {args.prefill}")
    header = ["form", "decode tok/s", "vs dense", f"TTFT {args.prefill} ms", "vs dense", "linear MiB",
              "mean KL", "same top-1", "ppl"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    med = {form: {k: statistics.median(run[k] for run in runs[form]) for k in runs[form][0]} for form in forms}
    base = med.get("dense")
    rows = []
    for form in forms:
        m, k = med[form], kl.get(form)
        row = [form, f"{m['decode_tok_s']:.1f}", f"{m['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-",
               f"{m['ttft_ms']:.0f}", f"{base['ttft_ms'] / m['ttft_ms']:.2f}x" if base else "-",
               f"{m['weight_mib']:.1f}", f"{k['mean_kl']:.4f}" if k else "-",
               f"{100 * k['same_top1']:.1f}%" if k else "-",
               f"{k['ppl']:.2f} (dense {k['ppl_dense']:.2f})" if k else "-"]
        rows.append(row)
        print("| " + " | ".join(row) + " |")
    if args.csv:
        append_csv(args.csv, ["date", "cpu", "model", *header],
                   [[str(date.today()), cpu_description(), source.name, *row] for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
