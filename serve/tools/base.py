"""What every tool-call parser shares: the call and delta shapes, and ToolParser, which splits one completion's
text, as it streams, into content and OpenAI tool-call deltas (its formats: parsers.py, generic.py).

A call's name is sent once, then its arguments as fragments of the model's JSON (joined, they are exactly the
arguments of the whole answer). Text that only begins a marker is held back until it is decided, so markup
never reaches ``content``; a call that does not parse (in ``auto``) is given back as the text it was.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Callable

from lmkit.serve.reasoning import held_prefix
from lmkit.serve.tools.json_reader import CallReader

WS = " \t\r\n"

RenderChat = Callable[[list[dict], "list[dict] | None"], str]
"""``render(messages, tools)``: the chat template's text of template-ready messages and OpenAI tool definitions
(None: no tools); raises ValueError when the template cannot render them."""


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of each call has its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def chunk(self) -> dict:
        """OpenAI's ``delta.tool_calls`` item."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCall:
    """A whole call, as the non-streamed answer carries it."""

    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Joins consecutive argument fragments of the same call (one chunk per call and step)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.name is None:
            out[-1].arguments += d.arguments
        else:
            out.append(ToolCallDelta(d.index, d.arguments, d.id, d.name))
    return out


class ToolParser:
    """One completion's tool calls. ``feed(text, final)`` returns (content delta, tool-call deltas)."""

    name = ""
    markers: tuple[str, ...] = ()
    """The format's marker texts (decoding keeps them where they are special tokens)."""
    supports_parallel = True
    """Whether the family's template can render several calls in one assistant message."""
    constrains_auto = False
    """Whether answers are held to the format by a grammar with ``tool_choice: "auto"`` too (else only a
    required or named call is)."""
    id_alphabet = string.ascii_letters + string.digits

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools  # name -> parameters schema
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self.state = "text"
        self._layout_done = 0  # the calls after which content has begun (the whitespace after a call is layout)

    @classmethod
    def new_call_id(cls) -> str:
        return "call_" + "".join(secrets.choice(cls.id_alphabet) for _ in range(24))

    @classmethod
    def render_prompt(cls, render: RenderChat, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt of a chat: ``messages`` (as templates read them: ChatMessage.template_data) and the
        offered ``tools`` (OpenAI's definitions; None: none offered) rendered by the chat template, which writes
        the tools, earlier calls and tool results in its family's format. ValueError when it cannot."""
        return render(messages, tools)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        while self._step(final):
            pass
        if final:
            self._finish()
        content, deltas = "".join(self._content), merge_deltas(self._deltas)
        self._content, self._deltas = [], []
        return content, deltas

    # ---- for the formats ------------------------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Consumes what it can of self._buffer; True when it should be called again."""
        raise NotImplementedError

    def _finish(self) -> None:
        """The answer ended: what is still held is content (a call cut short stays as sent)."""
        if self._buffer and not (self.calls and self.state != "text"):
            self._content.append(self._buffer)
        self._buffer = ""

    def _text_until(self, marker: str, final: bool, strip_after_call: bool = True) -> bool:
        """Content up to ``marker`` (True: found and consumed), holding back a possible start of it."""
        if strip_after_call:
            self._skip_layout()
        at = self._buffer.find(marker)
        if at >= 0:
            self._content.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            return True
        keep = 0 if final else held_prefix(self._buffer, marker)
        self._content.append(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    @property
    def _in_layout(self) -> bool:
        """Whether the text read now directly follows a call (nothing but whitespace between)."""
        return bool(self.calls) and self._layout_done != len(self.calls)

    def _skip_layout(self) -> None:
        """Drops the whitespace right after a call (layout, between and after calls); once other text follows
        the call, whitespace is content again, wherever the stream is cut."""
        if self._in_layout:
            self._buffer = self._buffer.lstrip(WS)
            if self._buffer:
                self._layout_done = len(self.calls)

    def _expect(self, marker: str, final: bool) -> bool | None:
        """Whether ``marker`` comes next, after any whitespace: True when it does (both are consumed), None while
        undecided, False when other text is there (the buffer is left as it is, whitespace and all)."""
        rest = self._buffer.lstrip(WS)
        if rest.startswith(marker):
            self._buffer = rest[len(marker):]
            return True
        if not final and marker.startswith(rest):
            return None
        return False

    def _start_call(self, name: str) -> None:
        call = ToolCall(self.new_call_id(), name)
        self.calls.append(call)
        self._deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, name))

    def _add_arguments(self, fragment: str) -> None:
        if fragment:
            self.calls[-1].arguments += fragment
            self._deltas.append(ToolCallDelta(len(self.calls) - 1, fragment))

    def _start_reading(self, state: str) -> None:
        """Enters ``state``, in which _read_call reads a new JSON call."""
        self.state, self._reader = state, CallReader(self._start_call, self._add_arguments)

    def _read_call(self, prefix: str, done_state: str, failed_state: str) -> bool:
        """Feeds the buffer to the call being read. Returns False while it needs more text; then enters
        ``done_state``, or ``failed_state`` when the text is no call (given back as content, after ``prefix``,
        unless the call was already sent) and returns True."""
        reader = self._reader
        used = reader.feed(self._buffer)
        self._buffer = self._buffer[used:]
        if reader.failed:
            if reader.name is None:
                self._content.append(prefix + reader.raw)
            self.state = failed_state
        elif reader.done:
            if reader.arguments is None:
                self._add_arguments("{}")
            self.state = done_state
        else:
            return False
        return True

