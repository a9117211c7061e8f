"""How far a model's next-token distribution moves from a reference's (a quantized checkpoint against its source):
llama.cpp's ``--kl-divergence`` measure, through lmkit's engine, over held-out text in disjoint windows.

    kl_divergence(reference, model, KlConfig)  -> KlResult

Both models run in lmkit engines side by side, one window at a time (nothing of a window is kept once it is
scored). At every position of a window each engine's logits give a distribution over the shared vocabulary;
KL(P_reference || P_model) = sum p_ref * (log p_ref - log p_model), in float64. Reported: mean KL with its
standard error, median, 99th percentile and maximum; the share of positions whose most likely token is the same
("same top p" in llama.cpp); and each model's perplexity on the same tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lmkit.lite.config import KlConfig


@dataclass(frozen=True)
class KlResult:
    reference: str
    model: str
    dataset: str
    positions: int  # next-token distributions compared
    windows: int
    seqlen: int
    mean_kl: float
    mean_kl_stderr: float
    median_kl: float
    p99_kl: float
    max_kl: float
    same_top1: float  # share of positions where both models' most likely token is the same
    ppl_reference: float
    ppl_model: float
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def window_stats(ref_logits: np.ndarray, model_logits: np.ndarray, targets: np.ndarray, rows: int = 16) \
        -> tuple[np.ndarray, np.ndarray, float, float]:
    """(KL per position, same-top-1 per position, sum of the reference's and the model's negative log-likelihood
    of ``targets``) for [positions, vocab] logits; targets[i] is the token after position i (-1: none).

    In float64, ``rows`` positions at a time (a window's [512, 49152] logits in float64 are 200 MB an array, each
    page-faulted in; 16 rows are 6 MB). With x and y the rows less their maxima, Z = sum exp(x) and p = exp(x) / Z:
    KL = sum p * ((x - log Z) - (y - log sum exp(y))) = sum exp(x) * (x - y) / Z - log Z + log sum exp(y)."""
    n = ref_logits.shape[0]
    kl = np.empty(n, dtype=np.float64)
    nll_ref = nll_got = 0.0
    for begin in range(0, n, rows):
        x = ref_logits[begin:begin + rows].astype(np.float64)
        y = model_logits[begin:begin + rows].astype(np.float64)
        x -= x.max(axis=-1, keepdims=True)
        y -= y.max(axis=-1, keepdims=True)
        ex = np.exp(x)
        zx = ex.sum(axis=-1)
        log_zx = np.log(zx)
        log_zy = np.log(np.exp(y).sum(axis=-1))
        t = targets[begin:begin + rows]
        scored = np.flatnonzero(t >= 0)
        nll_ref -= float((x[scored, t[scored]] - log_zx[scored]).sum())
        nll_got -= float((y[scored, t[scored]] - log_zy[scored]).sum())
        x -= y
        kl[begin:begin + rows] = np.einsum("ij,ij->i", ex, x) / zx - log_zx + log_zy
    same = ref_logits.argmax(axis=-1) == model_logits.argmax(axis=-1)
    return np.maximum(kl, 0.0), same, nll_ref, nll_got


def _engine(model: str | Path | None, config: KlConfig):
    from lmkit import EngineConfig, pipeline

    return pipeline(model, EngineConfig(device="cpu", dtype=config.dtype, num_threads=config.num_threads,
                                        session_len=config.seqlen + 8, max_batch_size=1,
                                        max_prefill_token_num=max(config.seqlen + 8, 2048),
                                        speculative="off"))


def window_logits(pipe, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] logits: row i is the distribution of the token after ids[i]."""
    from lmkit import GenerationConfig

    r = pipe(ids, GenerationConfig(max_new_tokens=1, output_logits=True, ignore_eos=True))
    return np.asarray(r.logits[: len(ids)], dtype=np.float32)


def kl_divergence(reference: str | Path | None, model: str | Path, config: KlConfig) -> KlResult:
    """KL(reference || model) of the next-token distributions over config.dataset (see the module docstring).
    Raises ValueError when the two models' vocabularies differ (the distributions would not be comparable)."""
    from transformers import AutoTokenizer

    from lmkit.lite.calib import tokenize_stream
    from lmkit.lite.corpora import evaluation_corpus
    from lmkit.model_path import resolve_model

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(reference))
    stream = tokenize_stream(tokenizer, evaluation_corpus(config.dataset))
    if config.max_tokens:
        stream = stream[:config.max_tokens]
    if len(stream) < 2:
        raise ValueError(f"evaluation dataset {config.dataset!r} has {len(stream)} tokens; need at least 2")
    kls, same, nll_ref, nll_got, scored, windows = [], [], 0.0, 0.0, 0, 0
    with _engine(reference, config) as ref_pipe, _engine(model, config) as model_pipe:
        vocab_ref, vocab_model = ref_pipe.engine.spec.vocab_size, model_pipe.engine.spec.vocab_size
        if vocab_ref != vocab_model:
            raise ValueError(f"the models' vocabularies differ ({vocab_ref} and {vocab_model} tokens): their "
                             "next-token distributions cannot be compared")
        for begin in range(0, len(stream) - 1, config.seqlen):
            ids = stream[begin:begin + config.seqlen]
            following = stream[begin + 1:begin + len(ids) + 1]  # the last window's last token has none
            targets = np.array(following + [-1] * (len(ids) - len(following)), dtype=np.int64)
            kl, top, a, b = window_stats(window_logits(ref_pipe, ids), window_logits(model_pipe, ids), targets)
            kls.append(kl)
            same.append(top)
            nll_ref, nll_got, windows = nll_ref + a, nll_got + b, windows + 1
            scored += int((targets >= 0).sum())
    kl_all, same_all = np.concatenate(kls), np.concatenate(same)
    return KlResult(reference=str(reference or "smollm2"), model=str(model), dataset=config.dataset,
                    positions=int(kl_all.size), windows=windows, seqlen=config.seqlen,
                    mean_kl=float(kl_all.mean()), mean_kl_stderr=float(kl_all.std(ddof=1) / math.sqrt(kl_all.size))
                    if kl_all.size > 1 else 0.0, median_kl=float(np.median(kl_all)),
                    p99_kl=float(np.percentile(kl_all, 99)), max_kl=float(kl_all.max()),
                    same_top1=float(same_all.mean()), ppl_reference=math.exp(nll_ref / scored),
                    ppl_model=math.exp(nll_got / scored), seconds=time.perf_counter() - start)
