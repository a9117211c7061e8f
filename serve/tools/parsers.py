"""Tool-call parsers, one per format (``--tool-call-parser``, or the one the chat template speaks), and the
registry that names them. What they share (the streaming contract, the call and delta shapes): base.py.

Formats:
  hermes        Qwen2.5, Qwen3, Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated
  llama3_json   Llama 3.1-3.3: the answer is ``{"name": ..., "parameters": {...}}`` (after an optional
                ``<|python_tag|>``), several separated by ``;``
  mistral       ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or ``[TOOL_CALLS]name[ARGS]{...}`` repeated
  qwen3_coder   Qwen3-Coder, Qwen3.5: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...``
                ``</function>\\n</tool_call>``, repeated
  openai        gpt-oss (harmony): ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``
                ``{...}<|call|>``, as the harmony reasoning parser passes a call's message on (serve/reasoning.py)
  gemma4        Gemma 4: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``, repeated (Gemma's value
                syntax: bare keys, strings between <|"|> marks), each call given out whole
  generic       any other template: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or
                ``{"response": "..."}``, taught by a system message and held to by a grammar (generic.py)
"""

from __future__ import annotations

import json
import secrets

from lmkit.serve.reasoning import CALL, CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, RETURN, START, held_prefix
from lmkit.serve.tools.base import WS, ToolCall, ToolCallDelta, ToolParser, merge_deltas
from lmkit.serve.tools.generic import GenericToolParser

__all__ = ["ToolCall", "ToolCallDelta", "ToolParser", "merge_deltas", "HermesParser", "Llama3JsonParser",
           "MistralParser", "Qwen3CoderParser", "OpenAIToolParser", "Gemma4ToolParser", "GenericToolParser",
           "GEMMA4_QUOTE", "gemma_to_json", "TOOL_PARSERS", "tool_parser_class", "detect_tool_parser"]


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end)

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if not self._text_until(self.start, final):
                return False
            self._start_reading("call")
            return True
        if self.state == "call":
            return self._read_call(self.start, "close", "text")
        found = self._expect(self.end, final)  # close
        if found is None:
            return False
        self.state = "text"
        return True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    markers = (python_tag,)
    supports_parallel = False  # Llama 3.1's template refuses a message of several calls

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "start"

    def _step(self, final: bool) -> bool:
        if self.state == "start":
            if self._expect(self.python_tag, final) is None:
                return False
            self.state = "answer"
            return True
        if self.state == "answer":  # a call when it opens with {, else content (whitespace and all)
            rest = self._buffer.lstrip(WS)
            if not rest and not final:
                return False
            if rest.startswith("{"):
                self._buffer = rest
                self._start_reading("call")
            else:
                self.state = "content"
            return True
        if self.state == "content":
            self._content.append(self._buffer)
            self._buffer = ""
            return False
        if self.state == "call":
            return self._read_call("", "separator", "content")
        found = self._expect(";", final)  # separator
        if found is None:
            return False
        if found:
            self._start_reading("call")
        else:
            self._buffer, self.state = self._buffer.lstrip(WS), "content"  # the whitespace after a call is layout
        return True


class MistralParser(ToolParser):
    name = "mistral"
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    markers = (marker, args_marker)

    @classmethod
    def new_call_id(cls) -> str:  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(cls.id_alphabet) for _ in range(9))

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if not self._text_until(self.marker, final):
                return False
            self.state = "after_marker"
            return True
        if self.state == "after_marker":
            self._buffer = self._buffer.lstrip(WS)
            if not self._buffer:
                return False
            if self._buffer.startswith("["):
                self._buffer = self._buffer[1:]
                self._start_reading("array_item")
            else:
                self.state = "name"
            return True
        if self.state == "name":  # name[ARGS]{...}
            at = self._buffer.find(self.args_marker)
            if at < 0:
                if final:
                    self._content.append(self.marker + self._buffer)
                    self._buffer, self.state = "", "text"
                return False
            self._start_call(self._buffer[:at].strip())
            self._buffer = self._buffer[at + len(self.args_marker):]
            self._start_reading("args")
            self._reader.start_value(self.calls[-1].name)
            return True
        if self.state == "args":
            return self._read_call("", "text", "text")
        if self.state == "array_item":
            return self._read_call(self.marker + "[", "array_next", "text")
        found = self._expect(",", final)  # array_next
        if found is None:
            return False
        if found:
            self._start_reading("array_item")
            return True
        if self._expect("]", final) is None:
            return False
        self.state = "text"
        return True


