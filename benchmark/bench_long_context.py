"""Long contexts side by side with llama.cpp on the same GGUF file (issue 66's figures): the TTFT of one prompt of
N tokens, batch-1 decode tok/s after it, and what the sequence takes in memory, at N = 32,768 and 131,048 (with
the new tokens and a margin, the 131,072 of a 128k context).

    python benchmark/bench_long_context.py [--layers 2] [--contexts 32768,131048] [--kv bf16,int8]
        [--threads 2] [--new-tokens 16] [--rounds 1] [--file PATH] [--smoke]

The file: Llama 3.2 1B's shape (hidden 2048, MLP 8192, 32 query and 8 KV heads of 64, tied embeddings, rope theta
500,000 with the llama3 scaling of an 8k pretraining to 128k as llama.cpp writes it, the rope_freqs tensor), the
first --layers of its 16 layers, every matrix Q4_0 (random blocks), SmolLM2's 49,152-token vocabulary; made once
under LMKIT_CACHE/peers/. Random token ids, the same to both engines.

Rows, each (engine, context, KV precision) in a process of its own with --threads threads, the engines alternating:
  lmkit      the file in place (default settings, prefix caching off), max_batch_size 1, session_len N + new
             tokens; KV bf16 (dtype auto's cache: the cache column says what it came out as), int8 or int4
             (quant_policy)
  llama.cpp  llama-cpp-python (see bench_peers.py for its build), n_ctx N + new tokens, n_batch 2048, n_ubatch 512,
             flash attention on (its quantized V cache needs it); KV f16, q8_0 or q4_0 for bf16, int8, int4
Each engine first serves a 512-token prompt (warm-up). Columns: TTFT (the whole prompt in one request, to its
first token), decode tok/s over the --new-tokens after it, KV MiB of the sequence (lmkit: computed, its blocks x
the pool's bytes a block; llama.cpp: measured, llama_state_seq_get_size of the sequence: its K/V cells and their
metadata), and the worker's peak RSS (weights, cache, buffers). A one-layer file makes the per-token Python of
both wrappers a larger share of decode than in the whole model: compare engines, do not extrapolate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from bench_families import finish, report_worker, start_writer  # noqa: E402
from bench_peers import peers_dir  # noqa: E402

RESULT_TAG = "@@bench_long_context_result "
SHAPE = dict(name="llama3.2-1b", hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, layers=16,
             theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192, context=131072)
SMOKE_SHAPE = dict(SHAPE, name="tiny-llama3", hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, layers=2,
                   original=64, context=4096)
KV_TYPES = {"bf16": (0, "F16"), "int8": (8, "Q8_0"), "int4": (4, "Q4_0")}  # lmkit quant_policy, llama.cpp type
WARM_UP = list(range(100, 612))  # a 512-token prompt through each engine before the timed one
WORKER_TIMEOUT_S = 4 * 3600


def llama3_factors(shape: dict) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py computes it for a llama3-scaled config."""
    d = shape["head_dim"]
    freqs = 1.0 / shape["theta"] ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < shape["original"] / shape["high"]:
            out.append(1.0)
        elif wavelen > shape["original"] / shape["low"]:
            out.append(shape["factor"])
        else:
            smooth = (shape["original"] / wavelen - shape["low"]) / (shape["high"] - shape["low"])
            out.append(1 / ((1 - smooth) / shape["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def write_llama(path: Path, shape: dict, layers: int, seed: int = 0) -> None:
    """A random Llama-3.2-shaped file (see the module docstring)."""
    import gguf

    rng = np.random.default_rng(seed)
    arch, H, inter, hd = "llama", shape["hidden"], shape["inter"], shape["head_dim"]
    heads, kvh = shape["heads"], shape["kv_heads"]
    writer, V = start_writer(path, arch)
    for key, value in (("context_length", shape["context"]), ("embedding_length", H), ("block_count", layers),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kvh), ("rope.dimension_count", hd), ("vocab_size", V)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", shape["theta"])
    q40 = gguf.GGMLQuantizationType.Q4_0

    def q4_0(rows: int, k: int) -> np.ndarray:  # [rows, k / 32 blocks of 18 bytes]: fp16 d, then 16 nibble bytes
        blocks = rng.integers(0, 256, size=(rows, k // 32, 18), dtype=np.uint8)
        d = rng.uniform(0.001, 0.004, size=(rows, k // 32)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
        blocks[..., :2] = d
        return blocks.reshape(rows, k // 32 * 18)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)

    writer.add_tensor("rope_freqs.weight", llama3_factors(shape))
    writer.add_tensor("token_embd.weight", q4_0(V, H), raw_dtype=q40)
    writer.add_tensor("output_norm.weight", norm(H))
    for i in range(layers):
        b = f"blk.{i}"
        for name, rows, k in (("attn_q", heads * hd, H), ("attn_k", kvh * hd, H), ("attn_v", kvh * hd, H),
                              ("attn_output", H, heads * hd), ("ffn_gate", inter, H), ("ffn_up", inter, H),
                              ("ffn_down", H, inter)):
            writer.add_tensor(f"{b}.{name}.weight", q4_0(rows, k), raw_dtype=q40)
        writer.add_tensor(f"{b}.attn_norm.weight", norm(H))
        writer.add_tensor(f"{b}.ffn_norm.weight", norm(H))
    finish(writer)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_lmkit(path: Path, prompt: list[int], new_tokens: int, kv: str, threads: int) -> dict:
    from lmkit import EngineConfig, GenerationConfig, pipeline

    config = EngineConfig(device="cpu", num_threads=threads, max_batch_size=1, enable_prefix_caching=False,
                          session_len=len(prompt) + new_tokens + 8, quant_policy=KV_TYPES[kv][0], speculative="off")
    with pipeline(path, config) as pipe:
        pipe(WARM_UP, GenerationConfig(max_new_tokens=4, ignore_eos=True))
        start, stamps = time.perf_counter(), []
        for r in pipe.stream_infer(prompt, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)):
            if r.finish_reason == "error":
                raise RuntimeError(r.error)
            stamps.extend([time.perf_counter()] * len(r.token_ids))
        block = pipe.engine.config.cache_block_seq_len
        kv_mib = math.ceil((len(prompt) + new_tokens) / block) * pipe.engine.kv_bytes_per_block / 2**20
        spec = pipe.engine.spec
        per_value = pipe.engine.kv_bytes_per_block / (block * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2)
    cache = {2.0: "bf16", 4.0: "fp32"}.get(per_value, kv) if kv == "bf16" else kv  # dtype auto's, as it came out
    return {"ttft_s": stamps[0] - start, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "kv_mib": kv_mib, "rss_mib": peak_rss_mib(), "cache": cache}


def run_llama_cpp(path: Path, prompt: list[int], new_tokens: int, kv: str, threads: int) -> dict:
    import llama_cpp

    kind = getattr(llama_cpp, f"GGML_TYPE_{KV_TYPES[kv][1]}")
    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + new_tokens + 8, n_batch=2048, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, flash_attn=True, type_k=kind, type_v=kind,
                          verbose=False)
    llm.generate(WARM_UP, top_k=1, temp=0.0).__next__()
    llm.reset()
    start, stamps = time.perf_counter(), []
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if len(stamps) == new_tokens:
            break
    kv_mib = llama_cpp.llama_state_seq_get_size(llm.ctx, 0) / 2**20
    llm.close()
    return {"ttft_s": stamps[0] - start, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "kv_mib": kv_mib, "rss_mib": peak_rss_mib(), "cache": KV_TYPES[kv][1].lower()}


def run_worker(row: str, path: Path, context: int, kv: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", row, "--file", str(path), "--contexts",
                               str(context), "--kv", kv, "--new-tokens", str(args.new_tokens), "--threads",
                               str(args.threads)], stdout=subprocess.PIPE, text=True, env=env,
                              timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the worker ran past {WORKER_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": f"the worker exited with {proc.returncode}, no result"}


def worker_main(args) -> int:
    context = int(args.contexts)
    prompt = np.random.default_rng(context).integers(100, 40000, size=context).tolist()
    run = run_lmkit if args.worker == "lmkit" else run_llama_cpp
    return report_worker(RESULT_TAG, lambda: run(args.file, prompt, args.new_tokens, args.kv, args.threads))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="the first N of the shape's 16 layers")
    ap.add_argument("--contexts", default="32768,131048", metavar="N,N")
    ap.add_argument("--kv", default="bf16,int8", help="KV precisions, of bf16, int8, int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="every row this many times, interleaved (median)")
    ap.add_argument("--file", type=Path, default=None, help="the GGUF file (made there when missing)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape at 1,024 tokens, lmkit only: seconds")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.contexts, args.new_tokens, args.layers = "1024", 4, 2
    if not 1 <= args.layers <= shape["layers"]:
        ap.error(f"--layers must be in [1, {shape['layers']}]")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode tok/s is timed between tokens)")
    kvs = args.kv.split(",")
    if any(kv not in KV_TYPES for kv in kvs):
        ap.error(f"--kv takes {', '.join(KV_TYPES)}")
    path = args.file or peers_dir() / f"{shape['name']}-{args.layers}l-q4_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_llama(partial, shape, args.layers)
        partial.replace(path)
    import importlib.util

    rows = ["lmkit"] + (["llama.cpp"] if not args.smoke and importlib.util.find_spec("llama_cpp") else [])
    if not args.smoke and len(rows) == 1:
        print("llama.cpp row skipped: llama-cpp-python is not installed (see bench_peers.py)")
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[tuple, list[dict]] = {}
    for k in range(args.rounds):
        for context in contexts:
            for kv in kvs:
                for row in rows if k % 2 == 0 else rows[::-1]:
                    r = run_worker(row, path, context, kv, args)
                    results.setdefault((row, context, kv), []).append(r)
                    print(f"round {k + 1} {row} {context} {kv}: {r}", flush=True)
    print(f"\n{shape['name']} shape, {args.layers} of {shape['layers']} layers, Q4_0, {path.stat().st_size / 2**20:.0f} "
          f"MiB; {cpu_description()}; {args.threads} threads; {args.new_tokens} new tokens; medians of {args.rounds} "
          "round(s)")
    print("| context | KV | row | cache | TTFT s | decode tok/s | KV MiB | peak RSS MiB |\n"
          "|---:|---|---|---|---:|---:|---:|---:|")
    failed = False
    for (row, context, kv), runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            failed = True
            print(f"| {context} | {kv} | {row} | | error: {errors[0]} | | | |")
            continue
        m = {key: statistics.median(r[key] for r in runs) for key in ("ttft_s", "decode_tok_s", "kv_mib", "rss_mib")}
        print(f"| {context} | {kv} | {row} | {runs[0]['cache']} | {m['ttft_s']:.2f} | {m['decode_tok_s']:.1f} | "
              f"{m['kv_mib']:.1f} | {m['rss_mib']:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
