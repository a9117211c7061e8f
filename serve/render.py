"""The two renderers of the event stream (serve/stream.py): ChoiceEvents as OpenAI chat completion chunks or text
completion chunks, and gathered Choices as their whole answers."""

from __future__ import annotations

import time
import uuid
from typing import Callable

from lmkit.serve.stream import Choice, ChoiceEvent

TokenText = Callable[[int], tuple[str, list[int]]]
"""token id -> (its text, its bytes)"""


def usage(num_prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


class ChatRenderer:
    """chat.completion / chat.completion.chunk. Reasoning goes out as ``reasoning_content`` (and vLLM's newer
    ``reasoning``) when the request has a reasoning parser; tool calls as OpenAI's ``tool_calls``."""

    def __init__(self, model_name: str, token_text: TokenText, logprobs: bool, top_logprobs: int,
                 has_reasoning: bool):
        self.model_name = model_name
        self.token_text = token_text
        self.logprobs = logprobs
        self.top = top_logprobs
        self.has_reasoning = has_reasoning
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                     "system_fingerprint": None}

    def prelude(self, choices: list[Choice]) -> list[dict]:
        return []

    def _logprobs(self, entries: list[dict[int, float]], token_ids: list[int]) -> dict:
        out = []
        for t, entry in zip(token_ids, entries):
            text, raw = self.token_text(t)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top]
            out.append({"token": text, "logprob": entry[t], "bytes": raw,
                        "top_logprobs": [{"token": self.token_text(i)[0], "logprob": lp,
                                          "bytes": self.token_text(i)[1]} for i, lp in best]})
        return {"content": out, "refusal": None}

    def chunks(self, e: ChoiceEvent) -> list[dict]:
        """The choice entries of one event (each becomes one chunk)."""
        out = []
        if e.is_first:  # the role goes with the first output, so a proxy's "first byte" is the first token
            out.append({"index": e.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        delta: dict = {}
        if e.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = e.reasoning
        if e.text:
            delta["content"] = e.text
        if e.tool_calls:
            delta["tool_calls"] = [d.chunk() for d in e.tool_calls]
        logprobs = self._logprobs(e.logprobs, e.token_ids) if self.logprobs and e.token_ids else None
        if delta or logprobs:
            out.append({"index": e.index, "delta": delta or {"content": ""}, "logprobs": logprobs,
                        "finish_reason": None})
        if e.finish_reason:
            out.append({"index": e.index, "delta": {}, "logprobs": None, "finish_reason": e.finish_reason})
        return out

    def response(self, choices: list[Choice], num_prompt_tokens: int) -> dict:
        out = []
        for c in choices:
            calls = [call.message() for call in c.tool_calls]
            text = "".join(c.text)
            message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if self.has_reasoning:
                reasoning = "".join(c.reasoning) or None
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            out.append({"index": c.index, "message": message,
                        "logprobs": self._logprobs(c.logprobs, c.token_ids) if self.logprobs else None,
                        "finish_reason": c.finish_reason})
        return {**self.head, "object": "chat.completion", "choices": out,
                "usage": usage(num_prompt_tokens, choices)}

    def chunk_body(self, entries: list[dict]) -> dict:
        return {**self.head, "object": "chat.completion.chunk", "choices": entries}


class CompletionRenderer:
    """text_completion, streamed or whole; ``echo`` puts each prompt's text first."""

    def __init__(self, model_name: str, token_text: TokenText, logprobs: int | None, prompt_texts: list[str],
                 n: int, echo: bool):
        self.token_text = token_text
        self.num_logprobs = logprobs
        self.prompt_texts = prompt_texts
        self.n = n
        self.echo = echo
        self.offsets: dict[int, int] = {}
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                     "system_fingerprint": None}

    def _prefix(self, index: int) -> str:
        return self.prompt_texts[index // self.n] if self.echo else ""

    def _logprobs(self, entries: list[dict[int, float]], token_ids: list[int], offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for t, entry in zip(token_ids, entries):
            text = self.token_text(t)[0]
            tokens.append(text)
            token_logprobs.append(entry[t])
            tops.append({self.token_text(i)[0]: lp
                         for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_logprobs]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def prelude(self, choices: list[Choice]) -> list[dict]:
        out = []
        for c in choices:
            self.offsets[c.index] = len(self._prefix(c.index))
            if self.echo:
                out.append({"index": c.index, "text": self._prefix(c.index), "logprobs": None,
                            "finish_reason": None})
        return out

    def chunks(self, e: ChoiceEvent) -> list[dict]:
        logprobs = None
        offset = self.offsets.get(e.index, 0)
        if self.num_logprobs is not None and e.token_ids:
            logprobs = self._logprobs(e.logprobs, e.token_ids, offset)
        self.offsets[e.index] = offset + len(e.text)
        if e.text or logprobs or e.finish_reason:
            return [{"index": e.index, "text": e.text, "logprobs": logprobs, "finish_reason": e.finish_reason}]
        return []

    def response(self, choices: list[Choice], num_prompt_tokens: int) -> dict:
        out = []
        for c in choices:
            prefix = self._prefix(c.index)
            out.append({"index": c.index, "text": prefix + "".join(c.text),
                        "logprobs": (self._logprobs(c.logprobs, c.token_ids, len(prefix))
                                     if self.num_logprobs is not None else None),
                        "finish_reason": c.finish_reason})
        return {**self.head, "object": "text_completion", "choices": out,
                "usage": usage(num_prompt_tokens, choices)}

    def chunk_body(self, entries: list[dict]) -> dict:
        return {**self.head, "object": "text_completion", "choices": entries}
