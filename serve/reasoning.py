"""Reasoning parsers: a thinking model's ``<think>...</think>`` block goes to ``reasoning_content``, the rest to
``content``, as the text streams (``--reasoning-parser``); gpt-oss's harmony channels likewise (``openai_gptoss``,
below), and Gemma 4's thought channel (``gemma4``).

Where the thinking starts is read from the rendered prompt, so streamed and whole answers split alike: a prompt
that ends inside an open ``<think>`` (DeepSeek-R1 distills, Qwen3 thinking-2507 templates) starts the answer in
reasoning; a prompt that ends with a closed, empty block (Qwen3 with ``enable_thinking: false``) starts it in
content; otherwise the answer is reasoning when it opens with ``<think>``. ``deepseek_r1`` starts in reasoning
always (its models may leave out the opening tag). Reasoning cut short by max_tokens stays reasoning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (what to hold back until it is decided)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's reasoning markers."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_starts_inside: bool = False

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether an answer to this prompt begins inside the reasoning block."""
        return self.always_starts_inside or prompt_text.rstrip().endswith(self.start)

    def thinks_after(self, prompt_text: str) -> bool:
        """Whether an answer to this prompt may think first (so structured output starts after ``end``): not
        when the prompt closed the block already (thinking turned off by the template)."""
        return not prompt_text.rstrip().endswith(self.end)

    def parser(self, prompt_text: str) -> "ReasoningParser":
        return self.new_parser(self.starts_inside(prompt_text))

    def new_parser(self, inside: bool) -> "ReasoningParser":
        """A parser of one completion, which starts inside the reasoning block when ``inside``."""
        return ReasoningParser(self, inside)


class ReasoningParser:
    """One completion's split. ``feed`` returns (reasoning, content) deltas; the text it holds back is a possible
    start of a marker, given out once decided (or at ``final``)."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self.inside = inside
        self.state = "opening"  # opening -> reasoning -> content, or opening -> content (when not inside)
        self._buffer = ""
        self._strip_newlines = False  # the text right after an opening tag, or a closing one, starts clean

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while True:
            if self.state == "opening":
                head = self._buffer.lstrip()
                if head.startswith(self.fmt.start):
                    self._buffer = head[len(self.fmt.start):]
                    self.state, self._strip_newlines = "reasoning", True
                    continue
                if not final and self.fmt.start.startswith(head):  # may still become the opening tag
                    break
                self.state, self._strip_newlines = ("reasoning", True) if self.inside else ("content", False)
                continue
            if self.state == "reasoning":
                if self._strip_newlines:
                    self._buffer = self._buffer.lstrip("\n")
                    if not self._buffer and not final:
                        break
                    self._strip_newlines = False
                at = self._buffer.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(self._buffer[:at])
                    self._buffer = self._buffer[at + len(self.fmt.end):]
                    self.state, self._strip_newlines = "content", True
                    continue
                keep = 0 if final else held_prefix(self._buffer, self.fmt.end)
                reasoning.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            # content
            if self._strip_newlines:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer and not final:
                    break
                self._strip_newlines = False
            content.append(self._buffer)
            self._buffer = ""
            break
        return "".join(reasoning), "".join(content)


# ---- harmony (gpt-oss) ----------------------------------------------------------------------------------------
# OpenAI's harmony format (gpt-oss): an answer is a sequence of messages, each a header and a body,
# ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`` ended by ``<|end|>`` (more follows),
# ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call); the next message starts with
# ``<|start|>assistant``, which the chat template's generation prompt already wrote for the first. The recipient may
# also stand before the channel (``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>``).
#
#   analysis                              reasoning (``reasoning_content``)
#   final, commentary without recipient   content
#   commentary to=functions.NAME          a tool call of NAME, its body the JSON arguments
#
# The reasoning parser (``openai_gptoss``, vLLM's name) splits the channels as the text streams; a call's message
# goes on to the content in the canonical form ``<|start|>assistant to=functions.NAME<|channel|>commentary
# json<|message|>ARGS<|call|>``, where the tool parser (``openai``) reads it, so that with tools off a call stays
# visible as the text it was. Markers are special tokens: decoding keeps them for these parsers.

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
FUNCTIONS = "functions."
MAX_HEADER_CHARS = 512  # a header longer than this is not one: the text is content
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def call_text(name: str) -> str:
    """The canonical opening of a call's message (what the reasoning parser hands the tool parser)."""
    return f"{START}assistant to={FUNCTIONS}{name}{CHANNEL}commentary json{MESSAGE}"


