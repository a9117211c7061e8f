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

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
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
    """Turns a growing list of token ids into text deltas that never split a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = ""

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Appends ids and returns the new text; holds back an incomplete character unless final."""
        self._ids.extend(ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if not final and text.endswith("\ufffd"):
            return ""
        # Text before the last incomplete character is stable for byte-level BPE: send what is new.
        delta = text[len(self._emitted):]
        self._emitted = text
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
