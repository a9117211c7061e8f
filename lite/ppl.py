"""Perplexity on held-out text with sliding windows.

    tokens  t0 t1 t2 ... t(n-1)           (the first ``max_tokens`` of the text, documents joined by eos)
    window k covers [k * stride, k * stride + seqlen) and scores the tokens at positions it is the first
    window to reach, each predicted from everything before it inside the window (the first token of the
    text is never scored). stride = seqlen: disjoint windows, seqlen - 1 scored tokens each.

    ppl = exp(sum of -log p(token) / number of scored tokens)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmkit.lite.calib import tokenize_stream
from lmkit.lite.config import PplConfig, resolve_device
from lmkit.lite.corpora import evaluation_corpus


@dataclass(frozen=True)
class PplResult:
    """One perplexity measurement."""

    model: str
    kind: str  # "fp", or the quant_method: "awq", "compressed-tensors"
    dataset: str
    ppl: float
    num_tokens: int  # scored tokens
    num_windows: int
    seqlen: int
    stride: int
    seconds: float


def windows(num_tokens: int, seqlen: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window: positions [begin, end) are fed, [first_scored, end) scored."""
    spans = []
    scored_until = 1  # position 0 has no context
    begin = 0
    while scored_until < num_tokens:
        end = min(begin + seqlen, num_tokens)
        first = max(scored_until, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        scored_until = end
        begin += stride
    return spans


@torch.no_grad()
def sum_nll(model, ids: torch.Tensor, seqlen: int, stride: int, batch_size: int,
            device: torch.device) -> tuple[float, int, int]:
    """(sum of negative log-likelihoods, scored tokens, windows) of ``ids`` [n] under ``model``."""
    spans = windows(ids.numel(), seqlen, stride)
    total, count = 0.0, 0
    # windows of equal length run batched; a shorter last window runs alone
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for span in spans:
        by_length.setdefault(span[1] - span[0], []).append(span)
    for length, group in by_length.items():
        for i in range(0, len(group), batch_size):
            batch = group[i:i + batch_size]
            inputs = torch.stack([ids[b:e] for b, e, _ in batch]).to(device)
            logits = model(input_ids=inputs).logits.float()
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
            targets = inputs[:, 1:]
            token_lp = logprobs.gather(2, targets.unsqueeze(2)).squeeze(2)  # [batch, length - 1]
            for row, (b, e, first) in enumerate(batch):
                scored = token_lp[row, first - b - 1:]
                total -= float(scored.sum())
                count += scored.numel()
    return total, count, len(spans)


def evaluation_tokens(tokenizer, dataset: str, max_tokens: int) -> torch.Tensor:
    """int64 [n] token ids of the evaluation text (first ``max_tokens``; 0 = all)."""
    stream = tokenize_stream(tokenizer, evaluation_corpus(dataset))
    if max_tokens:
        stream = stream[:max_tokens]
    if len(stream) < 2:
        raise ValueError(f"evaluation dataset {dataset!r} has {len(stream)} tokens; need at least 2")
    return torch.tensor(stream, dtype=torch.long)


def evaluate_perplexity(model: str | Path | None, config: PplConfig) -> PplResult:
    """Perplexity of the checkpoint ``model`` (fp or AWQ; a folder, hub id, or None/"smollm2" for the
    bundled SmolLM2) on ``config.dataset``, through the torch reference path (not the engine)."""
    from transformers import AutoTokenizer

    from lmkit.lite.checkpoint import load_causal_lm, quantization_settings
    from lmkit.lite.layerwise import read_config
    from lmkit.model_path import resolve_model

    start = time.perf_counter()
    folder = resolve_model(model)
    device = resolve_device(config.device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = evaluation_tokens(tokenizer, config.dataset, config.max_tokens)
    settings = quantization_settings(read_config(folder))
    kind = str(settings["quant_method"]) if settings else "fp"
    lm = load_causal_lm(folder, device)
    nll, count, num_windows = sum_nll(lm, ids, config.seqlen, config.effective_stride, config.batch_size, device)
    return PplResult(model=str(folder), kind=kind, dataset=config.dataset, ppl=math.exp(nll / count),
                     num_tokens=count, num_windows=num_windows, seqlen=config.seqlen,
                     stride=config.effective_stride, seconds=time.perf_counter() - start)
