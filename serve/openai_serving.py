"""One model served the OpenAI way: a request body becomes engine requests (GenerationConfig per prompt,
checked against the context length), and the engine's Response deltas become OpenAI's JSON or its SSE
chunks (``data: {...}`` lines, ``data: [DONE]`` last).

Preparing a request (tokenizing, rendering the chat template, decoding token ids for ``echo``) runs in a
thread pool of this server's own, never on the event loop, and a text too long for the context whatever
its tokenization is refused by its length in characters before the tokenizer sees it.

Leaving a stream early (the client went away) cancels every engine request of it at once: the streams'
``finally`` blocks call ``Engine.cancel``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Union

from lmkit.config import usable_cpu_count
from lmkit.engine import AsyncEngine, RequestStream, first_id_outside
from lmkit.messages import GenerationConfig, GenerationConfigError, Response
from lmkit.serve.errors import APIError, bad_request, error_body, internal_error
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.structured import StructuredOutputError

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]

# OpenAI's names of the GenerationConfig fields that have other names there
_PARAM_OF_FIELD = {"min_new_tokens": "min_tokens", "random_seed": "seed"}


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
    """A validated request: its prompts as token ids (and as text where ``echo`` needs it, else "") and one
    GenerationConfig for all of them."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    gen: GenerationConfig
    grammar: object = None
    """gen.structured_output compiled for this engine (None without one)."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def num_prepare_threads() -> int:
    """The cores this process may use, at most 4: tokenization shares them with the engine's threads."""
    return min(4, usable_cpu_count())


