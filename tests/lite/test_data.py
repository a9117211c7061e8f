"""Calibration and evaluation text: built-in corpora never overlap (Hamlet only on the evaluation side,
pydoc split by topic), windows are seeded and sized as asked, local files are read, and empty or too
short text is a clear error. Also the perplexity window arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from lmkit.lite import corpora
from lmkit.lite.calib import CalibrationDataError, calibration_windows, mixed_windows, tokenize_stream
from lmkit.lite.ppl import windows
from tests.factories import write_byte_tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_shakespeare_calibration_excludes_hamlet():
    calib = corpora.shakespeare_calibration()
    (hamlet,) = corpora.hamlet()
    assert len(calib) == 37 and sum(map(len, calib)) > 4_000_000
    assert hamlet.startswith("# Hamlet")
    assert all("# Hamlet" not in doc[:200] for doc in calib)
    probe = hamlet[20_000:20_200]  # a passage of Hamlet's text appears in no calibration document
    assert not any(probe in doc for doc in calib)


def test_pydoc_split_is_disjoint_and_complete():
    from pydoc_data.topics import topics

    calib, evaluation = corpora.pydoc_calibration(), corpora.pydoc_evaluation()
    assert not set(calib) & set(evaluation)
    texts = set(topics.values())  # "if" and "else" share one text
    assert len(evaluation) == (len(texts) + 4) // corpora.PYDOC_HELD_OUT_EVERY
    # every text is on one side, except the few larger topics that contain a held-out one: on neither
    nested = texts - set(calib) - set(evaluation)
    passages = [e[i:i + 200] for e in evaluation for i in range(0, max(len(e) - 200, 1), 500)]
    assert 0 < len(nested) <= 6 and all(any(p in n for p in passages) for n in nested)
    assert not any(p in c for p in passages for c in calib)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(corpora.CorpusError, match="shakespeare, pydoc"):
        corpora.calibration_corpus("no-such-corpus")
    with pytest.raises(corpora.CorpusError, match="hamlet, pydoc"):
        corpora.evaluation_corpus("no-such-corpus")


def test_hub_dataset_without_datasets_is_clear(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(corpora.CorpusError, match="pip install datasets"):
        corpora.calibration_corpus("wikitext2")


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n\n" + json.dumps("gamma") + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"text": "delta"}, "epsilon"]))
    (tmp_path / "ignored.md").write_text("not read")
    assert corpora.calibration_corpus(str(tmp_path)) == ["alpha text", "beta", "gamma", "delta", "epsilon"]
    assert corpora.calibration_corpus(str(tmp_path / "c.json")) == ["delta", "epsilon"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(corpora.CorpusError, match="not valid JSON"):
        corpora.calibration_corpus(str(tmp_path / "bad.json"))
    with pytest.raises(corpora.CorpusError, match="does not exist"):
        corpora.calibration_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(corpora.CorpusError, match="unsupported text file type"):
        corpora.calibration_corpus(str(tmp_path / "ignored.md"))


def test_windows_are_seeded_and_sized(byte_tokenizer):
    import random

    rng = random.Random(0)
    docs = ["".join(rng.choice("abcdefghij") for _ in range(500)), "".join(rng.choice("0123456789") for _ in range(500))]
    a = calibration_windows(byte_tokenizer, docs, 8, 64, seed=0)
    b = calibration_windows(byte_tokenizer, docs, 8, 64, seed=0)
    c = calibration_windows(byte_tokenizer, docs, 8, 64, seed=1)
    assert a.shape == (8, 64) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    stream = tokenize_stream(byte_tokenizer, docs)
    assert len(stream) == 1002 and stream[500] == byte_tokenizer.eos_token_id  # documents joined by eos
    starts = {tuple(row.tolist()) for row in a}
    chunks = {tuple(stream[i:i + 64]) for i in range(0, 1002 - 63, 64)}
    assert starts <= chunks and len(starts) == 8  # non-overlapping windows, no repeats


def test_empty_and_too_short_calibration_data(byte_tokenizer):
    with pytest.raises(CalibrationDataError, match="empty"):
        calibration_windows(byte_tokenizer, ["", "   \n"], 4, 16, seed=0)
    with pytest.raises(CalibrationDataError, match=r"too short: 101 tokens make 6 windows of 16 tokens, but 7"):
        calibration_windows(byte_tokenizer, ["x" * 100], 7, 16, seed=0)
    assert calibration_windows(byte_tokenizer, ["x" * 100], 6, 16, seed=0).shape == (6, 16)


def test_mixed_corpora_draw_evenly(byte_tokenizer, tmp_path):
    """shakespeare+pydoc: windows evenly from each corpus (the remainder to the first), in one seeded order
    that mixes them; one corpus is exactly calibration_windows; bad lists are clear errors."""
    letters, digits = ["abcdefghij" * 100], ["0123456789" * 100]
    w = mixed_windows(byte_tokenizer, [("letters", letters), ("digits", digits)], 7, 32, seed=0)
    assert w.shape == (7, 32) and torch.equal(w, mixed_windows(byte_tokenizer, [("letters", letters),
                                                                               ("digits", digits)], 7, 32, seed=0))
    texts = [byte_tokenizer.decode(row) for row in w]
    assert all(t.isdigit() or t.isalpha() for t in texts)  # each window from one corpus
    is_digit = [t.isdigit() for t in texts]
    assert sum(is_digit) == 3 and is_digit[:4] != [is_digit[0]] * 4  # 4 + 3, interleaved
    assert torch.equal(mixed_windows(byte_tokenizer, [("letters", letters)], 5, 32, seed=3),
                       calibration_windows(byte_tokenizer, letters, 5, 32, seed=3))
    with pytest.raises(CalibrationDataError, match="evenly from 2 corpora"):
        mixed_windows(byte_tokenizer, [("letters", letters), ("digits", digits)], 1, 32, seed=0)
    with pytest.raises(CalibrationDataError, match="'digits' is too short"):
        mixed_windows(byte_tokenizer, [("letters", letters), ("digits", ["0123"])], 4, 32, seed=0)
    assert [name for name, _ in corpora.calibration_corpora("shakespeare+pydoc")] == ["shakespeare", "pydoc"]
    with pytest.raises(corpora.CorpusError, match="names a corpus twice"):
        corpora.calibration_corpora("pydoc+pydoc")
    with pytest.raises(corpora.CorpusError, match="empty name"):
        corpora.calibration_corpora("pydoc+")
    with pytest.raises(corpora.CorpusError, match="unknown dataset 'nope'"):
        corpora.calibration_corpora("pydoc+nope")
    plus = tmp_path / "a+b.txt"  # a path that exists is never split
    plus.write_text("text")
    assert corpora.calibration_corpora(str(plus)) == [(str(plus), ["text"])]


def test_perplexity_windows():
    # disjoint: 4 windows of 512 over 2048 tokens, 511 scored each (the first token of a window has no context)
    spans = windows(2048, 512, 512)
    assert spans == [(0, 512, 1), (512, 1024, 513), (1024, 1536, 1025), (1536, 2048, 1537)]
    assert sum(e - f for _, e, f in spans) == 4 * 511
    # sliding: every token after the first scored exactly once, with up to seqlen - 1 tokens of context
    spans = windows(1000, 256, 128)
    scored = [p for _, e, f in spans for p in range(f, e)]
    assert scored == list(range(1, 1000))
    assert all(b < f for b, _, f in spans) and all(e - b <= 256 for b, e, _ in spans)
