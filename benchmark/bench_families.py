"""The 2026 families side by side with llama.cpp on the same GGUF file (issue 62's figures): batch-1 greedy decode
tokens/s, TTFT of a long prompt, and output tokens/s of concurrent streams.

    python benchmark/bench_families.py [--family gpt-oss|qwen35] [--layers N] [--threads 2] [--rounds 2] [--runs 3]
        [--new-tokens 64] [--prefill-len 2048] [--concurrency 16] [--file PATH] [--smoke]

The files, random weights, SmolLM2's 49,152-token vocabulary, written by the gguf package as llama.cpp's
convert_hf_to_gguf.py lays the family out, made once under LMKIT_CACHE/peers/ (or --file):
  gpt-oss  gpt-oss-20b's shape (hidden 2880, 32 experts of 2880 of which 4 per token, 64 query and 8 KV heads of 64,
           alternating 128-token windows, yarn) with the first --layers (default 4) of its 24 layers (both hold the
           MXFP4 experts at the file's 4.25 bits a weight): experts in MXFP4 (random codes, scales around
           2^-6), attention, router and embeddings F16, norms, biases and sinks F32.
  qwen35   the Qwen3.5 hybrid of transformers' Qwen3_5TextConfig defaults (hidden 4096, MLP 12288, 3 Gated DeltaNet
           layers to 1 gated attention layer; 16 / 4 heads of 256, a quarter rotary; 16 key and 32 value heads of 128
           in the linear layers) with the first --layers (default 8) of its 32: every matrix Q4_0 (random blocks),
           the norms (stored as 1 + w), A (as -exp(A_log)), dt bias and convolution F32.

--contexts 1024,32768 (qwen35) measures instead lmkit's batch-1 decode after prompts of those lengths, on the
hybrid and on an all-attention file of the same dimensions (every layer gated attention), for the issue's "flat in
the context" figure: decode tok/s over 32 new tokens after one prefill of each length.

Rows: lmkit serving the file in place (default settings: dtype auto, int8 activations), and llama.cpp through
llama-cpp-python (bench_peers.py's run_llama_cpp and its batched C-API column), each in its own process with
--threads threads, rounds interleaved, medians over the rounds. The same random token ids go to both. A missing
llama-cpp-python skips its row (install: bench_peers.py's docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from bench_peers import Workload, peers_dir, run_lmkit, run_llama_cpp  # noqa: E402

RESULT_TAG = "@@bench_families_result "
SHAPES = {  # family -> (shape, smoke shape)
    "gpt-oss": (dict(name="gpt-oss-20b", hidden=2880, inter=2880, experts=32, top_k=4, heads=64, kv_heads=8,
                     head_dim=64, window=128, layers=24, default_layers=4),
                dict(name="tiny", hidden=64, inter=64, experts=4, top_k=2, heads=4, kv_heads=2, head_dim=16, window=16,
                     layers=2, default_layers=2)),
    "qwen35": (dict(name="qwen3.5-9b", hidden=4096, inter=12288, heads=16, kv_heads=4, head_dim=256, k_heads=16,
                    v_heads=32, k_dim=128, interval=4, layers=32, default_layers=8),
               dict(name="tiny", hidden=64, inter=96, heads=4, kv_heads=2, head_dim=32, k_heads=2, v_heads=4, k_dim=16,
                    interval=4, layers=4, default_layers=4)),
}
WEIGHTS = {"gpt-oss": "MXFP4", "qwen35": "Q4_0"}


def rows_of(family: str) -> tuple[str, str]:
    return f"lmkit GGUF {WEIGHTS[family]}", f"llama.cpp {WEIGHTS[family]}"


def start_writer(path: Path, arch: str):
    """A GGUF writer with SmolLM2's tokenizer; returns (writer, vocabulary size)."""
    import gguf

    from lmkit.model_path import default_gguf_path

    source = gguf.GGUFReader(str(default_gguf_path())).fields
    tokens = source["tokenizer.ggml.tokens"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(source["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(source["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(source["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer, len(tokens)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gpt_oss(path: Path, shape: dict, layers: int, seed: int = 0) -> None:
    """A random gpt-oss-shaped file (see the module docstring)."""
    import gguf

    rng = np.random.default_rng(seed)
    arch, H, inter, E = "gpt-oss", shape["hidden"], shape["inter"], shape["experts"]
    heads, kvh, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
    writer, V = start_writer(path, arch)
    for key, value in (("context_length", 131072), ("embedding_length", H), ("block_count", layers),
                       ("feed_forward_length", inter), ("expert_feed_forward_length", inter),
                       ("attention.head_count", heads), ("attention.head_count_kv", kvh),
                       ("attention.key_length", hd), ("attention.value_length", hd), ("expert_count", E),
                       ("expert_used_count", shape["top_k"]), ("attention.sliding_window", shape["window"]),
                       ("rope.scaling.original_context_length", 4096)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 150000.0)
    writer.add_float32(f"{arch}.rope.scaling.factor", 32.0)
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")

    def f16(*dims, std=0.02):
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float16)

    def f32(*dims, mean=0.0, std=0.02):
        return (mean + rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float32)

    def mxfp4(rows: int, k: int) -> np.ndarray:  # [E, rows, k / 32 blocks of 17 bytes]: e8m0, then 16 code bytes
        blocks = rng.integers(0, 256, size=(E, rows, k // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(119, 124, size=(E, rows, k // 32), dtype=np.uint8)  # 2^-8 .. 2^-4
        return blocks.reshape(E, rows, k // 32 * 17)

    writer.add_tensor("token_embd.weight", f16(V, H))
    writer.add_tensor("output.weight", f16(V, H))
    writer.add_tensor("output_norm.weight", f32(H, mean=1.0))
    mx = gguf.GGMLQuantizationType.MXFP4
    for i in range(layers):
        b = f"blk.{i}"
        for name, value in (("attn_norm.weight", f32(H, mean=1.0)), ("post_attention_norm.weight", f32(H, mean=1.0)),
                            ("attn_q.weight", f16(heads * hd, H)), ("attn_q.bias", f32(heads * hd)),
                            ("attn_k.weight", f16(kvh * hd, H)), ("attn_k.bias", f32(kvh * hd)),
                            ("attn_v.weight", f16(kvh * hd, H)), ("attn_v.bias", f32(kvh * hd)),
                            ("attn_output.weight", f16(H, heads * hd)), ("attn_output.bias", f32(H)),
                            ("attn_sinks.weight", f32(heads, std=1.0)), ("ffn_gate_inp.weight", f16(E, H)),
                            ("ffn_gate_inp.bias", f32(E)), ("ffn_gate_exps.bias", f32(E, inter)),
                            ("ffn_up_exps.bias", f32(E, inter)), ("ffn_down_exps.bias", f32(E, H))):
            writer.add_tensor(f"{b}.{name}", value)
        writer.add_tensor(f"{b}.ffn_gate_exps.weight", mxfp4(inter, H), raw_dtype=mx)
        writer.add_tensor(f"{b}.ffn_up_exps.weight", mxfp4(inter, H), raw_dtype=mx)
        writer.add_tensor(f"{b}.ffn_down_exps.weight", mxfp4(H, inter), raw_dtype=mx)
    finish(writer)


def write_qwen35(path: Path, shape: dict, layers: int, seed: int = 0) -> None:
    """A random Qwen3.5-shaped hybrid file (see the module docstring). llama.cpp takes the linear layers' value head
    size from their key head size: the shape keeps them equal, as Qwen3.5's are."""
    import gguf

    rng = np.random.default_rng(seed)
    arch, H, inter, hd = "qwen35", shape["hidden"], shape["inter"], shape["head_dim"]
    heads, kvh, hk, hv, dk = shape["heads"], shape["kv_heads"], shape["k_heads"], shape["v_heads"], shape["k_dim"]
    rotary, C = hd // 4, 2 * hk * dk + hv * dk  # a quarter rotary; the convolution's q | k | v channels
    writer, V = start_writer(path, arch)
    for key, value in (("feed_forward_length", inter), ("context_length", 262144), ("embedding_length", H),
                       ("block_count", layers), ("attention.head_count", heads), ("attention.head_count_kv", kvh),
                       ("attention.key_length", hd), ("attention.value_length", hd),
                       ("full_attention_interval", shape["interval"]), ("ssm.conv_kernel", 4), ("ssm.state_size", dk),
                       ("ssm.group_count", hk), ("ssm.time_step_rank", hv), ("ssm.inner_size", hv * dk),
                       ("rope.dimension_count", rotary), ("nextn_predict_layers", 0)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e7)
    writer.add_array(f"{arch}.rope.dimension_sections", [rotary // 4, rotary // 8, rotary // 8, 0])
    q40 = gguf.GGMLQuantizationType.Q4_0

    def q4_0(rows: int, k: int) -> np.ndarray:  # [rows, k / 32 blocks of 18 bytes]: fp16 d, then 16 nibble bytes
        blocks = rng.integers(0, 256, size=(rows, k // 32, 18), dtype=np.uint8)
        d = (rng.uniform(0.001, 0.004, size=(rows, k // 32)).astype(np.float16)).view(np.uint8).reshape(rows, -1, 2)
        blocks[..., :2] = d
        return blocks.reshape(rows, k // 32 * 18)

    def f32(*dims, mean=0.0, std=0.02):
        return (mean + rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float32)

    writer.add_tensor("token_embd.weight", q4_0(V, H), raw_dtype=q40)
    writer.add_tensor("output.weight", q4_0(V, H), raw_dtype=q40)
    writer.add_tensor("output_norm.weight", f32(H, mean=1.0))
    for i in range(layers):
        b = f"blk.{i}"
        full = (i + 1) % shape["interval"] == 0
        matrices = ((("attn_q", 2 * heads * hd, H), ("attn_k", kvh * hd, H), ("attn_v", kvh * hd, H),
                     ("attn_output", H, heads * hd)) if full else
                    (("attn_qkv", C, H), ("attn_gate", hv * dk, H), ("ssm_beta", hv, H), ("ssm_alpha", hv, H),
                     ("ssm_out", H, hv * dk)))
        for name, rows, k in (*matrices, ("ffn_gate", inter, H), ("ffn_up", inter, H), ("ffn_down", H, inter)):
            writer.add_tensor(f"{b}.{name}.weight", q4_0(rows, k), raw_dtype=q40)
        vectors = ((("attn_q_norm.weight", f32(hd, mean=1.0)), ("attn_k_norm.weight", f32(hd, mean=1.0))) if full else
                   (("ssm_dt.bias", f32(hv)), ("ssm_a", -rng.uniform(0.5, 2.0, size=hv).astype(np.float32)),
                    ("ssm_conv1d.weight", f32(C, 4, std=0.2)), ("ssm_norm.weight", f32(dk, mean=1.0))))
        for name, value in (*vectors, ("attn_norm.weight", f32(H, mean=1.0)),
                            ("post_attention_norm.weight", f32(H, mean=1.0))):
            writer.add_tensor(f"{b}.{name}", value)
    finish(writer)


WRITERS = {"gpt-oss": write_gpt_oss, "qwen35": write_qwen35}


def workload(args, vocab: int) -> Workload:
    rng = np.random.default_rng(1)
    ids = lambda n: rng.integers(100, vocab, size=n).tolist()  # noqa: E731  (no special tokens)
    return Workload(prompt_ids=ids(args.prompt_len), long_ids=ids(args.prefill_len),
                    batch_ids=[ids(args.prompt_len) for _ in range(args.concurrency)] if args.concurrency > 1 else [],
                    new_tokens=args.new_tokens, runs=args.runs, threads=args.threads, tokens=[])


def run_worker(row: str, path: Path, w: Workload, threads: int, *extra: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(asdict(w), f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, __file__, "--worker", row, "--file", str(path), "--workload-file", f.name,
                           *extra], stdout=subprocess.PIPE, text=True, env=env)
    os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": f"the worker exited with {proc.returncode}, no result"}


def run_contexts(path: Path, contexts: list[int], threads: int, quant_policy: int = 0, rounds: int = 1) -> dict:
    """lmkit's batch-1 decode tok/s (32 greedy tokens, prefill excluded) after a random prompt of each length, its KV
    cache in the precision of ``quant_policy`` (0: the dtype's, 8 / 4: int8 / int4): the median of ``rounds`` rounds
    over the lengths in turn, each round the same prompts (after the first, prefix-cache hits: only the decode is
    measured again, so that a VM's drifting memory bandwidth falls on every length alike)."""
    from bench_peers import lmkit_greedy_figures

    from lmkit import EngineConfig, GenerationConfig, pipeline

    rng = np.random.default_rng(2)
    config = EngineConfig(device="cpu", num_threads=threads, max_batch_size=1, session_len=max(contexts) + 128,
                          quant_policy=quant_policy, enable_prefix_caching=rounds > 1)
    prompts = {n: rng.integers(100, 40000, size=n).tolist() for n in contexts}
    speeds: dict[int, list[float]] = {n: [] for n in contexts}
    with pipeline(path, config) as pipe:
        lmkit_greedy_figures(pipe, rng.integers(100, 40000, size=32).tolist(), 8, 1)  # warm-up
        for _ in range(rounds):
            for n in contexts:
                stamps = []
                for r in pipe.stream_infer(prompts[n], GenerationConfig(max_new_tokens=32, ignore_eos=True)):
                    if r.finish_reason == "error":
                        raise RuntimeError(f"a prompt of {n} tokens: {r.error}")
                    stamps.extend([time.perf_counter()] * len(r.token_ids))
                speeds[n].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    # each round's last / first as well: the lengths of one round run seconds apart, in one of this VM's speed
    # modes, where the medians of rounds can mix modes
    ratios = [speeds[contexts[-1]][i] / speeds[contexts[0]][i] for i in range(rounds)]
    return {**{str(n): statistics.median(v) for n, v in speeds.items()}, "ratios": ratios}


def report_worker(tag: str, run) -> int:
    """A worker process's one result line: ``tag`` and run()'s dict as JSON, or the error it raised (the row's
    error: the other rows go on)."""
    try:
        result = run()
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    print(tag + json.dumps(result), flush=True)
    return 0


def worker_main(args) -> int:
    w = Workload(**json.loads(Path(args.workload_file).read_text()))

    def run() -> dict:
        if args.worker == "contexts":
            return run_contexts(args.file, [int(c) for c in args.contexts.split(",")], w.threads, args.quant_policy,
                                args.rounds)
        result = run_lmkit(args.file, w) if args.worker.startswith("lmkit") else run_llama_cpp(args.file, w)
        result.pop("tokens", None)
        return result

    return report_worker(RESULT_TAG, run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="gpt-oss", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="the first N layers of the shape (default: the "
                                                               "family's, 4 for gpt-oss, 8 for qwen35)")
    ap.add_argument("--file", type=Path, default=None, help="the GGUF file (made there when missing)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048, help="prompt tokens of the TTFT measurement")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3, help="timed runs after a warm-up (median)")
    ap.add_argument("--rounds", type=int, default=2, help="every row this many times, interleaved")
    ap.add_argument("--contexts", default=None, metavar="N,N",
                    help="qwen35: lmkit's decode after prompts of these lengths, hybrid and all-attention files")
    ap.add_argument("--quant-policy", type=int, choices=[0, 4, 8], default=0,
                    help="with --contexts: lmkit's KV cache precision (0: the dtype's; 8 / 4: int8 / int4)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, a few tokens, lmkit only: seconds")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    shape = SHAPES[args.family][1 if args.smoke else 0]
    if args.smoke:
        args.new_tokens, args.prefill_len, args.concurrency, args.runs, args.rounds = 4, 64, 2, 1, 1
    args.layers = args.layers or shape["default_layers"]
    if not 1 <= args.layers <= shape["layers"]:
        ap.error(f"--layers must be in [1, {shape['layers']}]")
    def made(shape: dict, label: str = "") -> Path:  # --file names the family's file, not the all-attention twin
        path = (not label and args.file) or \
            peers_dir() / f"{shape['name']}{label}-{args.layers}l-{WEIGHTS[args.family].lower()}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            WRITERS[args.family](partial, shape, args.layers)
            partial.replace(path)
        return path

    path = made(shape)
    if args.contexts:
        if args.family != "qwen35":
            ap.error("--contexts compares the qwen35 hybrid with its all-attention twin")
        files = {"hybrid": path, "all-attention": made({**shape, "interval": 1}, "-attention")}
        w = workload(args, 1000)
        kv = {0: "KV in the dtype's precision", 8: "int8 KV", 4: "int4 KV"}[args.quant_policy]
        print(f"{shape['name']} shape, {args.layers} of {shape['layers']} layers; {cpu_description()}; {args.threads} "
              f"threads; {kv}; lmkit batch-1 decode tok/s (32 tokens) after a prompt of N tokens, median of "
              f"{args.rounds} rounds")
        print("| file | " + " | ".join(args.contexts.split(",")) + " | last / first | rounds' last / first |\n|---|" +
              "---:|" * (len(args.contexts.split(",")) + 1) + "---|")
        for label, f in files.items():
            r = run_worker("contexts", f, w, args.threads, "--contexts", args.contexts, "--quant-policy",
                           str(args.quant_policy), "--rounds", str(args.rounds))
            if "error" in r:
                print(f"| {label} | error: {r['error']} |")
                continue
            speeds = [r[c] for c in args.contexts.split(",")]
            rounds = ", ".join(f"{x:.2f}x" for x in r["ratios"])
            print(f"| {label} | " + " | ".join(f"{x:.1f}" for x in speeds) + f" | {speeds[-1] / speeds[0]:.2f}x | "
                  f"{rounds} (median {statistics.median(r['ratios']):.2f}x) |")
        return 0
    import importlib.util

    all_rows = rows_of(args.family)
    rows = [r for r in all_rows if r.startswith("lmkit") or (not args.smoke and importlib.util.find_spec("llama_cpp"))]
    if len(rows) < len(all_rows) and not args.smoke:
        print("llama.cpp row skipped: llama-cpp-python is not installed (see bench_peers.py)")
    from lmkit.models.gguf_file import gguf_view

    vocab = json.loads((gguf_view(path) / "config.json").read_text())["vocab_size"]
    w = workload(args, vocab)
    results: dict[str, list[dict]] = {r: [] for r in rows}
    for k in range(args.rounds):
        for row in rows if k % 2 == 0 else rows[::-1]:
            results[row].append(run_worker(row, path, w, args.threads))
            print(f"round {k + 1} {row}: {results[row][-1]}", flush=True)
    print(f"\n{shape['name']} shape, {args.layers} of {shape['layers']} layers, {path.stat().st_size / 2**30:.2f} GiB; "
          f"{cpu_description()}; {args.threads} threads; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"TTFT of {args.prefill_len} tokens, {args.concurrency} streams; medians of {args.rounds} rounds")
    print("| row | decode tok/s | TTFT ms | streams tok/s |\n|---|---:|---:|---:|")
    med = {}
    for row, runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            print(f"| {row} | error: {errors[0]} | | |")
            continue
        med[row] = {key: statistics.median(r[key] for r in runs) if all(key in r for r in runs) else None
                    for key in ("decode_tok_s", "ttft_ms", "conc_tok_s")}
        m = med[row]
        print(f"| {row} | {m['decode_tok_s']:.1f} | {m['ttft_ms']:.0f} | "
              f"{m['conc_tok_s']:.1f} |" if m["conc_tok_s"] else f"| {row} | {m['decode_tok_s']:.1f} | "
              f"{m['ttft_ms']:.0f} | - |")
    if len(med) == 2:
        a, b = med[all_rows[0]], med[all_rows[1]]
        conc = f"{a['conc_tok_s'] / b['conc_tok_s']:.2f}x" if a["conc_tok_s"] and b["conc_tok_s"] else "-"
        print(f"| lmkit / llama.cpp | {a['decode_tok_s'] / b['decode_tok_s']:.2f}x | "
              f"{b['ttft_ms'] / a['ttft_ms']:.2f}x | {conc} |")
    return 0 if all(row in med for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