class Qwen3CoderParser(ToolParser):
    """XML calls; each parameter's text, up to the first ``</parameter>`` (one line break on either side is
    layout), is converted by the function's parameter schema (a string stays text, other types are read as JSON,
    falling back to the text), and string values stream as they are written."""

    name = "qwen3_coder"
    start, end = "<tool_call>", "</tool_call>"
    param_end = "</parameter>"
    markers = (start, end)

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if not self._text_until(self.start, final):
                return False
            self.state = "function"
            return True
        if self.state == "function":  # <function=NAME>, else <tool_call> was text
            head = "<function="
            rest = self._buffer.lstrip(WS)
            at = rest.find(">", len(head)) if rest.startswith(head) else -1
            if at < 0:
                if not final and (head.startswith(rest) or rest.startswith(head)):
                    return False
                self._content.append(self.start)
                self.state = "text"
                return True
            self._start_call(rest[len(head):at].strip())
            self._buffer = rest[at + 1:]
            self.state, self._num_params = "parameter", 0
            return True
        if self.state == "parameter":
            found = self._expect("<parameter=", final)
            if found is None:
                return False
            if found:
                at = self._buffer.find(">")
                if at < 0:  # the key is still being written
                    self._buffer = "<parameter=" + self._buffer
                    return False
                key = self._buffer[:at].strip()
                self._buffer = self._buffer[at + 1:]
                self._param, self._is_text = key, self._param_type(key) == "string"
                self._add_arguments(("{" if self._num_params == 0 else ", ") + json.dumps(key) + ": "
                                    + ('"' if self._is_text else ""))
                self._num_params += 1
                self._value = ""
                self.state = "value_start"
                return True
            closed = self._expect("</function>", final)
            if closed is None:
                return False
            self._add_arguments("}" if self._num_params else "{}")
            self.state = "close"
            return True
        if self.state == "value_start":  # the line break after the tag is layout
            if not self._buffer and not final:
                return False
            if self._buffer.startswith("\n"):
                self._buffer = self._buffer[1:]
            self.state = "value"
            return True
        if self.state == "value":  # up to the first </parameter>, less the line break before it (layout)
            at = self._buffer.find(self.param_end)
            if at >= 0:
                piece = self._buffer[:at - 1] if self._buffer[:at].endswith("\n") else self._buffer[:at]
                self._buffer = self._buffer[at + len(self.param_end):]
            else:
                keep = 0 if final else max(held_prefix(self._buffer, "\n" + self.param_end),
                                           held_prefix(self._buffer, self.param_end))
                piece = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(piece):]
            if self._is_text:
                self._add_arguments(json.dumps(piece, ensure_ascii=False)[1:-1])
            else:
                self._value += piece
            if at < 0:
                return False
            self._add_arguments('"' if self._is_text else self._json_value(self._value))
            self.state = "parameter"
            return True
        found = self._expect(self.end, final)  # close
        if found is None:
            return False
        self.state = "text"
        return True

    def _param_type(self, key: str):
        schema = self.tools.get(self.calls[-1].name) or {}
        prop = (schema.get("properties") or {}).get(key) or {}
        return prop.get("type", "string") if isinstance(prop, dict) else "string"

    @staticmethod
    def _json_value(text: str) -> str:
        try:
            return json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            return json.dumps(text, ensure_ascii=False)


