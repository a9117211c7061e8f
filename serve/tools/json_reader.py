"""Reads one JSON tool call ``{"name": ..., "arguments": {...}}`` as its text streams in, so that the call's name
can be sent once it is complete and its arguments as fragments while they are written.

The arguments are the model's own JSON text (not re-serialized): streamed fragments join to exactly what a whole
answer carries. Keys may come in any order; arguments written before the name are sent with it.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class ValueScanner:
    """Finds where one JSON value ends, one character at a time (strings, escapes, nesting). It checks
    structure, not grammar: the text of a finished value is parsed by json.loads."""

    def __init__(self, first: str):
        self.depth = 1 if first in "{[" else 0
        self.in_string = first == '"'
        self.escape = False
        self.scalar = first not in '{["'
        self.done = False

    def ends_before(self, ch: str) -> bool:
        """True when a scalar (number, true, false, null) ends before ``ch`` (not part of the value)."""
        return self.scalar and ch in _WS + ",}]"

    def push(self, ch: str) -> None:
        """Reads the value's next character (not the first one)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
        elif not self.scalar:
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0


class CallReader:
    """One call object. ``feed`` reads characters and returns how many it used (it stops after the object's
    closing brace); ``on_name(name)`` and ``on_arguments(fragment)`` report as soon as each is known.
    ``failed`` is set when the text is not such an object (``raw`` is what it read)."""

    def __init__(self, on_name, on_arguments, name_key: str = "name",
                 argument_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.on_name = on_name
        self.on_arguments = on_arguments
        self.name_key = name_key
        self.argument_keys = argument_keys
        self.state = "open"
        self.raw = ""
        self.name: str | None = None
        self.arguments: str | None = None  # complete arguments text, once read
        self.done = False
        self.failed = False
        self._key = ""
        self._token = ""  # the key or value text being read
        self._value: ValueScanner | None = None
        self._streaming = False
        self._bare = False

    def start_value(self, name: str, key: str = "arguments") -> None:
        """Reads the bare arguments value of the call ``name`` (already reported) instead of a whole object:
        Mistral's ``name[ARGS]{...}``."""
        self.name, self._key, self.state, self._bare = name, key, "value_start", True

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done or self.failed:
                return i
            if not self._push(ch):
                self.failed = True
                return i
            self.raw += ch
        return len(text)

    def _push(self, ch: str) -> bool:
        state = self.state
        if state == "value":
            if self._value.ends_before(ch):
                self._end_value()
                return self._push(ch)
            self._value.push(ch)
            self._take(ch)
            if self._value.done:
                self._end_value()
            return True
        if ch in _WS and state != "key":
            return True
        if state == "open":
            self.state = "key_or_end"
            return ch == "{"
        if state == "key_or_end":
            if ch == "}":
                self.done = True
                return self.name is not None
            if ch == ",":
                return True
            if ch == '"':
                self.state, self._token = "key", ""
                return True
            return False
        if state == "key":
            if ch == '"' and (len(self._token) - len(self._token.rstrip("\\"))) % 2 == 0:
                self._key, self.state = json.loads(f'"{self._token}"'), "colon"
            else:
                self._token += ch
            return True
        if state == "colon":
            self.state = "value_start"
            return ch == ":"
        if state == "value_start":
            self._value, self._token, self.state = ValueScanner(ch), "", "value"
            self._streaming = self._key in self.argument_keys and self.name is not None and ch in "{["
            self._take(ch)
            if self._value.done:
                self._end_value()
            return True
        return False

    def _take(self, ch: str) -> None:
        self._token += ch
        if self._streaming:
            self.on_arguments(ch)

    def _end_value(self) -> None:
        text, key = self._token, self._key
        self.state, self._value = "key_or_end", None
        if key == self.name_key and self.name is None:
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.failed = True
                return
            self.name = name
            self.on_name(name)
            if self.arguments is not None:  # written before the name
                self.on_arguments(self.arguments)
        elif key in self.argument_keys and self.arguments is None:
            if not self._streaming and text.startswith('"'):  # arguments given as a JSON string
                try:
                    text = json.loads(text)
                except ValueError:
                    pass
            self.arguments = text
            if self.name is not None and not self._streaming:
                self.on_arguments(text)
        self._streaming = False
        self.done = self._bare


class StringReader:
    """The text of one JSON string as it streams in, read from after its opening quote. ``feed(text, final)``
    returns (the decoded text, how many characters of ``text`` it used); ``done`` once the closing quote is used
    (what follows it is not). An escape is decoded once it is whole (json.loads), a surrogate pair as one
    character; a lone surrogate becomes U+FFFD and an invalid escape stays as written. An escape cut short by
    ``final`` is dropped (half a character)."""

    def __init__(self):
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, int]:
        out: list[str] = []
        i = 0
        while i < len(text) and not self.done:
            ch = text[i]
            if ch == '"':
                self.done = True
                i += 1
            elif ch != "\\":
                j = i
                while j < len(text) and text[j] not in '"\\':
                    j += 1
                out.append(text[i:j])
                i = j
            else:
                size = _escape_size(text, i)
                if size is None:  # not whole yet
                    if final:
                        i = len(text)
                    break
                out.append(_decode_escape(text[i:i + size]))
                i += size
        return "".join(out), i


_HEX = set("0123456789abcdefABCDEF")


def _escape_size(text: str, i: int) -> int | None:
    """Characters of the escape at ``text[i]`` (a backslash); None while the text ends before that is known."""
    if i + 1 >= len(text):
        return None
    if text[i + 1] != "u":
        return 2
    digits = text[i + 2:i + 6]
    if not all(c in _HEX for c in digits):
        return 2  # invalid: kept as written
    if len(digits) < 4:
        return None
    if not 0xD800 <= int(digits, 16) < 0xDC00:
        return 6
    after = text[i + 6:i + 12]  # a high surrogate: one character with the low surrogate that follows, if any
    if not "\\u".startswith(after[:2]) or not all(c in _HEX for c in after[2:]):
        return 6
    if len(after) < 6:
        return None
    return 12 if 0xDC00 <= int(after[2:], 16) < 0xE000 else 6


def _decode_escape(escape: str) -> str:
    try:
        text = json.loads(f'"{escape}"')
    except ValueError:
        return escape
    return "".join("\ufffd" if 0xD800 <= ord(c) < 0xE000 else c for c in text)