class OpenAIServing:
    """Answers /v1/chat/completions, /v1/completions and /v1/models for one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        # Its own pool: in the loop's default executor, prepares would queue /health's engine probe behind them.
        self._pool = ThreadPoolExecutor(num_prepare_threads(), thread_name_prefix="lmkit-prepare")
        # A text has at least ceil(chars / max_token_chars) tokens: past this many characters no tokenization
        # fits it in the context (session_len - 1 prompt tokens at most, one left to generate).
        self.max_token_chars = max(1, engine.tokenizer.max_token_chars)
        self.max_prompt_chars = (engine.engine.session_len - 1) * self.max_token_chars

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

    async def prepare(self, req: AnyRequest) -> Prepared:
        """Tokenizes the prompt(s) and builds the GenerationConfig, in this server's thread pool (off the event
        loop); raises APIError (400 naming the parameter; 404 for another model)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, req)

    def _prepare(self, req: AnyRequest) -> Prepared:
        self.check_model(req.model)
        engine = self.engine.engine
        session_len = engine.session_len
        max_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        # Every sampling field is checked before anything is tokenized; max_new_tokens is set once the prompt is.
        max_new = req.max_new_tokens
        constraint = req.structured_output()
        constraint_param = constraint[1] if constraint else None
        gen = self._checked(req, max_name, lambda: self._gen_config(req, min(max_new or session_len, session_len)))
        if constraint is not None:
            gen = dataclasses.replace(gen, structured_output=constraint[0])
        if isinstance(req, ChatCompletionRequest):
            param = "messages"
            prompt_ids, prompt_texts = [self._chat_ids(req)], [""]
        else:
            param = "prompt"
            prompt_ids, prompt_texts = [], []
            for item in req.prompts():
                ids = self._text_ids(item) if isinstance(item, str) else self._checked_ids(item)
                prompt_ids.append(ids)
                prompt_texts.append((item if isinstance(item, str) else
                                     engine.tokenizer.decode(item, skip_special_tokens=False)) if req.echo else "")
        longest = max(len(p) for p in prompt_ids)
        if longest >= session_len:
            raise self._too_long(param, f"your {param} resulted in {longest} tokens")
        if max_new is None:  # the model's own limit, if its generation_config.json sets one, within the context
            max_new = min(engine.generation_defaults.get("max_new_tokens", session_len), session_len - longest)
        elif longest + max_new > session_len:
            raise bad_request(f"{max_name} is too large: {max_new}. This model's maximum context length is "
                              f"{session_len} tokens and your request has {longest} input tokens "
                              f"({max_new} + {longest} > {session_len}).", max_name)
        gen = self._checked(req, max_name, lambda: dataclasses.replace(gen, max_new_tokens=max_new))
        return Prepared(prompt_ids, prompt_texts, gen, self._compiled(gen, constraint_param))

    def _compiled(self, gen: GenerationConfig, param: str | None):
        """The request's constraint compiled (cached by its text); a 400 naming ``param`` when llguidance
        refuses it (invalid schema, an unsupported keyword, a regex that does not compile)."""
        if gen.structured_output is None:
            return None
        try:
            return self.engine.engine.compile_grammar(gen.structured_output)
        except StructuredOutputError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def _too_long(self, param: str, what: str) -> APIError:
        return bad_request(f"This model's maximum context length is {self.engine.engine.session_len} tokens. "
                           f"However, {what}. Please reduce the length of the {param}.", param)

    def _check_num_chars(self, num_chars: int, param: str) -> None:
        """Refuses a text that no tokenization fits in the context, before it is tokenized (or rendered)."""
        if num_chars > self.max_prompt_chars:
            min_tokens = -(-num_chars // self.max_token_chars)
            raise self._too_long(param, f"your {param} has {num_chars} characters, at least {min_tokens} tokens "
                                        f"(no token of this model is longer than {self.max_token_chars} characters)")

    def _text_ids(self, text: str) -> list[int]:
        self._check_num_chars(len(text), "prompt")
        try:
            return self.engine.engine.encode(text)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """Token ids as given, once they fit the context and the model's vocabulary."""
        engine = self.engine.engine
        if len(ids) >= engine.session_len:
            raise self._too_long("prompt", f"your prompt has {len(ids)} tokens")
        vocab = engine.spec.vocab_size
        bad = first_id_outside(ids, vocab)
        if bad is not None:
            raise bad_request(f"prompt has token id {ids[bad]} outside the vocabulary [0, {vocab})", "prompt")
        return list(ids)

    def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        # The template renders every message's content and name (and text of its own): a bound on the tokens.
        self._check_num_chars(sum(len(m["content"]) + len(m.get("name", "")) for m in messages), "messages")
        try:
            return self.engine.engine.encode(messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # a chat template that fails on these messages (jinja raises its own types)
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None

    def _checked(self, req: AnyRequest, max_name: str, build: Callable[[], GenerationConfig]) -> GenerationConfig:
        """``build()``'s GenerationConfig once it fits this engine; its error as a 400 naming the parameter."""
        try:
            gen = build()
            gen.check_limits(self.engine.engine.spec.vocab_size, self.engine.engine.config.max_batch_size)
        except GenerationConfigError as e:
            if e.field == "max_new_tokens":
                param = max_name
            elif e.field == "logprobs" and isinstance(req, ChatCompletionRequest):
                param = "top_logprobs"
            else:
                param = _PARAM_OF_FIELD.get(e.field, e.field)
            raise bad_request(f"{param} {e.reason}", param) from None
        return gen

    def _gen_config(self, req: AnyRequest, max_new: int) -> GenerationConfig:
        """The request's sampling over the model's generation_config.json defaults (as vLLM's
        ``--generation-config auto``): a field the request leaves out takes the model's value."""
        engine = self.engine.engine
        temperature = req.temperature
        if temperature is None and not engine.generation_defaults.get("do_sample"):
            temperature = 1.0  # OpenAI's default where the model's file does not ask to sample
        return engine.default_generation_config(
            max_new_tokens=max_new, min_new_tokens=req.min_tokens, temperature=temperature,
            top_k=None if req.top_k is None else max(0, req.top_k), top_p=req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, random_seed=None if req.seed is None else req.seed % 2**64,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop_token_ids=list(req.stop_token_ids or []), stop=req.stop_list,
            include_stop_str_in_output=req.include_stop_str_in_output, n=req.n, logprobs=req.num_logprobs,
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        )

    def submit(self, prepared: Prepared) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prepared.prompt_ids):
                streams.append(self.engine.submit(ids, prepared.gen, index=i, grammar=prepared.grammar))
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
            raise internal_error(f"the engine failed a request (prompt {r.index}, completion {r.sample_index}): "
                                 f"{r.error}")
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
