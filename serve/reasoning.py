"""Reasoning parsers: a thinking model's ``<think>...</think>`` block goes to ``reasoning_content``, the rest to
``content``, as the text streams (``--reasoning-parser``).

Where the thinking starts is read from the rendered prompt, so streamed and whole answers split alike: a prompt
that ends inside an open ``<think>`` (DeepSeek-R1 distills, Qwen3 thinking-2507 templates) starts the answer in
reasoning; a prompt that ends with a closed, empty block (Qwen3 with ``enable_thinking: false``) starts it in
content; otherwise the answer is reasoning when it opens with ``<think>``. ``deepseek_r1`` starts in reasoning
always (its models may leave out the opening tag). Reasoning cut short by max_tokens stays reasoning.
"""

from __future__ import annotations

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
        return ReasoningParser(self, self.starts_inside(prompt_text))


REASONING_FORMATS = {f.name: f for f in (ReasoningFormat("qwen3"), ReasoningFormat("deepseek_r1",
                                                                                     always_starts_inside=True))}


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_FORMATS))}")
    return REASONING_FORMATS[name]


def detect_reasoning_format(chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template speaks: ``qwen3`` where it writes ``<think>`` blocks."""
    if chat_template and "<think>" in chat_template and "</think>" in chat_template:
        return REASONING_FORMATS["qwen3"]
    return None


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
