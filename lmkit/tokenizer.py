"""Tokenizer, chat template and incremental detokenization, on the `tokenizers` library (Rust) and jinja2.

A model folder is read the way transformers 5 reads it (its ``TokenizersBackend`` and chat template utilities),
without importing transformers, so neither it nor torch is loaded by the engine or the servers:

  tokenizer.json             the pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added tokens).
                             Its post-processor alone decides what ``add_special_tokens`` adds: transformers drops
                             tokenizer_config.json's add_bos_token / add_eos_token when a tokenizer.json exists
  tokenizer_config.json      named special tokens (bos_token, eos_token, ... and model-specific ``*_token`` keys),
                             extra_special_tokens (additional_special_tokens), added_tokens_decoder,
                             split_special_tokens, clean_up_tokenization_spaces, chat_template (one, or named ones)
  special_tokens_map.json    legacy: the named special tokens, where tokenizer_config.json has no added_tokens_decoder
  chat_template.jinja        the default chat template; additional_chat_templates/<name>.jinja named ones. Files win
                             over tokenizer_config.json's chat_template; a processor's legacy chat_template.json is
                             read only where neither has one (rendered by lmkit/chat_template.py)
A folder with only a slow tokenizer (SentencePiece model, vocab + merges) and no tokenizer.json is converted by
transformers, imported for that case only.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from lmkit.chat_template import render_chat_template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tekken.json", "vocab.json",
                         "vocab.txt")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def check_valid_unicode(text: str) -> str:
    """``text``, or ValueError naming the first lone surrogate: JSON can escape one ("\\ud800") and Python holds
    it, but no tokenizer or UTF-8 encoder takes it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                             f"{e.start} (a character beyond U+FFFF is escaped in JSON as a pair, high then low)"
                             ) from None
    return text


_GIL_FREE_CHARS = 2048
"""Texts longer than this are tokenized by the batch API, which releases the GIL (a short one costs ~2 us more
there)."""

class Tokenizer:
    """The model folder's tokenizer. Chat messages are rendered with its chat template."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        folder = Path(path)
        try:
            config = _tokenizer_config(folder)
            self._backend = _load_backend(folder)
            self._special_tokens = _add_special_tokens(self._backend, config)
        except Exception as e:  # tokenizers raises plain Exception for a broken tokenizer.json
            raise ValueError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        # transformers encodes without truncation or padding unless asked, whatever tokenizer.json sets
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # transformers 5 skips the clean-up for BPE models (it would strip real spaces before punctuation)
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        self._chat_template = chat_template if chat_template is not None else find_chat_template(folder, config)

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus added tokens (``len()`` of transformers' tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters the text of one token takes: the longest single-token decode in the vocabulary
        (special tokens included), or the token's piece where that is longer (a SentencePiece decoder strips
        the leading space of a lone token). Computed once, on first use (~50 ms for 50k tokens). A bound on
        text per token as long as the normalizer drops no characters and no added token strips whitespace."""
        n = self.vocab_size
        texts = self._backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        pieces = (self._backend.id_to_token(i) or "" for i in range(n))
        return max(max(map(len, texts), default=0), max(map(len, pieces), default=0))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ValueError for text that is not valid Unicode (a lone surrogate). A long text goes
        through the batch API, which releases the GIL while it tokenizes (``encode`` holds it: 0.45 s for 660k
        characters, during which a server's event loop could not answer even /health)."""
        try:
            if len(text) > _GIL_FREE_CHARS:
                return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str):
                check_valid_unicode(text)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE piece may hold part of a UTF-8 character)."""
        piece = self._backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        byte_of = _byte_level_decoder()
        if all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode()

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face tokenizer.json text, added special tokens included."""
        return self._backend.to_str()

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (the default one of named templates), None without one."""
        t = self._chat_template
        return t if isinstance(t, str) or t is None else t.get("default")

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token whose text is ``text`` (an added token, or a piece of the vocabulary that
        encodes alone), None when ``text`` is more than one token."""
        token = self._backend.token_to_id(text)
        if token is not None:
            return token
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.decode(ids, skip_special_tokens=False) == text else None

    def is_special(self, text: str) -> bool:
        """Whether ``text`` is a special token (one that decoding with skip_special_tokens leaves out)."""
        return any(t.special and t.content == text for t in self._backend.get_added_tokens_decoder().values())

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The chat template's text of a conversation (lmkit.chat_template.render_chat_template). Raises
        ValueError when there is no template or it cannot render these messages."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass a plain string prompt "
                             "or give a template (chat_template=...)")
        if not messages:
            raise ValueError("a chat needs at least one message")
        return render_chat_template(self._chat_template, messages, add_generation_prompt, self._special_tokens,
                                    tools, template_kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, ready for the assistant's turn (the template's text, encoded without
        adding special tokens). Raises ValueError when there is no template or it cannot render these messages."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


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


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, with the legacy special_tokens_map.json merged in where transformers does."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    config = _read_json(folder / "tokenizer_config.json")
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    if "added_tokens_decoder" not in config:
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                existing = list(config.get("extra_special_tokens") or [])
                config["extra_special_tokens"] = existing + [t for t in value if t not in existing]
            else:
                config[key] = {**value, "special": True} if isinstance(value, dict) else value
    return config


