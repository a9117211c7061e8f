"""Tokenizer, chat template and incremental detokenization, on top of transformers' fast tokenizers."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Sequence


class Tokenizer:
    """The model folder's tokenizer. Chat messages are rendered with its chat template."""

    def __init__(self, path: Path, chat_template: str | None = None):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # transformers raises many types for a broken tokenizer
            raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        if chat_template is not None:
            self._tok.chat_template = chat_template
        # transformers' decode walks the id list in Python (to_py_obj) before the Rust decoder runs; where it
        # would add nothing (no clean-up of tokenization spaces), the Rust tokenizer decodes directly
        from tokenizers import Tokenizer as RustTokenizer

        backend = getattr(self._tok, "_tokenizer", None)
        plain = not getattr(self._tok, "clean_up_tokenization_spaces", False)
        self._rust_decode = backend.decode if isinstance(backend, RustTokenizer) and plain else None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE piece may hold part of a UTF-8 character)."""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        byte_of = _byte_level_decoder()
        if all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass a plain string prompt "
                             "or give a template (chat_template=...)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a multi-byte character.

    Each step decodes only a short window: the ids from ``prefix`` (the start of the tokens already sent
    before the last delta) to the end, minus the text of ``prefix:read`` (the tokens already sent). The
    prefix tokens give the decoder the context it needs (a SentencePiece decoder strips the leading space
    of the first token only; a character can span byte tokens), so the deltas join to the full decode,
    at a cost per token that does not grow with the sequence (decoding everything each step did).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._emitted = ""

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Appends ids and returns the new text; holds back an incomplete character unless final."""
        self._ids.extend(ids)
        decode = self._tokenizer.decode
        window = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if not final and window.endswith("\ufffd"):
            return ""
        sent = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip) \
            if self._read > self._prefix else ""
        if not window.startswith(sent):  # the decoder rewrote earlier text (not seen with BPE decoders):
            return self._resync(final)  # fall back to the full decode
        delta = window[len(sent):]
        if delta or final:
            self._prefix, self._read = self._read, len(self._ids)
        self._emitted += delta
        return delta

    def _resync(self, final: bool) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._prefix, self._read = max(0, len(self._ids) - 1), len(self._ids)
        self._emitted += delta
        return delta

    @property
    def text(self) -> str:
        return self._emitted


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
