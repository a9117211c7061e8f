"""Engine vs HF transformers (fp32, same threads), side by side in one run on one model:
batch-1 greedy decode tokens/s (128 new tokens) and the time of a 512-token prefill.

    python benchmark/bench_decode_prefill.py [--model PATH] [--threads 2] [--csv out.csv]

Default model: the bundled SmolLM2-135M-Instruct. Decode tok/s counts the tokens after the first
(time from the first to the last token); prefill time is the time to the first token of a 512-token
prompt with max_new_tokens=1 (the engine) or one forward (HF), best of --repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import append_csv  # noqa: E402


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_description() -> str:
    """The CPU's name and the kernels the engine picked on it, for the benchmarks' headers."""
    from lmkit import _engine

    amx = ", AMX" if _engine.cpu_amx_available() else ""
    return f"{cpu_name()} ({_engine.cpu_isa()}{amx})"


def prompt_ids(tokenizer, n: int) -> list[int]:
    import pydoc_data.topics as topics

    text = " ".join(topics.topics.values())
    ids = tokenizer.encode(text)[:n]
    assert len(ids) == n, f"need {n} tokens of text"
    return ids


def bench_engine(model_path: Path, threads: int, new_tokens: int, prefill_len: int, repeats: int,
                 dtype: str = "auto") -> dict:
    from lmkit import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(device="cpu", num_threads=threads, max_batch_size=4, dtype=dtype,
                          session_len=max(2048, prefill_len + 16), cache_max_entry_count=prefill_len // 64 + 64)
    with pipeline(model_path, config) as pipe:
        ids = prompt_ids(pipe.tokenizer, prefill_len)
        short = ids[:16]
        gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        pipe(short, GenerationConfig(max_new_tokens=8, ignore_eos=True))  # warm-up
        decode = []
        for _ in range(repeats):
            stamps = []
            for r in pipe.stream_infer(short, gen):
                if r.token_ids:
                    stamps.append((time.perf_counter(), r.generate_token_len))
            (t0, n0), (t1, n1) = stamps[0], stamps[-1]
            decode.append((n1 - n0) / (t1 - t0))
        prefill = []
        for _ in range(repeats):
            start = time.perf_counter()
            pipe(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
            prefill.append(time.perf_counter() - start)
    return {"decode_tok_s": max(decode), "prefill_s": min(prefill)}


def bench_hf(model_path: Path, threads: int, new_tokens: int, prefill_len: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = prompt_ids(tok, prefill_len)
    short = torch.tensor([ids[:16]])
    decode, prefill = [], []
    with torch.inference_mode():
        model.generate(short, max_new_tokens=8, do_sample=False, min_new_tokens=8)  # warm-up
        for _ in range(repeats):
            # Time per generated token after the first, as for the engine: total minus a 1-token run.
            t0 = time.perf_counter()
            model.generate(short, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            model.generate(short, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            t2 = time.perf_counter()
            decode.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
        full = torch.tensor([ids])
        for _ in range(repeats):
            start = time.perf_counter()
            model(full)
            prefill.append(time.perf_counter() - start)
    return {"decode_tok_s": max(decode), "prefill_s": min(prefill)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the engine's compute dtype (bfloat16: bf16 linear layers and KV cache, AMX tiles where "
                         "the CPU has them); HF runs in float32 either way")
    ap.add_argument("--csv", type=Path, default=None, help="append the rows to this CSV file")
    ap.add_argument("--smoke", action="store_true", help="tiny settings that run in seconds (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.new_tokens, args.prefill_len, args.repeats = 8, 32, 1

    from lmkit.model_path import resolve_model

    model_path = resolve_model(args.model)
    engine = bench_engine(model_path, args.threads, args.new_tokens, args.prefill_len, args.repeats, args.dtype)
    hf = bench_hf(model_path, args.threads, args.new_tokens, args.prefill_len, args.repeats)

    print(f"model {model_path.name}, {args.threads} threads, engine dtype {args.dtype}, {cpu_description()}, "
          f"{date.today()}")
    print(f"{'':22}{'lmkit engine':>14}{'HF fp32':>12}{'ratio':>9}")
    print(f"{'decode tok/s (b=1)':22}{engine['decode_tok_s']:14.1f}{hf['decode_tok_s']:12.1f}"
          f"{engine['decode_tok_s'] / hf['decode_tok_s']:8.2f}x")
    print(f"{f'prefill {args.prefill_len} tok (s)':22}{engine['prefill_s']:14.3f}{hf['prefill_s']:12.3f}"
          f"{hf['prefill_s'] / engine['prefill_s']:8.2f}x")
    if args.csv:
        lmkit = "lmkit" if args.dtype == "auto" else f"lmkit-{args.dtype}"
        append_csv(args.csv, ["date", "model", "threads", "cpu", "impl", "decode_tok_s", "prefill_len", "prefill_s"],
                   [[date.today(), model_path.name, args.threads, cpu_name(), name, f"{r['decode_tok_s']:.2f}",
                     args.prefill_len, f"{r['prefill_s']:.4f}"] for name, r in ((lmkit, engine), ("hf-fp32", hf))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
