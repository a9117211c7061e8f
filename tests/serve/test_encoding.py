"""serve/encoding.py's answers in pieces: the pieces joined are exactly the text Starlette's JSONResponse
writes for the same answer made whole (json.dumps, compact), for any nesting of dicts, lists and LazyLists
(concatenated either way), and a LazyList's items are made only as the pieces are asked for."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from lmkit.serve.encoding import LazyList, dumps, encode_pieces
from lmkit.serve.render import MIN_LOGPROB, logprob


def whole(value):
    """The value with every LazyList made a list: what the pieces must encode."""
    if isinstance(value, LazyList):
        return [whole(v) for v in value]
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole(v) for v in value]
    return value


def starlette_text(value) -> str:
    return json.dumps(whole(value), ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


leaves = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))


def lazy(items: list, split: int, shared: bool):
    """items as a LazyList, or as a concatenation of a list and a LazyList (either order) or of two LazyLists."""
    a, b = items[:split], items[split:]
    as_lazy = lambda xs: LazyList(len(xs), xs.__getitem__, shared)  # noqa: E731
    return [as_lazy(items), a + as_lazy(b), as_lazy(a) + b, as_lazy(a) + as_lazy(b)][split % 4]


values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=5),
    st.dictionaries(st.text(max_size=5), inner, max_size=5),
    st.tuples(st.lists(inner, max_size=6), st.integers(0, 6), st.booleans()).map(
        lambda t: lazy(t[0], min(t[1], len(t[0])), t[2]))),
    max_leaves=40)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(values, st.integers(1, 80))
def test_pieces_joined_are_starlettes_text(value, piece_chars):
    pieces = list(encode_pieces(value, piece_chars))
    assert "".join(pieces) == starlette_text(value) == dumps(value)
    assert all(pieces)


def test_items_are_made_as_pieces_are_asked_for():
    made = []

    def item(i: int) -> dict:
        made.append(i)
        return {"token": f"t{i}", "top": {f"a{i}": -1.5, "b": MIN_LOGPROB}}

    body = {"choices": [{"index": 0, "logprobs": {"top_logprobs": [None] + LazyList(10_000, item)}}]}
    pieces = encode_pieces(body, 1000)
    first = next(pieces)
    assert len(first) < 1100 and 0 < len(made) < 50
    text = first + "".join(pieces)
    assert len(made) == 10_000 and json.loads(text) == whole(body)


def test_a_shared_list_is_made_once_for_its_copies():
    """A prompt's scores go into each of its n completions: made once, encoded n times."""
    made = []
    scores = LazyList(300, lambda i: made.append(i) or {"t": i}, shared=True)
    body = {"choices": [{"index": c, "top": [None] + scores + [{"own": c}]} for c in range(4)]}
    text = "".join(encode_pieces(body, 500))
    assert sorted(made) == list(range(300)) and json.loads(text) == whole(body)


def test_an_infinite_logprob_is_written_as_openai_writes_it():
    assert logprob(float("-inf")) == MIN_LOGPROB == -9999.0
    assert logprob(float("nan")) == MIN_LOGPROB and logprob(-3.25) == -3.25 and logprob(0.0) == 0.0
