"""One event stream for every endpoint: the engine's Response deltas of a request become ChoiceEvents (per
completion: its content, reasoning and tool-call deltas, tokens and logprobs, and at the end its OpenAI
finish_reason), which a renderer turns into chat or text-completion chunks, or gathers into one answer.
Streamed and whole answers are the same events, so they cannot differ.

A stream may send several tokens per chunk (``in_chunks_of``: vLLM's and SGLang's stream interval), which
cuts a server's per-chunk work (and a Ray replica's per-item transport) at the cost of a less smooth stream.

The text of a chat completion passes through its reasoning parser (thinking -> reasoning) and then its tool
parser (calls -> tool_calls); a text completion's text passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from lmkit.messages import Response
from lmkit.serve.reasoning import ReasoningFormat, ReasoningParser
from lmkit.serve.tools.parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass(frozen=True)
class OutputFormat:
    """How a request's answers are split: its reasoning format (and whether answers start inside the thinking)
    and its tool parser with the request's tools (name -> parameters schema). Neither: plain text."""

    reasoning: ReasoningFormat | None = None
    starts_in_reasoning: bool = False
    tool_parser: type[ToolParser] | None = None
    tools: dict = field(default_factory=dict)

    def parsers(self) -> tuple[ReasoningParser | None, ToolParser | None]:
        reasoning = self.reasoning.new_parser(self.starts_in_reasoning) if self.reasoning else None
        return reasoning, self.tool_parser(self.tools) if self.tool_parser else None


@dataclass
class ChoiceEvent:
    """What one completion produced since its previous event."""

    index: int
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    """Entries of Response.prompt_logprobs (the first completion of a prompt, while its prompt is computed)."""
    finish_reason: str | None = None
    is_first: bool = False
    """The completion's first event (the chat role chunk goes with it); set by the stream that yields it."""

    @property
    def is_empty(self) -> bool:
        return not (self.text or self.reasoning or self.tool_calls or self.token_ids or self.finish_reason
                    or self.prompt_logprobs)


@dataclass
class Choice:
    """One completion: its events so far, gathered."""

    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tool_parser.calls if self.tool_parser else []

    def event(self, r: Response, finish_reason: str | None) -> ChoiceEvent:
        """The event of one Response of this completion (``finish_reason``: OpenAI's, when it is the last)."""
        final = finish_reason is not None
        text, reasoning, calls = r.text, "", []
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.feed(text, final)
        if self.tool_parser is not None:
            text, calls = self.tool_parser.feed(text, final)
        if final and finish_reason == "stop" and self.tool_calls:
            finish_reason = "tool_calls"
        event = ChoiceEvent(self.index, text, reasoning, calls, list(r.token_ids), list(r.logprobs or []),
                            list(r.prompt_logprobs or []), finish_reason)
        self.add(event, r.generate_token_len)
        return event

    def add(self, event: ChoiceEvent, num_tokens: int) -> None:
        if event.text:
            self.text.append(event.text)
        if event.reasoning:
            self.reasoning.append(event.reasoning)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.prompt_logprobs.extend(event.prompt_logprobs)
        self.num_tokens = num_tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason


def merged(earlier: Response, later: Response) -> Response:
    """Two consecutive Response deltas of one completion as one: their text, tokens and logprobs joined,
    the rest (counts, finish_reason, error) the later's."""
    def joined(a: list | None, b: list | None) -> list | None:
        return None if a is None and b is None else [*(a or ()), *(b or ())]

    return replace(later, text=earlier.text + later.text, token_ids=[*earlier.token_ids, *later.token_ids],
                   logprobs=joined(earlier.logprobs, later.logprobs),
                   prompt_logprobs=joined(earlier.prompt_logprobs, later.prompt_logprobs))


async def in_chunks_of(tokens: int, responses: AsyncIterator[Response]) -> AsyncIterator[Response]:
    """``responses`` (deltas of one or more completions) merged per completion until one holds ``tokens``
    new tokens or more (a speculative step delivers several at once); a completion's first token and its last
    Response pass at once, so time to first token and
    the end of a stream do not wait; what is held when ``responses`` ends comes last. Leaving early closes
    ``responses`` (which cancels its requests)."""
    held: dict[tuple[int, int], Response] = {}
    started: set[tuple[int, int]] = set()
    try:
        async for r in responses:
            key = (r.index, r.sample_index)
            if key in held:
                r = merged(held.pop(key), r)
            if r.finish_reason is not None or len(r.token_ids) >= tokens or (r.token_ids and key not in started):
                if r.token_ids:
                    started.add(key)
                yield r
            else:
                held[key] = r
        for r in held.values():  # a source that ends before its completions do: nothing is lost
            yield r
    finally:
        await responses.aclose()
