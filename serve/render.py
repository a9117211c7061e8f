"""The two renderers of the event stream (serve/stream.py): ChoiceEvents as OpenAI chat completion chunks or text
completion chunks, and gathered Choices as their whole answers. Per-token scores, the bulk of an answer that has
them, are LazyLists (serve/encoding.py): made item by item as the answer is written."""

from __future__ import annotations

import time
import uuid
from typing import Callable

from lmkit.serve.encoding import LazyList
from lmkit.serve.stream import Choice, ChoiceEvent

TokenText = Callable[[int], tuple[str, list[int]]]
"""token id -> (its text, its bytes)"""

MIN_LOGPROB = -9999.0
"""What a logprob of -inf (a token a grammar or a logit bias ruled out) is written as: JSON has no infinity,
and OpenAI and vLLM write this."""


def logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def usage(num_prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


def prompt_logprobs_body(entries: list[dict[int, float] | None], prompt_ids: list[int], num_top: int,
                         token_text: TokenText, shared: bool = False) -> LazyList:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token (first) and the ``num_top`` most likely alternatives. rank counts from 1; the prompt's token
    has its rank where it is one of the alternatives, else null (the engine ranks only the top)."""
    def item(k: int) -> dict | None:
        entry, t = entries[k], prompt_ids[k]
        if entry is None:
            return None
        best = [i for i, _ in sorted(entry.items(), key=lambda kv: -kv[1])][:num_top]
        rank = {i: r + 1 for r, i in enumerate(best)}
        return {str(i): {"logprob": logprob(entry[i]), "rank": rank.get(i), "decoded_token": token_text(i)[0]}
                for i in dict.fromkeys([t, *best])}

    return LazyList(min(len(entries), len(prompt_ids)), item, shared)


class ChatRenderer:
    """chat.completion / chat.completion.chunk. Reasoning goes out as ``reasoning_content`` (and vLLM's newer
    ``reasoning``) when the request has a reasoning parser; tool calls as OpenAI's ``tool_calls``."""

    def __init__(self, model_name: str, token_text: TokenText, logprobs: bool, top_logprobs: int,
                 has_reasoning: bool, prompt_ids: list[list[int]], prompt_logprobs: int | None):
        self.model_name = model_name
        self.prompt_ids = prompt_ids
        self.num_prompt_logprobs = prompt_logprobs
        self.token_text = token_text
        self.logprobs = logprobs
        self.top = top_logprobs
        self.has_reasoning = has_reasoning
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                     "system_fingerprint": None}

    def prelude(self, choices: list[Choice]) -> list[dict]:
        return []

    def _logprobs(self, entries: list[dict[int, float]], token_ids: list[int]) -> dict:
        def item(k: int) -> dict:
            t, entry = token_ids[k], entries[k]
            text, raw = self.token_text(t)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top]
            return {"token": text, "logprob": logprob(entry[t]), "bytes": raw,
                    "top_logprobs": [{"token": self.token_text(i)[0], "logprob": logprob(lp),
                                      "bytes": self.token_text(i)[1]} for i, lp in best]}

        return {"content": LazyList(min(len(token_ids), len(entries)), item), "refusal": None}

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
        body = {**self.head, "object": "chat.completion", "choices": out, "usage": usage(num_prompt_tokens, choices)}
        if self.num_prompt_logprobs is not None:  # one prompt, scored by the first completion
            body["prompt_logprobs"] = prompt_logprobs_body(choices[0].prompt_logprobs, self.prompt_ids[0],
                                                           self.num_prompt_logprobs, self.token_text)
        return body

    def chunk_body(self, entries: list[dict]) -> dict:
        return {**self.head, "object": "chat.completion.chunk", "choices": entries}


