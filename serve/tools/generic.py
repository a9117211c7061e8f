"""The generic tool-call format, for a model whose chat template teaches none that lmkit knows (``generic``):

  a call     ``{"tool_calls": [{"name": "NAME", "arguments": {...}}, ...]}``
  an answer  ``{"response": "TEXT"}``

A system message (prepended, or added to the chat's own) lists the tools (name, description, parameters schema)
and asks for one of these two objects; a grammar holds the answer to them whatever ``tool_choice`` is
(grammar.py generic_grammar: ``auto`` either, ``required`` a call, a named function a call of it). Earlier calls
and tool results are written into the history as plain messages of the same format, which any template renders:
an assistant message's calls as its text, the results of consecutive ``tool`` messages as one user message
``{"tool_results": [{"name": ..., "content": ...}]}``.

The parser gives a call object's calls as tool calls and the text of a response object as content, streamed as
it is written; other text is content as written. A request's own JSON structured output (a JSON schema,
json_object) is the response's value, ``{"response": VALUE}``, and VALUE's JSON text the content
(GenericJsonAnswerParser).
"""

from __future__ import annotations

import json
import re

from lmkit.serve.tools.base import WS, RenderChat, ToolParser
from lmkit.serve.tools.json_reader import StringReader, ValueScanner

CALLS_KEY, RESPONSE_KEY, RESULTS_KEY = "tool_calls", "response", "tool_results"

_JSON_WS = "[ \t\r\n]*"
_OPENING = re.compile(f'{_JSON_WS}{{{_JSON_WS}"({CALLS_KEY}|{RESPONSE_KEY})"{_JSON_WS}:')

INSTRUCTIONS = (
    "You can call tools to help with the user's request. The tools, one a line, each with the JSON schema of its "
    'arguments as "parameters":\n{tools}\n\n'
    "Answer with one JSON object and nothing else, either "
    '{"tool_calls": [{"name": "TOOL_NAME", "arguments": {...}}]} to call one or more tools (their results come '
    'back to you as {"tool_results": [...]}), or {"response": "YOUR ANSWER"} to answer the user.')
"""The system text that teaches the format; ``{tools}`` stands for the tools, one JSON definition a line."""


def tools_text(tools: list[dict]) -> str:
    """INSTRUCTIONS for OpenAI's tool definitions (``{"type": "function", "function": {...}}``)."""
    lines = []
    for tool in tools:
        function = tool["function"]
        entry = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return INSTRUCTIONS.replace("{tools}", "\n".join(lines))


