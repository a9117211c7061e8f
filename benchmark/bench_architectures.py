"""The new architectures at their real shapes, random weights: HF transformers fp32 and the lmkit engine side
by side in one run. Batch-1 greedy decode tokens/s and the output tokens/s of 16 concurrent requests.

    python benchmark/bench_architectures.py [--arch qwen3|gemma3|all] [--layers N] [--new-tokens 64]
        [--threads 2] [--dtype float32|bfloat16|both] [--runs 3] [--concurrency 16] [--smoke]

Shapes (the models' hub config.json, written in that layout; weights random, fp32 safetensors):
  qwen3   Qwen3-0.6B: hidden 1024, 28 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 3072,
          vocab 151936, tied embeddings, q/k norms, rope_theta 1e6
  gemma3  Gemma-3-1B: hidden 1152, 26 layers, 4 heads / 1 KV head, head_dim 256, intermediate 6912,
          vocab 262144, tied, sliding window 512 on 5 of every 6 layers, query_pre_attn_scalar 256,
          rope_theta 1e6 (global) / 10000 (local)
  llama   (not in "all") a Llama of Qwen3-0.6B's shape without the q/k norms: runs on the engine before
          issue 22, so it checks this harness, and is the baseline of what Qwen3's q/k norms cost.
Models are written once into LMKIT_CACHE/bench-architectures/ (default ~/.cache/lmkit/), keyed by shape,
layers and vocabulary; --layers N keeps the first N layers (a smaller model of the same width).

Method (as bench_peers.py): every engine runs in its own subprocess, one after another, with --threads
threads (torch.set_num_threads / num_threads, and OMP_NUM_THREADS). The same token ids go to every engine:
a --prompt-len-token prompt, --new-tokens greedy tokens with eos ignored. Decode tok/s = (tokens - 1) /
(time of the last token - time of the first), one warm-up run, then the median of --runs runs. Concurrent:
--concurrency distinct prompts of the same length submitted at once, output tokens / wall time (prefill
included), one run after the warm-ups (lmkit: continuous batching; HF: one static batch). `match` counts
the leading greedy tokens equal to HF's (random weights: near-ties are common, so a short match is not by
itself an error). --smoke: 2 layers, a 4096-token vocabulary, 8 tokens, 1 run, concurrency 4 (seconds;
`--smoke --arch llama` runs on today's engine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from bench_peers import (  # noqa: E402
    fmt,
    hf_greedy_figures,
    lmkit_greedy_figures,
    ratio,
    versions,
)
from make_dummy_model import write_tokenizer  # noqa: E402

RESULT_TAG = "@@bench_architectures_result "

# The hub config.json of each model (transformers 4.5x layout), which lmkit reads as it comes.
QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024,
    initializer_range=0.02, intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28,
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, torch_dtype="float32", use_cache=True,
    use_sliding_window=False, vocab_size=151936)
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False, attention_dropout=0.0,
    attn_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106], final_logit_softcapping=None, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_size=1152, initializer_range=0.02, intermediate_size=6912,
    max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
    pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None,
    rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, torch_dtype="float32", use_cache=True,
    vocab_size=262144)
LLAMA_QWEN3_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", bos_token_id=151643, eos_token_id=151645, head_dim=128,
    hidden_act="silu", hidden_size=1024, intermediate_size=3072, max_position_embeddings=40960,
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, torch_dtype="float32", vocab_size=151936)
SHAPES = {"qwen3": ("Qwen3-0.6B", QWEN3_0_6B), "gemma3": ("Gemma-3-1B", GEMMA3_1B),
          "llama": ("Llama, Qwen3-0.6B shape", LLAMA_QWEN3_SHAPE)}
ALL = ("qwen3", "gemma3")
SMOKE_VOCAB = 4096


def models_dir() -> Path:
    from lmkit import env

    return env.cache_dir() / "bench-architectures"


def make_model(arch: str, layers: int | None, vocab: int | None) -> Path:
    """The folder of ``arch``'s shape (first ``layers`` layers, ``vocab`` tokens when given), written once:
    config.json as on the hub, fp32 weights N(0, 0.02) (norm weights 1; Gemma's 0, it scales by 1 + w) in one
    shard per layer, a word-level tokenizer with one token per id."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[arch][1])
    cfg["num_hidden_layers"] = layers or cfg["num_hidden_layers"]
    cfg["vocab_size"] = vocab or cfg["vocab_size"]
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8]  # a changed shape: a new folder
    out = models_dir() / f"{arch}-L{cfg['num_hidden_layers']}-V{cfg['vocab_size']}-{key}"
    if (out / "complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = [cfg["bos_token_id"]] + ([cfg["eos_token_id"]] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"])
    if max(ids) >= cfg["vocab_size"]:  # a shrunk vocabulary: special ids inside it
        cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    with torch.device("meta"):  # names and shapes only
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)))
    shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}  # tied lm_head: not listed
    norm_value = 0.0 if cfg["model_type"].startswith("gemma") else 1.0
    gen = torch.Generator().manual_seed(0)
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "other"
        shards.setdefault(f"model-{layer}.safetensors", []).append(name)
    index = {}
    for shard, names in shards.items():  # one shard in memory at a time
        tensors = {n: (torch.full(shapes[n], norm_value) if "norm" in n
                       else torch.randn(shapes[n], generator=gen) * 0.02) for n in names}
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index |= {n: shard for n in names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    write_tokenizer(out, cfg["vocab_size"], cfg["bos_token_id"], eos)
    (out / "complete").write_text("")
    return out


@dataclass(frozen=True)
class Workload:
    prompt_ids: list[int]
    batch_ids: list[list[int]]  # one prompt per concurrent request; empty: not measured
    new_tokens: int
    runs: int
    threads: int


def make_workload(args, vocab: int) -> Workload:
    import numpy as np

    rng = np.random.default_rng(0)
    draw = lambda: rng.integers(3, min(vocab, 30000), size=args.prompt_len).tolist()  # noqa: E731
    return Workload(prompt_ids=draw(), batch_ids=[draw() for _ in range(args.concurrency)] if args.concurrency > 1
                    else [], new_tokens=args.new_tokens, runs=args.runs, threads=args.threads)


# ---------------------------------------------------------------- engines (each runs in a worker process)

def run_hf(model: Path, w: Workload) -> dict:
    return hf_greedy_figures(model, w.prompt_ids, w.new_tokens, w.runs, w.threads, w.batch_ids)


def run_lmkit(model: Path, w: Workload, dtype: str) -> dict:
    from lmkit import EngineConfig, pipeline

    seq_tokens = len(w.prompt_ids) + w.new_tokens
    block = 64
    config = EngineConfig(device="cpu", dtype=dtype, num_threads=w.threads, max_batch_size=max(1, len(w.batch_ids)),
                          session_len=seq_tokens + block, cache_block_seq_len=block,
                          cache_max_entry_count=(max(1, len(w.batch_ids)) + 1) * (seq_tokens // block + 2))
    with pipeline(model, config) as pipe:
        return lmkit_greedy_figures(pipe, w.prompt_ids, w.new_tokens, w.runs, w.batch_ids)


ENGINES = {"HF fp32": lambda m, w: run_hf(m, w), "lmkit fp32": lambda m, w: run_lmkit(m, w, "float32"),
           "lmkit bf16": lambda m, w: run_lmkit(m, w, "bfloat16")}


@dataclass
class Row:
    arch: str
    layers: int
    engine: str
    decode_tok_s: float | None = None
    conc_tok_s: float | None = None
    tokens: list[int] | None = None
    match_tokens: int | None = None
    error: str | None = None


def run_worker(engine: str, model: Path, workload_file: Path, threads: int) -> dict:
    """One engine in a fresh process; a crash or an error becomes the row's error."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--worker", engine, "--model-dir", str(model), "--workload-file",
           str(workload_file)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    signal = f" (signal {-proc.returncode})" if proc.returncode < 0 else ""
    return {"error": f"the worker exited with {proc.returncode}{signal}, no result"}


def worker_main(args) -> int:
    workload = Workload(**json.loads(Path(args.workload_file).read_text()))
    try:
        result = ENGINES[args.worker](Path(args.model_dir), workload)
    except Exception as error:  # reported as the row's error; the other rows go on
        result = {"error": f"{type(error).__name__}: {error}"}
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def print_table(rows: list[Row], args, header: str) -> None:
    c = args.concurrency
    print(header)
    print()
    print(f"| model | layers | engine | decode tok/s (batch 1) | vs HF | {c} streams tok/s | vs HF {c} | vs own batch 1 "
          f"| match |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = SHAPES[r.arch][0]
        if r.error:
            print(f"| {name} | {r.layers} | {r.engine} | error: {r.error.splitlines()[0]} | | | | | |")
            continue
        hf = next((h for h in rows if h.arch == r.arch and h.engine == "HF fp32" and not h.error), None)
        match = "-" if r.match_tokens is None else f"{r.match_tokens}/{args.new_tokens}"
        print(f"| {name} | {r.layers} | {r.engine} | {fmt(r.decode_tok_s, '.1f')} "
              f"| {ratio(r.decode_tok_s, hf and hf.decode_tok_s)} | {fmt(r.conc_tok_s, '.1f')} "
              f"| {ratio(r.conc_tok_s, hf and hf.conc_tok_s)} | {ratio(r.conc_tok_s, r.decode_tok_s)} | {match} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="all", choices=["all", *SHAPES], help="which shape (all: qwen3 and gemma3)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all of the shape's)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent requests of the throughput column (1: off)")
    ap.add_argument("--runs", type=int, default=3, help="timed batch-1 runs after the warm-up (median)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "both"],
                    help="compute dtype of the lmkit rows (bfloat16: CPUs with AVX512_BF16)")
    ap.add_argument("--smoke", action="store_true", help="2 layers, small vocabulary, 8 tokens: runs in seconds")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    vocab = None
    if args.smoke:
        args.layers, vocab = args.layers or 2, SMOKE_VOCAB
        args.new_tokens, args.runs, args.concurrency, args.prompt_len = 8, 1, 4, 16

    from lmkit import _engine

    engines = ["HF fp32"] + [f"lmkit {d}" for d, name in (("fp32", "float32"), ("bf16", "bfloat16"))
                             if args.dtype in (name, "both")]
    if "lmkit bf16" in engines and not _engine.cpu_bf16_available():
        print("bench_architectures: skipping lmkit bf16: this CPU has no AVX512_BF16", file=sys.stderr)
        engines.remove("lmkit bf16")
    when, load_start = datetime.now(), os.getloadavg()
    rows: list[Row] = []
    for arch in (ALL if args.arch == "all" else (args.arch,)):
        print(f"bench_architectures: writing/finding the {SHAPES[arch][0]} model ...", file=sys.stderr, flush=True)
        model = make_model(arch, args.layers, vocab)
        cfg = json.loads((model / "config.json").read_text())
        workload = make_workload(args, cfg["vocab_size"])
        with tempfile.TemporaryDirectory() as tmp:
            workload_file = Path(tmp) / "workload.json"
            workload_file.write_text(json.dumps(asdict(workload)))
            for engine in engines:
                print(f"bench_architectures: {arch}: running {engine} ...", file=sys.stderr, flush=True)
                result = run_worker(engine, model, workload_file, args.threads)
                if "error" in result:
                    print(f"bench_architectures: {arch}: {engine} failed: {result['error']}", file=sys.stderr)
                rows.append(Row(arch, cfg["num_hidden_layers"], engine, **result))
    for r in rows:
        hf = next((h for h in rows if h.arch == r.arch and h.engine == "HF fp32" and h.tokens), None)
        if hf is not None and r.tokens and r is not hf:
            r.match_tokens = next((i for i, (a, b) in enumerate(zip(hf.tokens, r.tokens)) if a != b),
                                  min(len(hf.tokens), len(r.tokens)))
    load_end = os.getloadavg()
    header = (f"## bench_architectures: {cpu_description()}, {args.threads} threads, {when:%Y-%m-%d %H:%M}\n\n"
              f"random fp32 weights; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy, eos ignored), "
              f"batch 1: median of {args.runs} runs after a warm-up; {args.concurrency} streams: one run "
              f"(lmkit continuous batching, HF one static batch), prefill included; load average "
              f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end; {versions()}")
    print_table(rows, args, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
