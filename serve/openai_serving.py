"""One model served the OpenAI way: a request body becomes engine requests (GenerationConfig per prompt,
checked against the context length), and the engine's Response deltas become OpenAI's JSON or its SSE
chunks (``data: {...}`` lines, ``data: [DONE]`` last).

Leaving a stream early (the client went away) cancels every engine request of it at once: the streams'
``finally`` blocks call ``Engine.cancel``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Union

from lmkit.engine import AsyncEngine, RequestStream
from lmkit.messages import GenerationConfig, Response
from lmkit.serve.errors import APIError, bad_request, error_body
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]


@dataclass
class Choice:
    """What one completion produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    error: str | None = None


@dataclass
class Prepared:
    """A validated request: its prompts as token ids and one GenerationConfig for all of them."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    gen: GenerationConfig

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIServing:
    """Answers /v1/chat/completions, /v1/completions and /v1/models for one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        self._token_text: dict[int, tuple[str, list[int]]] = {}

    # ---- requests -> engine ----------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "lmkit",
            "root": str(self.engine.engine.model_path), "parent": None,
            "max_model_len": self.engine.engine.session_len,
        }]}

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def prepare(self, req: AnyRequest) -> Prepared:
        """Tokenizes the prompt(s) and builds the GenerationConfig; raises APIError(400) naming the parameter."""
        self.check_model(req.model)
        engine = self.engine.engine
        if isinstance(req, ChatCompletionRequest):
            param = "messages"
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in req.messages]
            try:
                prompt_ids = [engine.encode(messages)]
            except ValueError as e:
                raise bad_request(str(e), param) from None
            except Exception as e:  # a chat template that fails on these messages (jinja raises its own types)
                raise bad_request(f"the chat template cannot render these messages: {e}", param) from None
            prompt_texts = [""]
        else:
            param = "prompt"
            prompt_ids, prompt_texts = [], []
            vocab = engine.tokenizer.vocab_size
            for item in req.prompts():
                if isinstance(item, str):
                    prompt_ids.append(engine.encode(item))
                    prompt_texts.append(item)
                else:
                    if any(t >= vocab for t in item):
                        raise bad_request(f"prompt has token ids outside the vocabulary (size {vocab})", param)
                    prompt_ids.append(list(item))
                    prompt_texts.append(engine.tokenizer.decode(item, skip_special_tokens=False))
        session_len = engine.session_len
        longest = max(len(p) for p in prompt_ids)
        if longest >= session_len:
            raise bad_request(f"This model's maximum context length is {session_len} tokens. However, your "
                              f"{param} resulted in {longest} tokens. Please reduce the length of the {param}.",
                              param)
        max_new = req.max_new_tokens
        max_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if max_new is None:
            max_new = session_len - longest
        elif longest + max_new > session_len:
            raise bad_request(f"{max_name} is too large: {max_new}. This model's maximum context length is "
                              f"{session_len} tokens and your request has {longest} input tokens "
                              f"({max_new} + {longest} > {session_len}).", max_name)
        if req.min_tokens > max_new:
            raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed {max_name} ({max_new})", "min_tokens")
        try:
            gen = self._gen_config(req, max_new)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return Prepared(prompt_ids, prompt_texts, gen)

    @staticmethod
    def _gen_config(req: SamplingFields, max_new: int) -> GenerationConfig:
        temperature = 1.0 if req.temperature is None else req.temperature
        return GenerationConfig(
            max_new_tokens=max_new, min_new_tokens=req.min_tokens, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_k=max(0, req.top_k or 0), top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
            random_seed=None if req.seed is None else req.seed % 2**64,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            stop_token_ids=list(req.stop_token_ids or []), stop=req.stop_list,
            include_stop_str_in_output=req.include_stop_str_in_output, n=req.n, logprobs=req.num_logprobs,
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        )

    def submit(self, prepared: Prepared) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prepared.prompt_ids):
                streams.append(self.engine.submit(ids, prepared.gen, index=i))
        except ValueError as e:
            for s in streams:
                s.cancel()
            raise bad_request(str(e)) from None
        return streams

    async def responses(self, streams: list[RequestStream]) -> AsyncIterator[Response]:
        """The Response deltas of all streams as they arrive; leaving early cancels them all."""
        if len(streams) == 1:
            async for r in streams[0]:
                yield r
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(stream: RequestStream) -> None:
            try:
                async for r in stream:
                    queue.put_nowait(r)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()

    # ---- engine -> OpenAI shapes -------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._token_text.get(token_id)
        if hit is None:
            raw = self.engine.tokenizer.token_bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = hit
        return hit

    def chat_logprobs(self, entries: list[dict[int, float]], token_ids: list[int], top: int) -> list[dict]:
        out = []
        for t, entry in zip(token_ids, entries):
            text, raw = self._token(t)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            out.append({"token": text, "logprob": entry[t], "bytes": raw,
                        "top_logprobs": [{"token": self._token(i)[0], "logprob": lp, "bytes": self._token(i)[1]}
                                         for i, lp in best]})
        return out

    def completion_logprobs(self, entries: list[dict[int, float]], token_ids: list[int], top: int,
                            offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for t, entry in zip(token_ids, entries):
            text = self._token(t)[0]
            tokens.append(text)
            token_logprobs.append(entry[t])
            tops.append({self._token(i)[0]: lp for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
        completion = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def _finish(self, r: Response) -> str:
        """OpenAI's finish_reason for an engine's last Response; records its metrics."""
        if r.finish_reason == "error":
            if r.generate_token_len == 0 and r.error and "KV pool" in r.error:
                raise bad_request(r.error, "max_tokens")
            raise APIError(500, f"the engine failed this request: {r.error}")
        if r.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled by the server (shutting down)")
        return r.finish_reason or "stop"

    def _record(self, choice: Choice, started_at: float, prompt_len: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_completion(choice.first_token_at, started_at, time.perf_counter(), prompt_len,
                                            choice.num_tokens, choice.finish_reason or "error")

    async def collect(self, prepared: Prepared, streams: list[RequestStream], started_at: float) -> list[Choice]:
        """Runs every completion to its end (non-streaming)."""
        n = prepared.gen.n
        choices = [Choice(i) for i in range(len(streams) * n)]
        async for r in self.responses(streams):
            c = choices[r.index * n + r.sample_index]
            if r.token_ids and c.first_token_at is None:
                c.first_token_at = time.perf_counter()
            c.text.append(r.text)
            c.token_ids.extend(r.token_ids)
            c.num_tokens = r.generate_token_len
            if r.logprobs:
                c.logprobs.extend(r.logprobs)
            if r.finish_reason is not None:
                c.finish_reason = self._finish(r)
                self._record(c, started_at, len(prepared.prompt_ids[r.index]))
        return choices

    # ---- chat ---------------------------------------------------------------------------------------------

    def chat_response(self, req: ChatCompletionRequest, prepared: Prepared, choices: list[Choice]) -> dict:
        top = req.top_logprobs or 0
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "system_fingerprint": None,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
                "logprobs": ({"content": self.chat_logprobs(c.logprobs, c.token_ids, top), "refusal": None}
                             if req.logprobs else None),
                "finish_reason": c.finish_reason,
            } for c in choices],
            "usage": self.usage(prepared.num_prompt_tokens, choices),
        }

    async def chat_stream(self, req: ChatCompletionRequest, prepared: Prepared, streams: list[RequestStream],
                          started_at: float) -> AsyncIterator[str]:
        """SSE lines of a streamed chat completion, as OpenAI sends them."""
        n = prepared.gen.n
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        choices = [Choice(i) for i in range(len(streams) * n)]
        top = req.top_logprobs or 0

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
            body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}
            if include_usage:
                body["usage"] = self.usage(prepared.num_prompt_tokens, choices) if continuous else None
            return sse(body)

        try:
            async for r in self.responses(streams):
                c = choices[r.index * n + r.sample_index]
                if c.first_token_at is None:
                    # The role chunk goes with the first output, so a proxy's "first byte" is the first token.
                    c.first_token_at = time.perf_counter()
                    yield chunk(c.index, {"role": "assistant", "content": ""})
                c.num_tokens = r.generate_token_len
                finish = self._finish(r) if r.finish_reason else None
                logprobs = ({"content": self.chat_logprobs(r.logprobs or [], r.token_ids, top), "refusal": None}
                            if req.logprobs and r.token_ids else None)
                if r.text or logprobs:
                    yield chunk(c.index, {"content": r.text}, logprobs)
                if finish:
                    c.finish_reason = finish
                    self._record(c, started_at, len(prepared.prompt_ids[r.index]))
                    yield chunk(c.index, {}, None, finish)
        except APIError as e:
            yield sse(error_body(e.status, e.message, e.param, e.code))
            return
        if include_usage:
            yield sse({**head, "choices": [], "usage": self.usage(prepared.num_prompt_tokens, choices)})
        yield sse("[DONE]")

    # ---- text completions ----------------------------------------------------------------------------------

    def completion_response(self, req: CompletionRequest, prepared: Prepared, choices: list[Choice]) -> dict:
        n = prepared.gen.n
        out = []
        for c in choices:
            prefix = prepared.prompt_texts[c.index // n] if req.echo else ""
            out.append({
                "index": c.index, "text": prefix + "".join(c.text),
                "logprobs": (self.completion_logprobs(c.logprobs, c.token_ids, req.logprobs, len(prefix))
                             if req.logprobs is not None else None),
                "finish_reason": c.finish_reason,
            })
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None, "choices": out,
                "usage": self.usage(prepared.num_prompt_tokens, choices)}

    async def completion_stream(self, req: CompletionRequest, prepared: Prepared, streams: list[RequestStream],
                                started_at: float) -> AsyncIterator[str]:
        n = prepared.gen.n
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        choices = [Choice(i) for i in range(len(streams) * n)]
        offsets = [0] * len(choices)

        def chunk(index: int, text: str, logprobs=None, finish_reason=None) -> str:
            body = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}
            if include_usage:
                body["usage"] = self.usage(prepared.num_prompt_tokens, choices) if continuous else None
            return sse(body)

        if req.echo:
            for c in choices:
                text = prepared.prompt_texts[c.index // n]
                offsets[c.index] = len(text)
                yield chunk(c.index, text)
        try:
            async for r in self.responses(streams):
                c = choices[r.index * n + r.sample_index]
                if r.token_ids and c.first_token_at is None:
                    c.first_token_at = time.perf_counter()
                c.num_tokens = r.generate_token_len
                finish = self._finish(r) if r.finish_reason else None
                logprobs = None
                if req.logprobs is not None and r.token_ids:
                    logprobs = self.completion_logprobs(r.logprobs or [], r.token_ids, req.logprobs,
                                                        offsets[c.index])
                offsets[c.index] += len(r.text)
                if finish:
                    c.finish_reason = finish
                    self._record(c, started_at, len(prepared.prompt_ids[r.index]))
                if r.text or logprobs or finish:
                    yield chunk(c.index, r.text, logprobs, finish)
        except APIError as e:
            yield sse(error_body(e.status, e.message, e.param, e.code))
            return
        if include_usage:
            yield sse({**head, "choices": [], "usage": self.usage(prepared.num_prompt_tokens, choices)})
        yield sse("[DONE]")