def _result_value(text: str):
    """A tool result as it is written into its message: a JSON object or array as that value, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (dict, list)) else text


def generic_messages(messages: list[dict], tools: list[dict] | None, system_role: bool = True) -> list[dict]:
    """``messages`` (as templates read them: ChatMessage.template_data) in the generic format, for a template
    that knows no tool calls: the assistant's calls as the text of its message, consecutive tool results as one
    user message, and with ``tools`` their INSTRUCTIONS added to the chat's first system (or developer) message,
    or else in a system message of their own (``system_role``) or before the first message's text. The messages
    given are not changed."""
    out: list[dict] = []
    results: dict[int, list[dict]] = {}  # index in out -> the tool results of that user message
    names: dict[str, str] = {}  # call id -> function name
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                names[call.get("id")] = call["function"]["name"]
                calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            text = json.dumps({CALLS_KEY: calls}, ensure_ascii=False)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            out.append(m)
        elif m["role"] == "tool":
            result = {"name": m.get("name") or names.get(m.get("tool_call_id")),
                      "content": _result_value(m.get("content", ""))}
            if result["name"] is None:
                del result["name"]
            if len(out) - 1 not in results:
                results[len(out)] = []
                out.append({"role": "user"})
            results[len(out) - 1].append(result)
        else:
            out.append(dict(m))
    for i, items in results.items():
        out[i]["content"] = json.dumps({RESULTS_KEY: items}, ensure_ascii=False)
    if tools:
        text = tools_text(tools)
        if out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0].get("content") else text
        elif system_role:
            out.insert(0, {"role": "system", "content": text})
        else:
            out[0]["content"] = f"{text}\n\n{out[0].get('content', '')}"
    return out


class GenericToolParser(ToolParser):
    """The answer is one JSON object: ``{"tool_calls": [...]}`` gives its calls (each streamed as it is written,
    CallReader), ``{"response": "..."}`` the string's text as content (decoded as it streams, StringReader); any
    other text is content as written. Text after the object is content, the whitespace before it layout. What
    does not parse before anything was sent is given back as the text it was."""

    name = "generic"
    constrains_auto = True
    answers_json = False
    """Whether the response is a JSON value of the request's own schema, its text the content (with_json_answers),
    rather than a string."""

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "start"
        self._raw = ""  # the text read while nothing was sent
        self._answered = False  # the response's value has begun
        self._string: StringReader | None = None
        self._value: ValueScanner | None = None

    @classmethod
    def with_json_answers(cls) -> type[GenericToolParser]:
        """The format whose response holds a structured output of the request's own (a JSON value, grammar.py
        generic_grammar's ``answer_schema``), given as the JSON text it is."""
        return GenericJsonAnswerParser

    @classmethod
    def render_prompt(cls, render: RenderChat, messages: list[dict], tools: list[dict] | None) -> str:
        """The template gets the chat in the generic format (generic_messages) and no tools; where it refuses a
        system message of lmkit's own, the instructions go before the first message's text."""
        try:
            return render(generic_messages(messages, tools), None)
        except ValueError:
            if not tools or messages[0]["role"] in ("system", "developer"):
                raise
            return render(generic_messages(messages, tools, system_role=False), None)

    @property
    def _sent(self) -> bool:
        return bool(self.calls) or self._answered

    def _take(self, n: int) -> None:
        self._raw += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _skip_ws(self) -> bool:
        """Consumes whitespace; True when text follows it (else there is nothing more to read yet)."""
        self._take(len(self._buffer) - len(self._buffer.lstrip(WS)))
        return bool(self._buffer)

    def _give_back(self) -> bool:
        """The rest is content as written (with what was read, when nothing was sent)."""
        self._content.append(self._buffer if self._sent else self._raw + self._buffer)
        self._buffer, self.state = "", "content"
        return True

    def _step(self, final: bool) -> bool:
        state = self.state
        if state == "content":
            self._content.append(self._buffer)
            self._buffer = ""
            return False
        if state == "start":
            match = _OPENING.match(self._buffer)
            if match is None:
                if not final and _may_open(self._buffer):
                    return False
                return self._give_back()
            self._take(match.end())
            self.state = "calls" if match.group(1) == CALLS_KEY else "response_open"
            return True
        if state == "after":  # the object is closed: whitespace is layout, text content
            self._buffer = self._buffer.lstrip(WS)
            if not self._buffer:
                return False
            self.state = "content"
            return True
        if state == "call":
            reader = self._reader
            used = reader.feed(self._buffer)
            self._take(used)
            if reader.failed:
                if reader.name is None and self.calls:  # an earlier call was sent: this one's text comes back
                    self._buffer = reader.raw + self._buffer
                return self._give_back()
            if not reader.done:
                return False
            if reader.arguments is None:
                self._add_arguments("{}")
            self.state = "calls_next"
            return True
        if state == "response_json":  # the value's text, up to where it ends
            value, used = self._value, 0
            for ch in self._buffer:
                if value.ends_before(ch):
                    value.done = True
                    break
                value.push(ch)
                used += 1
                if value.done:
                    break
            self._content.append(self._buffer[:used])
            self._buffer = self._buffer[used:]
            if not value.done:
                return False
            self.state = "close"
            return True
        if state == "response":
            text, used = self._string.feed(self._buffer, final)
            self._content.append(text)
            self._buffer = self._buffer[used:]
            if not self._string.done:
                return False
            self.state = "close"
            return True
        if not self._skip_ws():  # the states that read one character of structure
            return False
        ch = self._buffer[0]
        if state == "calls" and ch == "[":
            self._take(1)
            self._start_reading("call")
        elif state == "calls_next" and ch in ",]":
            self._take(1)
            if ch == ",":
                self._start_reading("call")
            else:
                self.state = "close"
        elif state == "response_open" and self.answers_json:
            self._answered, self._value, self.state = True, ValueScanner(ch), "response_json"
            self._content.append(ch)
            self._buffer = self._buffer[1:]
            if self._value.done:
                self.state = "close"
        elif state == "response_open" and ch == '"':
            self._take(1)
            self._answered, self._string, self.state = True, StringReader(), "response"
        elif state == "close" and ch == "}":
            self._take(1)
            self.state = "after"
        else:
            return self._give_back()
        return True

    def _finish(self) -> None:
        """The answer ended: an object cut short before anything was sent is given back as the text it was; one
        cut after stays as sent."""
        if self.state not in ("content", "after") and not self._sent:
            self._content.append(self._raw + self._buffer)
        self._buffer = ""


def _may_open(text: str) -> bool:
    """Whether ``text`` may still grow into the opening of a call or response object (_OPENING)."""
    rest = text.lstrip(WS)
    if not rest:
        return True
    if rest[0] != "{":
        return False
    rest = rest[1:].lstrip(WS)
    for key in (CALLS_KEY, RESPONSE_KEY):
        quoted = f'"{key}"'
        if quoted.startswith(rest) or (rest.startswith(quoted) and not rest[len(quoted):].lstrip(WS)):
            return True
    return False


class GenericJsonAnswerParser(GenericToolParser):
    """The generic format whose response is ``{"response": VALUE}``, VALUE a JSON value of the request's own
    structured output: VALUE's text is the content, as written."""

    answers_json = True
