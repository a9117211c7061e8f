"""Incremental detokenization: streamed one token at a time, the deltas join to transformers' full decode
(the oracle) and never end inside a multi-byte character, for a byte-level BPE (SmolLM2's) and a
SentencePiece-style BPE with byte fallback (Llama's decoder: Metaspace, byte tokens, one leading space
stripped), with special tokens kept and skipped."""

from __future__ import annotations

import random

import pytest

from lmkit.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "Ünïcödé: café, naïve, Straße; 日本語のテキスト; 한국어; emoji 🎉🚀👍🏽 and 👨‍👩‍👧 families",
    "def f(x):\n    return x ** 2  # comment\n",
    "Numbers 1234567890 and symbols !@#$%^&*()_+-=[]{}|;':\",./<>?",
]


def sentencepiece_style_folder(folder) -> str:
    """A small Llama-style tokenizer trained here: BPE with byte fallback, Metaspace spaces."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 3, "hello world " * 5,
                             "def return comment numbers symbols"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    if request.param == "smollm2":
        return Tokenizer(request.getfixturevalue("smollm2_path"))
    return Tokenizer(sentencepiece_style_folder(tmp_path_factory.mktemp("sp-tokenizer")))


def stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.add([], final=True))
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_join_to_the_full_decode(tokenizer, skip):
    rng = random.Random(0)
    specials = tokenizer._tok.all_special_ids
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(3):  # special tokens dropped in at random places
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        expected = tokenizer._tok.decode(ids, skip_special_tokens=skip)  # transformers' own decode
        deltas = stream(tokenizer, ids, skip)
        assert "".join(deltas) == expected, (text, deltas)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1]), deltas  # no character sent in halves


def test_random_ids_join_to_the_full_decode(tokenizer):
    """Arbitrary id sequences (broken UTF-8 included): the joined deltas still equal the full decode."""
    rng = random.Random(1)
    n = tokenizer.vocab_size
    for _ in range(20):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 60))]
        assert "".join(stream(tokenizer, ids, True)) == tokenizer._tok.decode(ids, skip_special_tokens=True)


def test_fast_decode_matches_transformers(tokenizer):
    ids = tokenizer.encode(TEXTS[2] + TEXTS[0])
    assert tokenizer._rust_decode is not None  # both tokenizers here take the direct path
    for skip in (True, False):
        assert tokenizer.decode(ids, skip) == tokenizer._tok.decode(ids, skip_special_tokens=skip)