class CompletionRenderer:
    """text_completion, streamed or whole; ``echo`` puts each prompt's text first, and with ``logprobs`` also its
    tokens' logprobs (the first token's null). The n completions of a prompt share its logprobs, which the first
    of them carries (a stream sends the echo of all n once the prompt is scored)."""

    def __init__(self, model_name: str, token_text: TokenText, logprobs: int | None, prompt_texts: list[str],
                 n: int, echo: bool, prompt_ids: list[list[int]], prompt_logprobs: int | None):
        self.token_text = token_text
        self.num_logprobs = logprobs
        self.prompt_texts = prompt_texts
        self.prompt_ids = prompt_ids
        self.num_prompt_logprobs = prompt_logprobs
        self.n = n
        self.echo = echo
        self.echoes_logprobs = echo and logprobs is not None
        self.offsets: dict[int, int] = {}
        self.scored: dict[int, list] = {}  # prompt -> its prompt logprob entries so far (streaming)
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                     "system_fingerprint": None}

    def _prefix(self, index: int) -> str:
        return self.prompt_texts[index // self.n] if self.echo else ""

    def _top(self, entry: dict[int, float]) -> dict[str, float]:
        """The legacy top_logprobs, keyed by text: where two tokens read the same (bytes of one character),
        the likelier one's value stays."""
        top: dict[str, float] = {}
        for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_logprobs]:
            top.setdefault(self.token_text(i)[0], logprob(lp))
        return top

    def _logprobs(self, entries: list[dict[int, float] | None], token_ids: list[int], offset: int,
                  shared: bool = False) -> dict:
        """The legacy logprobs of token_ids from text offset ``offset``; an entry None (a prompt's first token,
        echoed) gives a null logprob and top."""
        tokens, token_logprobs, offsets = [], [], []
        for t, entry in zip(token_ids, entries):
            text = self.token_text(t)[0]
            tokens.append(text)
            token_logprobs.append(None if entry is None else logprob(entry[t]))
            offsets.append(offset)
            offset += len(text)
        tops = LazyList(len(tokens), lambda k: None if entries[k] is None else self._top(entries[k]), shared)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def prelude(self, choices: list[Choice]) -> list[dict]:
        out = []
        for c in choices:
            self.offsets[c.index] = len(self._prefix(c.index))
            if self.echo and not self.echoes_logprobs:
                out.append({"index": c.index, "text": self._prefix(c.index), "logprobs": None,
                            "finish_reason": None})
        return out

    def chunks(self, e: ChoiceEvent) -> list[dict]:
        out = []
        if self.echoes_logprobs and e.prompt_logprobs:
            prompt = e.index // self.n
            scored = self.scored.setdefault(prompt, [])
            scored.extend(e.prompt_logprobs)
            if len(scored) == len(self.prompt_ids[prompt]):  # scored whole: the echo of each of its completions
                # the echo's tokens count from 0; its n copies share their texts
                part = self._logprobs(scored, self.prompt_ids[prompt], 0, shared=self.n > 1)
                out += [{"index": i, "text": self._prefix(i), "logprobs": part, "finish_reason": None}
                        for i in range(prompt * self.n, (prompt + 1) * self.n)]
        logprobs = None
        offset = self.offsets.get(e.index, 0)  # text_offset counts the tokens' texts, as the whole answer's does
        if self.num_logprobs is not None and e.token_ids:
            logprobs = self._logprobs(e.logprobs, e.token_ids, offset)
        self.offsets[e.index] = offset + sum(len(self.token_text(t)[0]) for t in e.token_ids)
        if e.text or logprobs or e.finish_reason:
            out.append({"index": e.index, "text": e.text, "logprobs": logprobs, "finish_reason": e.finish_reason})
        return out

    def response(self, choices: list[Choice], num_prompt_tokens: int) -> dict:
        out = []
        echoed, bodies = {}, {}  # per prompt, built once for its n completions
        for c in choices:
            prefix, prompt = self._prefix(c.index), c.index // self.n
            scored = choices[prompt * self.n].prompt_logprobs
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = self._logprobs(c.logprobs, c.token_ids, len(prefix))
                if self.echoes_logprobs:
                    if prompt not in echoed:
                        echoed[prompt] = self._logprobs(scored, self.prompt_ids[prompt], 0, shared=self.n > 1)
                    part = echoed[prompt]
                    logprobs = {key: part[key] + logprobs[key] for key in part}
            choice = {"index": c.index, "text": prefix + "".join(c.text), "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
            if self.num_prompt_logprobs is not None:
                if prompt not in bodies:
                    bodies[prompt] = prompt_logprobs_body(scored, self.prompt_ids[prompt], self.num_prompt_logprobs,
                                                          self.token_text, shared=self.n > 1)
                choice["prompt_logprobs"] = bodies[prompt]
            out.append(choice)
        return {**self.head, "object": "text_completion", "choices": out,
                "usage": usage(num_prompt_tokens, choices)}

    def chunk_body(self, entries: list[dict]) -> dict:
        return {**self.head, "object": "text_completion", "choices": entries}
