"""Answers written as JSON in pieces: an answer's per-token scores (an 8,100-token prompt echoed with 20
alternatives into 5 completions encodes to 85 MB, 1.9 s of one json.dumps holding the GIL) are LazyLists, made
item by item as encode_pieces writes the answer in pieces of PIECE_CHARS, so that neither the answer nor its
Python objects are ever held whole and the interpreter is never held for long."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

PIECE_CHARS = 1 << 16
"""Characters of JSON per piece of an answer encoded in pieces (~1 ms of encoding each)."""


class LazyList:
    """A JSON list whose items are made when it is encoded (``item(i)`` for i in 0..count-1). ``shared``: the
    list goes into several completions of one answer (a prompt's scores into each of its n): each item's text
    is kept once made, so that the copies cost one making (and one copy's text), not n."""

    __slots__ = ("count", "item", "text")

    def __init__(self, count: int, item: Callable[[int], Any], shared: bool = False):
        self.count = count
        self.item = item
        self.text: Callable[[int], str] = (_kept_texts(count, item) if shared else lambda i: dumps(item(i)))
        """The JSON text of item i."""

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        return map(self.item, range(self.count))

    def __add__(self, other: list | LazyList) -> LazyList:
        return _concat(self, other)

    def __radd__(self, other: list) -> LazyList:
        return _concat(other, self)


def _kept_texts(count: int, item: Callable[[int], Any]) -> Callable[[int], str]:
    texts: list[str | None] = [None] * count

    def text(i: int) -> str:
        t = texts[i]
        if t is None:
            t = texts[i] = dumps(item(i))
        return t

    return text


def _concat(a: list | LazyList, b: list | LazyList) -> LazyList:
    n = len(a)
    item_a, text_a = (a.item, a.text) if isinstance(a, LazyList) else (a.__getitem__, lambda i: dumps(a[i]))
    item_b, text_b = (b.item, b.text) if isinstance(b, LazyList) else (b.__getitem__, lambda i: dumps(b[i]))
    joined = LazyList(n + len(b), lambda i: item_a(i) if i < n else item_b(i - n))
    joined.text = lambda i: text_a(i) if i < n else text_b(i - n)
    return joined


def _made(value: Any) -> list:
    if isinstance(value, LazyList):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_made).encode
"""JSON text as Starlette's JSONResponse writes it; LazyLists made whole (small ones: a streamed chunk's). One
encoder: json.dumps with arguments builds one per call."""


def _has_lazy(value: Any) -> bool:
    if isinstance(value, LazyList):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_has_lazy(v) for v in items if isinstance(v, (dict, list, LazyList)))


def _fragments(value: Any) -> Iterator[str]:
    """JSON text of ``value``: a LazyList item by item (its items are plain values), a dict or list that holds a
    LazyList part by part, anything else in one piece."""
    if isinstance(value, LazyList):
        text = value.text
        for i in range(value.count):
            yield ("," if i else "[") + text(i)
        yield "]" if value.count else "[]"
    elif isinstance(value, dict) and _has_lazy(value):
        sep = "{"
        for key, v in value.items():
            yield sep + dumps(key) + ":"
            yield from _fragments(v)
            sep = ","
        yield "}"
    elif isinstance(value, list) and _has_lazy(value):
        sep = "["
        for v in value:
            yield sep
            yield from _fragments(v)
            sep = ","
        yield "]"
    else:
        yield dumps(value)


def encode_pieces(value: Any, piece_chars: int | None = None) -> Iterator[str]:
    """``dumps(value)`` in pieces of about ``piece_chars`` (PIECE_CHARS; concatenated, the same text), each made
    only when asked for (see _fragments)."""
    piece_chars = piece_chars or PIECE_CHARS
    pieces, size = [], 0
    for fragment in _fragments(value):
        pieces.append(fragment)
        size += len(fragment)
        if size >= piece_chars:
            yield "".join(pieces)
            pieces, size = [], 0
    if pieces:
        yield "".join(pieces)