class OpenAIToolParser(ToolParser):
    """Tool calls of gpt-oss (``openai``, vLLM's name), in the canonical form the harmony reasoning parser
    (``openai_gptoss``) passes on: it reads nothing without that parser (the server refuses the pair apart)."""

    name = "openai"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
    supports_parallel = False  # the template renders one call per assistant message
    opening = f"{START}assistant to={FUNCTIONS}"

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if not self._text_until(self.opening, final, strip_after_call=False):
                return False
            self.state = "header"
            return True
        if self.state == "header":
            at = self._buffer.find(MESSAGE)
            if at < 0:
                if final:  # a header cut short: nothing was sent, it stays text
                    self._content.append(self.opening + self._buffer)
                    self._buffer, self.state = "", "text"
                return False
            name = self._buffer[:at].split(CHANNEL, 1)[0].split()[0] if self._buffer[:at].strip() else ""
            self._buffer = self._buffer[at + len(MESSAGE):]
            self._start_call(name)
            self.state = "arguments"
            return True
        at = self._buffer.find(CALL)  # arguments, up to <|call|>
        if at >= 0:
            self._add_arguments(self._buffer[:at])
            self._buffer, self.state = self._buffer[at + len(CALL):], "text"
            if not self.calls[-1].arguments:
                self._add_arguments("{}")
            return True
        keep = 0 if final else held_prefix(self._buffer, CALL)
        self._add_arguments(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False


GEMMA4_QUOTE = '<|"|>'  # Gemma 4's string delimiter (a special token)


class GemmaValueError(ValueError):
    pass


def gemma_to_json(text: str) -> object:
    """A value in Gemma 4's call syntax as Python: ``{key:value,...}`` with bare keys (or quoted ones), strings
    between ``<|"|>`` marks (anything inside, quotes and braces included), ``[...]`` lists, bare numbers, ``true``,
    ``false`` and ``null``; a bare word that is none of these is a string. GemmaValueError when it is no value."""
    value, end = _gemma_value(text, _skip(text, 0))
    if _skip(text, end) != len(text):
        raise GemmaValueError(f"text after the value at {end}")
    return value


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _gemma_string(text: str, i: int) -> tuple[str, int]:
    end = text.find(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
    if end < 0:
        raise GemmaValueError("an unclosed string")
    return text[i + len(GEMMA4_QUOTE):end], end + len(GEMMA4_QUOTE)


def _gemma_value(text: str, i: int) -> tuple[object, int]:
    if text.startswith(GEMMA4_QUOTE, i):
        return _gemma_string(text, i)
    if i < len(text) and text[i] in "{[":
        close, items, i = "}" if text[i] == "{" else "]", [], _skip(text, i + 1)
        while i < len(text) and text[i] != close:
            if close == "}":
                if text.startswith(GEMMA4_QUOTE, i):
                    key, i = _gemma_string(text, i)
                else:
                    colon = text.find(":", i)
                    if colon < 0:
                        raise GemmaValueError("a key without a value")
                    key, i = text[i:colon].strip(), colon
                i = _skip(text, i)
                if not text.startswith(":", i):
                    raise GemmaValueError("a key without a value")
                value, i = _gemma_value(text, _skip(text, i + 1))
                items.append((key, value))
            else:
                value, i = _gemma_value(text, i)
                items.append(value)
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            elif not text.startswith(close, i):
                raise GemmaValueError(f"expected , or {close} at {i}")
        if i >= len(text):
            raise GemmaValueError(f"an unclosed {close}")
        return (dict(items) if close == "}" else items), i + 1
    end = i
    while end < len(text) and text[end] not in ",}]" and not text.startswith(GEMMA4_QUOTE, end):
        end += 1
    word = text[i:end].strip()
    if not word:
        raise GemmaValueError(f"no value at {i}")
    try:
        return json.loads(word), end
    except ValueError:
        return word, end


class Gemma4ToolParser(ToolParser):
    """Gemma 4's calls: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, repeated, in Gemma's own value syntax
    (gemma_to_json), given as JSON arguments. A call goes out whole once closed (its name and arguments in one
    delta): one that does not parse is given back as the text it was. The ``<|tool_response>`` a model writes after
    its calls (the template's cue for the results) is layout."""

    name = "gemma4"
    start, end, prefix, response = "<|tool_call>", "<tool_call|>", "call:", "<|tool_response>"
    markers = (start, end, GEMMA4_QUOTE, response)

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if self._in_layout:  # right after a call: whitespace and the results' cue are layout
                self._buffer = self._buffer.lstrip(WS)
                if self._buffer.startswith(self.response):
                    self._buffer = self._buffer[len(self.response):]
                    return True
                if not final and self._buffer and self.response.startswith(self._buffer):
                    return False
            if not self._text_until(self.start, final):
                return False
            self.state = "call"
            return True
        at = self._call_end()  # call: held until it closes
        if at < 0:
            if final:  # cut short: nothing was sent, it stays text
                self._content.append(self.start + self._buffer)
                self._buffer, self.state = "", "text"
            return False
        body, self._buffer = self._buffer[:at], self._buffer[at + len(self.end):]
        self.state = "text"
        brace = body.find("{")
        name = body[len(self.prefix):brace].strip() if body.startswith(self.prefix) and brace > 0 else ""
        try:
            arguments = gemma_to_json(body[brace:]) if name else None
        except GemmaValueError:
            arguments = None
        if not isinstance(arguments, dict):
            self._content.append(self.start + body + self.end)
            return True
        self._start_call(name)
        self._add_arguments(json.dumps(arguments, ensure_ascii=False))
        return True

    def _call_end(self) -> int:
        """Where the closing tag is in the buffer, outside the call's strings; -1 while it has not come."""
        i = 0
        while True:
            end, quote = self._buffer.find(self.end, i), self._buffer.find(GEMMA4_QUOTE, i)
            if quote < 0 or 0 <= end < quote:
                return end
            close = self._buffer.find(GEMMA4_QUOTE, quote + len(GEMMA4_QUOTE))
            if close < 0:
                return -1
            i = close + len(GEMMA4_QUOTE)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, OpenAIToolParser,
                        Gemma4ToolParser, GenericToolParser)}


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def detect_tool_parser(chat_template: str | None) -> type[ToolParser]:
    """The tool-call format a chat template teaches its model, from the markers it writes; ``generic`` where it
    teaches none lmkit knows (or there is no template)."""
    t = chat_template or ""
    if CHANNEL in t and CALL in t:
        return OpenAIToolParser
    if Gemma4ToolParser.start in t and Gemma4ToolParser.end in t:
        return Gemma4ToolParser
    if "<function=" in t and "<parameter=" in t:
        return Qwen3CoderParser
    if "<tool_call>" in t:
        return HermesParser
    if "[TOOL_CALLS]" in t:
        return MistralParser
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return Llama3JsonParser
    return GenericToolParser
