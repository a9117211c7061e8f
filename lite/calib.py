"""Calibration token windows: a corpus tokenized into one stream, cut into non-overlapping windows of
``seqlen`` tokens, of which ``num_samples`` are drawn at random (seeded).

    doc0 tokens <eos> doc1 tokens <eos> ...  ->  | w0 | w1 | w2 | ... | w(n-1) | (tail dropped)
                                                  randperm(n, seed)[:num_samples]  ->  [num_samples, seqlen]

The draw order is kept: the first windows form a random subset (the scale search scores on it).
"""

from __future__ import annotations

import torch


class CalibrationDataError(ValueError):
    """Calibration text that is empty or too short for the requested windows."""


def tokenize_stream(tokenizer, docs: list[str]) -> list[int]:
    """Token ids of ``docs`` (no special tokens), joined by the eos token when the tokenizer has one."""
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        return []
    limit = tokenizer.model_max_length
    tokenizer.model_max_length = int(1e30)  # a corpus is longer than the context: no warning, windows cut it
    try:
        encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    finally:
        tokenizer.model_max_length = limit
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in encoded:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    return stream


def calibration_windows(tokenizer, docs: list[str], num_samples: int, seqlen: int, seed: int,
                        source: str = "calibration data") -> torch.Tensor:
    """int64 [num_samples, seqlen] windows of the tokenized ``docs``.

    Raises CalibrationDataError naming ``source`` when the text is empty or holds fewer than
    ``num_samples`` windows of ``seqlen`` tokens.
    """
    if num_samples < 1 or seqlen < 2:
        raise ValueError(f"need at least 1 sample of at least 2 tokens, got {num_samples} x {seqlen}")
    stream = tokenize_stream(tokenizer, docs)
    if not stream:
        raise CalibrationDataError(f"{source} is empty: no text to calibrate on")
    num_windows = len(stream) // seqlen
    if num_windows < num_samples:
        raise CalibrationDataError(
            f"{source} is too short: {len(stream)} tokens make {num_windows} windows of {seqlen} tokens, "
            f"but {num_samples} samples were asked for (use more text, fewer --calib-samples or a shorter "
            f"--calib-seqlen)"
        )
    windows = torch.tensor(stream[: num_windows * seqlen], dtype=torch.long).view(num_windows, seqlen)
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(num_windows, generator=generator)[:num_samples]
    return windows[pick].contiguous()


def mixed_windows(tokenizer, corpora: list[tuple[str, list[str]]], num_samples: int, seqlen: int,
                  seed: int) -> torch.Tensor:
    """int64 [num_samples, seqlen] windows drawn evenly from several corpora ((name, docs) pairs): corpus i
    gives num_samples // k windows (the first num_samples % k one more), each drawn as calibration_windows
    draws them, then all are put in one seeded random order, so the first windows (which the scale search
    scores on) mix the corpora too. One corpus: exactly calibration_windows."""
    if len(corpora) == 1:
        name, docs = corpora[0]
        return calibration_windows(tokenizer, docs, num_samples, seqlen, seed, source=f"calibration dataset {name!r}")
    k = len(corpora)
    if num_samples < k:
        raise CalibrationDataError(f"{num_samples} calibration samples cannot be drawn evenly from {k} corpora "
                                   f"({', '.join(name for name, _ in corpora)}): use at least {k}")
    parts = [calibration_windows(tokenizer, docs, num_samples // k + (i < num_samples % k), seqlen, seed,
                                 source=f"calibration dataset {name!r}")
             for i, (name, docs) in enumerate(corpora)]
    windows = torch.cat(parts)
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))
    return windows[order].contiguous()
