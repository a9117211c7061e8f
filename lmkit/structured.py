"""Structured output: a completion constrained to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (its JSON-schema, regex and Lark front ends). The engine's sampler applies the
grammar's token mask on every step (csrc/engine/grammar.h) and ends the completion when the grammar is complete,
so an answer that finishes with "stop" is in the grammar: a JSON answer parses and validates against its schema.
Compiled grammars are cached per engine by their text.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkit.tokenizer import check_valid_unicode

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON answers are laid out unless a schema says otherwise in its ``x-guidance`` options: on one line,
spaced as ``json.dumps`` spaces them (what models mostly write). Free whitespace lets a small model fill its
answer with blank lines."""

MAX_SCHEMA_NODES = 10_000
"""The most values (objects, arrays and scalars, keys not counted) a JSON schema may have: counted before
compiling, which takes seconds for a schema of this size (5,000 enum properties, 25,000 values: 4.2 s on a
Zen 1 core) and is refused by llguidance past ~15,000 properties only after the work."""

MAX_GRAMMAR_CHARS = 256 * 1024
"""The most characters of a regex, or of a grammar outside its ``%json`` schemas (each of those is a JSON schema,
held to MAX_SCHEMA_NODES). llguidance recurses once per link of a chain of rules or groups; the compile's thread
has a 512 MiB stack (csrc/engine/grammar.h), and the deepest 256 KiB grammar found needs 128-256 MiB."""

GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""How long a compile may take before its caller gets a StructuredOutputError (within the size limits above the
slowest found take ~2 s on a Zen 5 core). llguidance cannot be interrupted: an overdue compile finishes on its
thread, its result dropped, and the next compile for the same model waits for it, so there is one at a time."""

_GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per engine (a compiled JSON schema takes ~100 KB to a few MB)."""


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; ``str()`` names what is wrong."""


@dataclass
class StructuredOutput:
    """What a completion must match. Exactly one of the fields is set."""

    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text): the completion is one JSON value valid under it."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression (Rust ``regex`` syntax) the whole completion matches."""
    choice: list[str] | None = None
    """The completion is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: llguidance's Lark syntax, or GBNF / EBNF (``root ::= ...``), converted to Lark."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise StructuredOutputError(f"give exactly one of json, json_object, regex, choice, grammar; got "
                                        f"{', '.join(given) or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise StructuredOutputError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputError("choice must be a list of strings")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"{name} must be a non-empty string")
        if self.regex is not None and len(self.regex) > MAX_GRAMMAR_CHARS:
            raise StructuredOutputError(f"the regex has {len(self.regex):,} characters, more than the "
                                        f"{MAX_GRAMMAR_CHARS:,} allowed")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError("json must be a JSON schema: a dict or its JSON text")

    def source(self) -> tuple[str, str]:
        """(kind, text) as llguidance compiles it: kind is json_schema, regex or lark."""
        if self.json_object:
            return "json_schema", json.dumps({"type": "object", "x-guidance": JSON_LAYOUT})
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
                except RecursionError:
                    raise StructuredOutputError("the JSON schema is nested too deeply") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("a JSON schema is an object (or true/false)")
            nodes = _count_values(schema, MAX_SCHEMA_NODES)
            if nodes > MAX_SCHEMA_NODES:
                raise StructuredOutputError(f"the JSON schema has more than {MAX_SCHEMA_NODES:,} values (objects, "
                                            "arrays and scalars); split it or use $defs / $ref for repeated parts")
            if schema is True or schema == {}:
                schema = {"x-guidance": JSON_LAYOUT}
            elif isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": JSON_LAYOUT}
            try:
                return "json_schema", json.dumps(schema, ensure_ascii=False, sort_keys=False)
            except (TypeError, ValueError) as e:
                raise StructuredOutputError(f"the JSON schema cannot be serialised as JSON: {e}") from None
            except RecursionError:
                raise StructuredOutputError("the JSON schema is nested too deeply") from None
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:  # one terminal, so one lexer DFA: as rule alternatives, each choice is an item
            # of the parser's first row, which llguidance caps at 2,000 (100,000 choices compile in ~0.6 s so).
            # One json.dumps of the list, its separators made alternations: a quote inside a string is escaped, so
            # '", "' occurs only between items (100,000 choices: 7 ms holding the GIL, against 57 ms item by item).
            listed = json.dumps(self.choice, ensure_ascii=False)
            return "lark", "start: CHOICE\nCHOICE: " + listed[1:-1].replace('", "', '" | "')
        assert self.grammar is not None
        if "::=" in self.grammar:  # GBNF / EBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            _check_lark_size(self.grammar)  # the converter's work grows with it
            try:
                lark = gbnf_to_lark(self.grammar)
            except Exception as e:  # the converter raises plain exceptions for grammars it cannot read
                raise StructuredOutputError(f"the GBNF grammar cannot be converted: {e}") from None
        else:
            lark = self.grammar
        _check_lark_size(lark)
        return "lark", lark


def _check_lark_size(text: str) -> None:
    """Raises StructuredOutputError when ``text`` has more than MAX_GRAMMAR_CHARS characters outside its
    ``%json`` schemas, or one of those has more than MAX_SCHEMA_NODES values."""
    if len(text) <= MAX_GRAMMAR_CHARS and "%json" not in text:
        return
    decoder = json.JSONDecoder()
    outside = at = 0
    while (found := text.find("%json", at)) >= 0:
        outside += found - at
        start = found + len("%json")
        while start < len(text) and text[start] in " \t\r\n":
            start += 1
        try:
            schema, at = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):  # not a schema: counted as Lark, llguidance says why
            outside += start - found
            at = start
            continue
        if _count_values(schema, MAX_SCHEMA_NODES) > MAX_SCHEMA_NODES:
            raise StructuredOutputError(f"a %json schema of the grammar has more than {MAX_SCHEMA_NODES:,} values "
                                        "(objects, arrays and scalars)")
    outside += len(text) - at
    if outside > MAX_GRAMMAR_CHARS:
        where = " outside its %json schemas" if outside < len(text) else ""
        raise StructuredOutputError(f"the grammar has {outside:,} characters{where}, more than the "
                                    f"{MAX_GRAMMAR_CHARS:,} allowed")


def _count_values(value, limit: int) -> int:
    """The values in ``value`` (itself, and every dict value and list item below it), counted up to just past
    ``limit``; iterative, so any depth."""
    count, stack = 0, [value]
    while stack and count <= limit:
        v = stack.pop()
        count += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return count


_MAX_ERROR_CHARS = 300


def grammar_error_summary(message: str) -> str:
    """llguidance's message for a grammar it refused or a parse that failed, on one line and without its
    internals: the lines that say what is wrong (not the source excerpts with their carets, nor a parser state),
    at most _MAX_ERROR_CHARS characters."""
    if "panicked at" in message:  # a bug of the compiler on this input: its Rust source location says nothing
        return "the grammar compiler failed on this grammar"
    message = message.split("<state>")[0].split("<non-verbose/>")[0]
    said = []
    for line in message.splitlines():
        text = line.strip()
        excerpt = line.startswith(" ") and (text.startswith("^") or "|" in text[:6] or not said[-1:] or
                                            said[-1].endswith(":"))
        if text and not excerpt:
            said.append(text)
    summary = " ".join(said) or "the grammar failed"
    return summary if len(summary) <= _MAX_ERROR_CHARS else summary[: _MAX_ERROR_CHARS - 3] + "..."


def llguidance_library() -> Path:
    """The shared library of the installed llguidance package (its extension exports the C API)."""
    spec = importlib.util.find_spec("llguidance")
    if spec is None or not spec.submodule_search_locations:
        raise StructuredOutputError("structured output needs the llguidance package: pip install llguidance")
    for folder in spec.submodule_search_locations:
        libs = sorted(Path(folder).glob("_lib*.so")) + sorted(Path(folder).glob("_lib*.pyd"))
        if libs:
            return libs[0]
    raise StructuredOutputError(f"llguidance is installed at {list(spec.submodule_search_locations)} but has no "
                                "compiled library (_lib*.so): reinstall it (pip install --force-reinstall llguidance)")


class GrammarCache:
    """Compiles constraints for one model's vocabulary and keeps the most recent ones, and the refusals of the
    ones llguidance cannot compile. Thread-safe; compile off the event loop (a large schema takes milliseconds to
    seconds)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 capacity: int = _GRAMMAR_CACHE_SIZE, compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S):
        self._tokenizer_json = tokenizer_json
        self.compile_timeout_s = compile_timeout_s
        """Seconds a compile may take before it is refused (0: no limit); see GRAMMAR_COMPILE_TIMEOUT_S."""
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._tokenizer = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.num_compiled = 0
        """Grammars compiled (cache misses)."""

    def _grammar_tokenizer(self):
        from lmkit._ext import _engine

        with self._lock:
            if self._tokenizer is None:
                if not self._eos_token_ids:
                    raise StructuredOutputError("this model has no eos token id, which a grammar needs to end on")
                try:
                    self._tokenizer = _engine.GrammarTokenizer(str(llguidance_library()), self._tokenizer_json,
                                                               self._vocab_size, self._eos_token_ids)
                except ValueError as e:
                    raise StructuredOutputError(str(e)) from None
            return self._tokenizer

    def cached(self, constraint: StructuredOutput):
        """The compiled grammar of ``constraint`` when this cache holds it (its refusal raised as compile()
        raises it), else None: what can be answered without compiling."""
        compiled = self._lookup(constraint.source())
        if isinstance(compiled, StructuredOutputError):
            raise StructuredOutputError(str(compiled))
        return compiled

    def _lookup(self, key: tuple[str, str]):
        try:
            check_valid_unicode(key[1])
        except ValueError as e:  # the C API takes UTF-8, which a lone surrogate ("\ud800" in JSON) is not
            raise StructuredOutputError(f"the {key[0].replace('_', ' ')}: {e}") from None
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        return compiled

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar of ``constraint`` (an ``_engine.CompiledGrammar``); StructuredOutputError with
        llguidance's message when it is invalid or uses a feature llguidance does not support, or when it takes
        longer than compile_timeout_s to compile (refusals are cached too: sent again, it costs nothing)."""
        from lmkit._ext import _engine

        key = constraint.source()
        compiled = self._lookup(key)
        if compiled is None:
            tokenizer = self._grammar_tokenizer()
            try:
                compiled = _engine.CompiledGrammar(tokenizer, *key, timeout_s=self.compile_timeout_s)
            except ValueError as e:  # kept like a grammar: a client that sends it again costs no second compile
                compiled = StructuredOutputError(grammar_error_summary(str(e)))
            with self._lock:
                self.num_compiled += 1
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        if isinstance(compiled, StructuredOutputError):
            raise StructuredOutputError(str(compiled))
        return compiled