def _load_backend(folder: Path) -> RustTokenizer:
    """tokenizer.json; without one, the slow tokenizer converted by transformers (imported here only)."""
    if (folder / "tokenizer.json").is_file():
        return RustTokenizer.from_file(str(folder / "tokenizer.json"))
    slow = [name for name in _SLOW_TOKENIZER_FILES if (folder / name).is_file()]
    if not slow:
        raise FileNotFoundError(f"no tokenizer.json (nor a slow tokenizer: {', '.join(_SLOW_TOKENIZER_FILES)})")
    fix = f"AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}') writes a tokenizer.json once"
    print(f"lmkit: {folder} has no tokenizer.json, only a slow tokenizer ({slow[0]}): converting it with "
          f"transformers (which imports torch where it is installed; {fix})", file=sys.stderr, flush=True)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"converting the slow tokenizer {slow[0]} needs transformers (pip install transformers "
                         f"sentencepiece), or a tokenizer.json: {fix}") from None
    backend = getattr(AutoTokenizer.from_pretrained(str(folder)), "backend_tokenizer", None)
    if not isinstance(backend, RustTokenizer):
        raise ValueError(f"transformers could not convert {slow[0]} into a tokenizers pipeline")
    return backend


def _as_added_token(value: Any) -> Any:
    """An AddedToken for a serialized one ({"content": ..., "__type": "AddedToken", ...}); other values as given."""
    if isinstance(value, dict) and "content" in value:
        return AddedToken(**{k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value})
    return value


def _add_special_tokens(backend: RustTokenizer, config: dict) -> dict[str, str]:
    """Adds tokenizer_config.json's added tokens and its named and extra special tokens to ``backend`` (in
    transformers' order, so new ones get its ids) and marks the named ones special. Returns the named special
    tokens (name -> text): the chat template's variables."""
    added = sorted((int(i), _as_added_token(t)) for i, t in (config.get("added_tokens_decoder") or {}).items())
    to_add = [token for _, token in added]
    by_content = {str(token): token for token in to_add}
    model_specific = [k for k in config if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES]
    named: dict[str, Any] = {}
    for key in (*SPECIAL_TOKEN_NAMES, *model_specific):
        value = _as_added_token(config.get(key))
        if isinstance(value, (str, AddedToken)):
            named[key] = by_content.get(str(value), value) if key in SPECIAL_TOKEN_NAMES else value
    extras = config.get("extra_special_tokens") or []
    if isinstance(extras, dict):  # named model-specific tokens
        named.update({k: _as_added_token(v) for k, v in extras.items()})
        extras = []
    extras = [_as_added_token(t) for t in extras]

    encoder = {t.content for t in backend.get_added_tokens_decoder().values()} | set(by_content)
    for token in (*named.values(), *extras):
        if str(token) not in encoder and token not in to_add:
            to_add.append(token)
    named_texts = {str(t) for t in named.values()}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in named_texts:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)
    return {key: str(token) for key, token in named.items()}


def find_chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    """The folder's chat template: one string, or named templates (a dict) as transformers keeps them."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "additional_chat_templates").is_dir():
        for file in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template or _read_json(folder / "chat_template.json").get("chat_template")


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of tokenization spaces (for WordPiece-style decoders)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


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