class HarmonyFormat(ReasoningFormat):
    """The harmony reasoning format: its channels are the markers, not a <think> block."""

    def __init__(self):
        super().__init__("openai_gptoss", start=CHANNEL + "analysis" + MESSAGE, end=END)

    def starts_inside(self, prompt_text: str) -> bool:
        return False

    def thinks_after(self, prompt_text: str) -> bool:
        """Never after one token: a structured answer's grammar writes the channels itself (tools.grammar)."""
        return False

    def new_parser(self, inside: bool) -> "HarmonyParser":
        return HarmonyParser()


class HarmonyParser:
    """One completion's channels. ``feed`` returns (reasoning, content) deltas, as ReasoningParser's; text that
    may begin a marker is held back until decided."""

    def __init__(self):
        self.state = "header"  # header -> body -> between -> header ...
        self.kind = ""  # the body's: "reasoning", "content" or "call"
        self._buffer = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while True:
            if self.state == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    if final or len(self._buffer) > MAX_HEADER_CHARS:  # no header: what came is content
                        content.append(self._buffer)
                        self._buffer, self.state, self.kind = "", "body", "content"
                    break
                header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
                self.kind, opening = self._read_header(header)
                content.append(opening)
                self.state = "body"
                continue
            if self.state == "body":
                ends = [(at, m) for m in TERMINATORS if (at := self._buffer.find(m)) >= 0]
                out = reasoning if self.kind == "reasoning" else content
                if ends:
                    at, marker = min(ends)
                    out.append(self._buffer[:at])
                    if self.kind == "call":
                        content.append(CALL)
                    self._buffer = self._buffer[at + len(marker):]
                    self.state = "between"
                    continue
                keep = 0 if final else max(held_prefix(self._buffer, m) for m in TERMINATORS)
                out.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                if final and self.kind == "call":
                    content.append(CALL)  # a call cut short (max_tokens, or a grammar's end) still closes
                break
            # between messages: <|start|> and the next header; other text is content
            head = self._buffer.lstrip()
            if head.startswith(START):
                self._buffer, self.state = head[len(START):], "header"
                continue
            if not final and START.startswith(head):
                break
            self.state, self.kind = "body", "content"
        return "".join(reasoning), "".join(content)

    @staticmethod
    def _read_header(header: str) -> tuple[str, str]:
        """(the body's kind, the content that opens it) of a header (role, channel, recipient, content type)."""
        channel = (header.split(CHANNEL, 1)[1].split() or [""])[0] if CHANNEL in header else ""
        channel = channel.split("<|", 1)[0]
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith(FUNCTIONS):
            return "call", call_text(recipient.group(1)[len(FUNCTIONS):])
        return ("reasoning" if channel == "analysis" else "content"), ""


# ---- Gemma 4 ---------------------------------------------------------------------------------------------------
# Gemma 4 thinks in a channel, ``<|channel>thought\n...<channel|>``, then answers. Its template turns thinking on
# with <|think|> in the system turn (enable_thinking); off, the generation prompt ends with an empty channel
# (``<|turn>model\n<|channel>thought\n<channel|>``), which starts the answer in content.
GEMMA4_CHANNEL, GEMMA4_CHANNEL_END = "<|channel>", "<channel|>"

REASONING_FORMATS = {f.name: f for f in (ReasoningFormat("qwen3"),
                                         ReasoningFormat("deepseek_r1", always_starts_inside=True), HarmonyFormat(),
                                         ReasoningFormat("gemma4", start=GEMMA4_CHANNEL + "thought",
                                                         end=GEMMA4_CHANNEL_END))}


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_FORMATS))}")
    return REASONING_FORMATS[name]


def detect_reasoning_format(chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template speaks: ``openai_gptoss`` where it writes harmony channels, ``gemma4``
    where it writes Gemma 4's thought channel, ``qwen3`` where it writes ``<think>`` blocks."""
    if chat_template and GEMMA4_CHANNEL in chat_template and GEMMA4_CHANNEL_END in chat_template:
        return REASONING_FORMATS["gemma4"]
    if chat_template and CHANNEL in chat_template and MESSAGE in chat_template:
        return REASONING_FORMATS["openai_gptoss"]
    if chat_template and "<think>" in chat_template and "</think>" in chat_template:
        return REASONING_FORMATS["qwen3"]
    return None


