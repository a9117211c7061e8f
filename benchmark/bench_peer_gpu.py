"""lmkit against HF transformers in its fastest single-stream form on the same GPU: a static KV cache and the
decode step under torch.compile(mode='reduce-overhead', fullgraph=True), the gpt-fast recipe. Greedy decode of
one request at a time, same model, same prompts, the sides interleaved round by round in one process.

    python benchmark/bench_peer_gpu.py --model FP16_FOLDER [--awq AWQ_FOLDER] [--io 128x128 512x256]
        [--rounds 3] [--csv FILE] [--smoke]

Per round and INPUTxOUTPUT: lmkit on the fp16 folder (device='cuda'), lmkit on the AWQ folder when given, then
HF compiled on the fp16 folder, each on the same seeded random prompt generating exactly OUTPUT tokens. Decode
tok/s: the tokens after the first over the time from the first token to the last (profile_generation's measure;
HF's loop synchronizes the GPU at both ends). The table gives the median over rounds and lmkit / HF. HF compiles
and captures its graphs in a warm-up before the first round (its time is printed); lmkit warms up too (each
engine's first step of a batch size is captured as a CUDA graph). --smoke: the CPU, a tiny folder, HF eager
(no compile), one round of 8x4, for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_generation import parse_io, run_cell  # noqa: E402
from summary import append_csv  # noqa: E402


class CompiledHF:
    """HF transformers' model with a StaticCache: prefill eager, each decode step one compiled call."""

    def __init__(self, folder: Path, device: str, max_len: int, compile_step: bool):
        import torch
        from transformers import AutoModelForCausalLM, StaticCache

        self.torch, self.device = torch, device
        dtype = torch.float16 if device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)

        def step(token, position):
            out = self.model(input_ids=token, cache_position=position, past_key_values=self.cache, use_cache=True)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile_step else step

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens and the decode phase's seconds (first token to last)."""
        torch = self.torch
        self.cache.reset()
        with torch.no_grad():
            ids = torch.tensor([prompt], device=self.device)
            logits = self.model(input_ids=ids, cache_position=torch.arange(len(prompt), device=self.device),
                                past_key_values=self.cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = [token]
            self.sync()
            start = time.perf_counter()
            for i in range(new_tokens - 1):
                position = torch.tensor([len(prompt) + i], device=self.device)
                token = self.step(token, position).clone()  # clone: a replayed graph reuses its output buffer
                tokens.append(token)
            self.sync()
            elapsed = time.perf_counter() - start
        return [int(t) for t in torch.cat(tokens, dim=1)[0].tolist()], elapsed


async def greedy_tokens(engine, prompt: list[int], new_tokens: int) -> list[int]:
    from lmkit import GenerationConfig

    tokens: list[int] = []
    async for r in engine.generate(prompt, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)):
        tokens.extend(r.token_ids)
    return tokens


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="HF folder, fp16/bf16 weights")
    ap.add_argument("--awq", type=Path, default=None, help="the same model as an AWQ folder, for an int4 lmkit row")
    ap.add_argument("--io", type=parse_io, nargs="+", default=[(128, 128), (512, 256)],
                    help="INPUTxOUTPUT token lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, one round of 8x4, HF eager: for tests")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.io, args.rounds = [(8, 4)], 1
    from lmkit import AsyncEngine, EngineConfig

    longest = max(i + o for i, o in args.io)
    config = EngineConfig(device=device, max_batch_size=1, session_len=longest, cache_max_entry_count=64,
                          cache_block_seq_len=64)
    engines = {"lmkit fp16": AsyncEngine(args.model, config)}
    if args.awq:
        engines["lmkit awq"] = AsyncEngine(args.awq, config)
    start = time.perf_counter()
    hf = CompiledHF(args.model, device, max(longest, 64), compile_step=not args.smoke)
    hf_label = "HF eager (static cache)" if args.smoke else "HF compiled (static cache)"
    vocab = min(e.tokenizer.vocab_size for e in engines.values())
    for _ in range(2 if not args.smoke else 1):  # compile + the graph's warm-up and capture runs
        hf.generate(list(range(100, 108)), 6)
    for e in engines.values():
        asyncio.run(run_cell(e, 1, 8, 4, seed=10_000))
    print(f"{hf_label}: loaded, compiled and warmed up in {time.perf_counter() - start:.1f} s")

    times: dict[tuple, list[float]] = {}
    same: dict[tuple, int] = {}
    try:
        for r in range(args.rounds):
            for i, o in args.io:
                prompt = np.random.default_rng(args.seed + r).integers(100, vocab - 100, i).tolist()
                for name, e in engines.items():
                    times.setdefault((name, i, o), []).append(asyncio.run(run_cell(e, 1, i, o, args.seed + r))
                                                              ["decode_tok_s"])
                tokens, elapsed = hf.generate(prompt, o)
                times.setdefault((hf_label, i, o), []).append((o - 1) / elapsed)
                if r == 0:
                    ours = asyncio.run(greedy_tokens(engines["lmkit fp16"], prompt, o))
                    same[(i, o)] = next((k for k, (a, b) in enumerate(zip(ours, tokens)) if a != b), o)
    finally:
        for e in engines.values():
            e.close()
    import torch

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"batch-1 greedy decode, {gpu}, {args.model.name}, median of {args.rounds} interleaved rounds, "
          f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, {date.today()}")
    print(f"{'side':>28}{'in x out':>10}{'decode tok/s':>14}{'vs HF':>8}")
    rows = []
    for i, o in args.io:
        base = statistics.median(times[(hf_label, i, o)])
        for name in [*engines, hf_label]:
            tok_s = statistics.median(times[(name, i, o)])
            rows.append({"side": name, "input": i, "output": o, "decode_tok_s": tok_s, "vs_hf": tok_s / base})
            print(f"{name:>28}{f'{i}x{o}':>10}{tok_s:14.1f}{tok_s / base:7.2f}x")
        print(f"{'':>28}lmkit fp16 and HF agree on the first {same[(i, o)]} of {o} greedy tokens (round 1)")
    if args.csv:
        append_csv(args.csv, ["date", "device", "model", "side", "input_len", "output_len", "decode_tok_s", "vs_hf"],
                   [[date.today(), gpu, args.model.name, r["side"], r["input"], r["output"],
                     f"{r['decode_tok_s']:.2f}", f"{r['vs_hf']:.3f}"] for r in rows])
    return rows


if __name__ == "__main__":
    main()
