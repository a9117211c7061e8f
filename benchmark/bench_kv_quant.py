"""What the quantized KV cache costs and buys, measured through the engine itself: perplexity on held-out
text and the number of concurrent sequences a fixed KV byte budget holds, for fp / int8 / int4 KV and a
calibrated per-layer policy (`lmkit lite calibrate`); on AVX512_BF16 CPUs also dtype='bfloat16' (bf16
linear layers and bf16 KV). The greedy column counts the chat prompts whose first 32 greedy tokens equal
the fp32 KV row's.

    python benchmark/bench_kv_quant.py [--model PATH] [--kv-policy kv_policy.json] [--dataset hamlet]
        [--max-tokens 2048] [--seqlen 512] [--budget-mib 64] [--context 1024] [--threads 2]
        [--greedy-prompts 20] [--greedy-tokens 32] [--smoke]

Perplexity: the text's first --max-tokens tokens in windows of --seqlen (as `lmkit lite ppl`: disjoint
windows, every token after a window's first scored once), each window one engine request with
`output_logits` (the logits row of every prompt position). The engine writes each chunk's K/V into the
quantized cache and attention reads it back from there, so this is the engine's own perplexity at that
KV precision, not a simulation.
Capacity: floor(budget / Engine.kv_bytes_per_block) blocks (of the same engine), divided by the blocks
one --context-token sequence needs (block size 64).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402


def eval_ids(model_path: Path, dataset: str, max_tokens: int) -> list[int]:
    """The same token stream as `lmkit lite ppl --dataset DATASET` scores."""
    from transformers import AutoTokenizer

    from lmkit.lite.ppl import evaluation_tokens

    return evaluation_tokens(AutoTokenizer.from_pretrained(str(model_path)), dataset, max_tokens).tolist()


BLOCK_SIZE = 64


def perplexity(pipe, ids: list[int], seqlen: int) -> tuple[float, int, float]:
    """(perplexity, scored tokens, seconds) of ``ids`` through the pipeline ``pipe``."""
    from lmkit import GenerationConfig
    from lmkit.lite.ppl import windows

    gen = GenerationConfig(max_new_tokens=1, output_logits=True, ignore_eos=True)
    nll, count, start = 0.0, 0, time.perf_counter()
    for begin, end, first in windows(len(ids), seqlen, seqlen):
        logits = np.asarray(pipe(ids[begin:end], gen).logits, dtype=np.float64)  # row i predicts i + 1
        rows = logits[first - begin - 1:end - begin - 1]
        top = rows.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        nll += float((lse - rows[np.arange(len(rows)), ids[first:end]]).sum())
        count += len(rows)
    return math.exp(nll / count), count, time.perf_counter() - start


# Short chat requests of several kinds (facts, code, lists, explanations, creative) for the greedy column.
GREEDY_PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "List three primary colors:",
    "Explain what a CPU cache is in one sentence.", "What is the boiling point of water in Celsius?",
    "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.", "Why is the sky blue?", "Name the planets of the solar system.",
    "Summarize the plot of Romeo and Juliet.", "What does HTTP stand for?", "Suggest a name for a pet cat.",
    "How do vaccines work?", "Write a limerick about a programmer.", "What is 17 times 23?",
    "Describe the water cycle.", "Give three tips for a job interview.", "What is the difference between RAM and ROM?",
]


def greedy_outputs(pipe, prompts: list[str], tokens: int) -> list[list[int]]:
    """The first ``tokens`` greedy tokens of each chat prompt through the pipeline ``pipe``."""
    from lmkit import GenerationConfig

    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    return [r.token_ids for r in pipe([[{"role": "user", "content": p}] for p in prompts], gen)]


def kv_pipeline(model_path: Path, kv: dict, threads: int, seqlen: int):
    """One pipeline for a row's perplexity and greedy columns: KV settings ``kv``, blocks of BLOCK_SIZE tokens,
    room for a ``seqlen`` window or the greedy prompts."""
    from lmkit import EngineConfig, pipeline

    config = EngineConfig(device="cpu", num_threads=threads, cache_block_seq_len=BLOCK_SIZE,
                          cache_max_entry_count=max(64, seqlen // BLOCK_SIZE + 2), **kv)
    return pipeline(model_path, config)


def capacity(per_block: int, budget_bytes: int, context: int) -> tuple[int, int]:
    """(blocks in the budget, concurrent sequences of ``context`` tokens) at ``per_block`` bytes a block."""
    blocks = budget_bytes // per_block
    return blocks, blocks // -(-context // BLOCK_SIZE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF or AWQ folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--kv-policy", default=None, help="kv_policy.json of this model: adds the policy row")
    ap.add_argument("--dataset", default="hamlet", help="held-out text, as `lmkit lite ppl --dataset`")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--budget-mib", type=float, default=64.0, help="KV byte budget of the capacity column")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence of the capacity column")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy-prompts", type=int, default=len(GREEDY_PROMPTS),
                    help=f"chat prompts (at most {len(GREEDY_PROMPTS)}) of the greedy column: how many give the same "
                         "first --greedy-tokens greedy tokens as the fp32 KV row")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="64 tokens in windows of 32: runs in seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.seqlen, args.greedy_prompts, args.greedy_tokens = 64, 32, 2, 4

    from lmkit import _engine
    from lmkit.model_path import resolve_model

    model_path = resolve_model(args.model)
    ids = eval_ids(model_path, args.dataset, args.max_tokens)
    rows = [("fp32 KV", {}), ("int8 KV", {"quant_policy": 8}), ("int4 KV", {"quant_policy": 4})]
    if args.kv_policy:
        rows.append((f"policy {Path(args.kv_policy).name}", {"kv_policy": str(args.kv_policy)}))
    if _engine.cpu_bf16_available():  # what dtype='bfloat16' (bf16 linear layers) costs in perplexity
        rows.append(("dtype bfloat16 (bf16 KV)", {"dtype": "bfloat16"}))
    budget = int(args.budget_mib * 2**20)
    print(f"model {model_path.name}; {cpu_description()}, {args.threads} threads; perplexity on "
          f"{len(ids)} tokens of {args.dataset} in windows of {args.seqlen}; capacity: {args.budget_mib:g} MiB "
          f"of KV, {args.context}-token sequences")
    prompts = GREEDY_PROMPTS[:args.greedy_prompts]
    print(f"greedy: of {len(prompts)} chat prompts, how many give fp32 KV's first {args.greedy_tokens} greedy tokens "
          "(free-running: one near-tie flip changes the rest of a sequence)")
    print(f"{'KV cache':28}{'perplexity':>11}{'vs fp':>9}{'tokens':>8}{'greedy':>8}{'bytes/block':>13}{'blocks':>8}"
          f"{'sequences':>11}{'vs fp':>8}{'time s':>8}")
    fp_ppl = fp_seqs = fp_greedy = None
    for name, kv in rows:
        with kv_pipeline(model_path, kv, args.threads, args.seqlen) as pipe:
            ppl, count, seconds = perplexity(pipe, ids, args.seqlen)
            greedy = greedy_outputs(pipe, prompts, args.greedy_tokens)
            per_block = pipe.engine.kv_bytes_per_block
        blocks, seqs = capacity(per_block, budget, args.context)
        fp_ppl = fp_ppl or ppl
        fp_seqs = fp_seqs or seqs
        fp_greedy = fp_greedy or greedy
        same = f"{sum(a == b for a, b in zip(greedy, fp_greedy))}/{len(prompts)}"
        print(f"{name:28}{ppl:11.4f}{ppl / fp_ppl - 1:+9.2%}{count:8d}{same:>8}{per_block:13d}{blocks:8d}{seqs:11d}"
              f"{seqs / max(fp_seqs, 1):7.2f}x{seconds:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
