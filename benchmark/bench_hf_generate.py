"""The HF transformers peer for the throughput tables: `generate` on batches of `concurrency` requests, padded
on the left as HF users batch (greedy, every request generating exactly --output-len tokens), on the CPU or a
GPU. Run it beside `profile_throughput.py --workload fixed` with the same lengths: same requests, same device.

    python benchmark/bench_hf_generate.py --model PATH [--device cuda] [--concurrency 64 256]
        [--num-prompts 512] [--input-len 256] [--output-len 256] [--dtype float16] [--csv FILE] [--smoke]

Output tok/s = generated tokens / wall time over all batches of a level (one warm-up batch first). Prompts are
random token ids (seeded), as in profile_throughput's fixed workload.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import append_csv  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder (fp16/bf16/fp32 weights)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="two tiny batches on the CPU, for tests")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.concurrency, args.num_prompts = "cpu", "float32", [2], 4
        args.input_len, args.output_len = 8, 4
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    rng = np.random.default_rng(args.seed)
    prompts = torch.tensor(rng.integers(100, vocab - 100, (args.num_prompts, args.input_len)), dtype=torch.long)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"

    def run_batch(ids: torch.Tensor) -> int:
        ids = ids.to(args.device)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        return int((out.shape[1] - ids.shape[1]) * ids.shape[0])

    run_batch(prompts[:1])  # warm-up
    rows = []
    for c in args.concurrency:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start, generated = time.perf_counter(), 0
        try:
            for b in range(0, args.num_prompts, c):
                generated += run_batch(prompts[b:b + c])
        except torch.cuda.OutOfMemoryError:  # HF's padded KV cache of a big batch: report it, go on
            print(f"concurrency {c}: out of GPU memory")
            rows.append({"concurrency": c, "requests": args.num_prompts, "output_tok_s": float("nan"),
                         "req_s": float("nan"), "elapsed_s": float("nan")})
            torch.cuda.empty_cache()
            continue
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        rows.append({"concurrency": c, "requests": args.num_prompts, "output_tok_s": generated / elapsed,
                     "req_s": args.num_prompts / elapsed, "elapsed_s": elapsed})
    print(f"HF transformers {getattr(__import__('transformers'), '__version__', '?')} generate, {args.dtype}, "
          f"{device_name}, {Path(args.model).name}, {args.input_len} in / {args.output_len} out, {date.today()}")
    print(f"{'concurrency':>12}{'requests':>10}{'output tok/s':>14}{'req/s':>8}")
    for r in rows:
        print(f"{r['concurrency']:>12}{r['requests']:>10}{r['output_tok_s']:14.1f}{r['req_s']:8.2f}")
    if args.csv:
        append_csv(args.csv, ["date", "engine", "device", "model", "dtype", "input_len", "output_len", "concurrency",
                              "requests", "output_tok_s", "req_s"],
                   [[date.today(), "hf-transformers", device_name, Path(args.model).name, args.dtype, args.input_len,
                     args.output_len, r["concurrency"], r["requests"], f"{r['output_tok_s']:.2f}", f"{r['req_s']:.3f}"]
                    for r in rows])
    return rows


if __name__ == "__main__":
    main()
