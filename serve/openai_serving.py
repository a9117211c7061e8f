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
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Union

from fastapi import responses

from lmkit.cpus import usable_cpu_count
from lmkit.engine import AsyncEngine, RequestStream, first_id_outside
from lmkit.messages import GenerationConfig, GenerationConfigError, Response
from lmkit.serve.errors import APIError, bad_request, error_body, internal_error
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.serve.reasoning import HarmonyFormat, ReasoningFormat
from lmkit.serve.encoding import dumps, encode_pieces
from lmkit.serve.render import ChatRenderer, CompletionRenderer, usage
from lmkit.serve.stream import Choice, ChoiceEvent, OutputFormat, in_chunks_of
from lmkit.serve.tools.grammar import harmony_answer_grammar, tool_call_grammar
from lmkit.serve.tools.parsers import TOOL_PARSERS, ToolParser
from lmkit.structured import StructuredOutput, StructuredOutputError, grammar_error_summary

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]

# OpenAI's names of the GenerationConfig fields that have other names there
_PARAM_OF_FIELD = {"min_new_tokens": "min_tokens", "random_seed": "seed"}

MAX_RENDERED_PROMPT_SCORES = 2_000_000
"""The most prompt-token scores (a token's logprob and its alternatives count 1 + k) one completion answer may
render. Echo's logprobs and prompt_logprobs are rendered into every completion of a prompt: n copies of a long
prompt's would hold a preparation thread and the answer's memory for minutes (8,100 tokens x 21 x n 64 is 11M
scores, ~270 MB of JSON), while one copy of a whole 32k context with 20 alternatives (688k) passes."""


GRAMMAR_NICE = 10


def lower_priority(nice: int = GRAMMAR_NICE) -> None:
    """Raises the calling thread's nice value to `nice` (Linux: per thread; elsewhere, or where refused, nothing)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass


@dataclass
class Prepared:
    """A validated request: its prompts as token ids (and as text where ``echo`` needs it, else "") and one
    GenerationConfig for all of them."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    gen: GenerationConfig
    grammar: object = None
    """gen.structured_output compiled for this engine (None without one)."""
    output: OutputFormat = field(default_factory=OutputFormat)
    """How the answers split into reasoning, content and tool calls (chat)."""
    constraint_param: str | None = None
    """The request field the grammar came from (response_format, guided_json, tool_choice, ...)."""
    to_compile: list[tuple[StructuredOutput, str]] = field(default_factory=list)
    """Constraints (and their request fields) the grammar cache does not hold yet: compiled in the grammar pool
    before the request goes on (OpenAIServing.prepare); gen.structured_output's becomes ``grammar``."""
    response_id: str | None = None
    """The answer's id (chatcmpl-..., cmpl-...), once OpenAIServing.renderer has made it."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n"


def num_prepare_threads() -> int:
    """The cores this process may use, at most 4: tokenization shares them with the engine's threads."""
    return min(4, usable_cpu_count())


class OpenAIServing:
    """Answers /v1/chat/completions, /v1/completions and /v1/models for one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None,
                 tool_parser: type[ToolParser] | None = None, reasoning: ReasoningFormat | None = None,
                 stream_interval: int = 1):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tool_parser = tool_parser
        """The format of tool calls, which also writes the history's calls and results into the prompt (None:
        the server reads no tool calls; tools get a 400)."""
        self.reasoning = reasoning
        """The reasoning format of answers (None: answers are all content)."""
        self.stream_interval = stream_interval
        """Tokens per chunk of a streamed completion (its first token and its end are sent at once)."""
        tokenizer = engine.tokenizer
        # Markers that are special tokens must stay in the decoded text for the parsers to read them.
        tool_markers = tool_parser.markers if tool_parser else ()
        reasoning_markers = (reasoning.start, reasoning.end) if reasoning else ()
        self._tool_markers_special = any(tokenizer.is_special(m) for m in tool_markers)
        self._reasoning_markers_special = any(tokenizer.is_special(m) for m in reasoning_markers)
        self._reasoning_end_id = tokenizer.single_token_id(reasoning.end) if reasoning else None
        self.created = int(time.time())
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        # Its own pool: in the loop's default executor, prepares would queue /health's engine probe behind them.
        self._pool = ThreadPoolExecutor(num_prepare_threads(), thread_name_prefix="lmkit-prepare")
        # Grammar compiles that miss the cache (milliseconds to seconds each) queue in a pool of their own: behind
        # them, the prepare pool would make every ordinary request wait for another client's schemas. Its thread
        # runs at a lower priority: where it shares cores with the engine, a client's compiles take the CPU the
        # running requests leave, not half of theirs.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="lmkit-grammar", initializer=lower_priority)
        self.num_preparing = 0
        """Requests waiting for or in preparation (readiness.py); counted on the event loop."""
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
        self.num_preparing += 1
        try:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._pool, self._prepare, req)
            for constraint, param in prepared.to_compile:
                compiled = await loop.run_in_executor(self._grammar_pool, self._compile, constraint, param)
                if constraint is prepared.gen.structured_output:
                    prepared.grammar = compiled
            prepared.to_compile = []
            return prepared
        finally:
            self.num_preparing -= 1

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
        output = OutputFormat()
        to_compile: list[tuple[StructuredOutput, str]] = []  # what the grammar cache does not hold (prepare())
        if isinstance(req, ChatCompletionRequest):
            param = "messages"
            ids, output, gen, constraint_param = self._chat(req, gen, constraint_param, to_compile)
            prompt_ids, prompt_texts = [ids], [""]
        else:
            param = "prompt"
            prompt_ids, prompt_texts = [], []
            for item in req.prompts():
                ids = self.text_ids(item) if isinstance(item, str) else self.checked_ids(item)
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
        if isinstance(req, CompletionRequest):
            self._check_prompt_scores(req, prompt_ids, gen.n)
        prepared = Prepared(prompt_ids, prompt_texts, gen, None, output, constraint_param, to_compile)
        if gen.structured_output is not None:
            prepared.grammar = self._cached(gen.structured_output, constraint_param)
            if prepared.grammar is None:
                to_compile.append((gen.structured_output, constraint_param))
        return prepared

    @staticmethod
    def _check_prompt_scores(req: CompletionRequest, prompt_ids: list[list[int]], n: int) -> None:
        """A 400 when the prompt scores the answer renders (MAX_RENDERED_PROMPT_SCORES) are too many."""
        per_token = [(k + 1, name) for k, name in ((req.logprobs if req.echo else None, "echo with logprobs"),
                                                     (req.prompt_logprobs, "prompt_logprobs")) if k is not None]
        if not per_token:
            return
        tokens = sum(len(p) for p in prompt_ids)
        scores = tokens * n * sum(k for k, _ in per_token)
        if scores > MAX_RENDERED_PROMPT_SCORES:
            asked = " and ".join(name for _, name in per_token)
            raise bad_request(
                f"{asked} would render {scores:,} prompt-token scores ({tokens:,} prompt tokens x n={n} completions x "
                f"{' + '.join(str(k) for k, _ in per_token)} per token), more than the {MAX_RENDERED_PROMPT_SCORES:,} "
                "one answer may hold: the prompt is scored once, so score it with n=1 (and fewer logprobs or a "
                "shorter prompt), then sample with n > 1 separately", "n" if n > 1 else per_token[0][1].split()[-1])

    def _cached(self, constraint: StructuredOutput, param: str):
        """The constraint compiled if the grammar cache holds it, else None; a 400 naming ``param`` when it is
        invalid before any compiling (a lone surrogate) or a refusal the cache holds."""
        try:
            return self.engine.engine.cached_grammar(constraint)
        except StructuredOutputError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def _compile(self, constraint: StructuredOutput, param: str):
        """The constraint compiled (cached by its text); a 400 naming ``param`` when llguidance refuses it
        (invalid schema, an unsupported keyword, a regex that does not compile)."""
        try:
            return self.engine.engine.compile_grammar(constraint)
        except StructuredOutputError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def _chat(self, req: ChatCompletionRequest, gen: GenerationConfig, constraint_param: str | None,
              to_compile: list) -> tuple[list[int], OutputFormat, GenerationConfig, str | None]:
        """The chat's prompt ids (its messages, and the tools it offers, rendered by the chat template), how its
        answers split (reasoning, tool calls), and ``gen`` with what they need: the grammar of a required or
        named tool call (of any answer with tools, where the format constrains_auto: a call, or an answer that
        holds the request's own JSON structured output), a structured output that starts after the thinking,
        special-token markers kept. The tools' parameter schemas the grammar cache does not hold go on
        ``to_compile``."""
        tokenizer = self.engine.engine.tokenizer
        mode = req.tool_choice_mode
        offered = bool(req.tools) and mode != "none"  # tool_choice none: the model is not told of the tools
        parser = self.tool_parser if offered else None
        if offered and parser is None:
            raise bad_request("tools: this server reads no tool calls (--tool-call-parser none); start it with "
                              "--tool-call-parser auto (the chat template's format, else generic) or one of "
                              f"{', '.join(sorted(TOOL_PARSERS))}", "tools")
        for i, tool in enumerate(req.tools or []):  # every function's parameters is a schema llguidance takes
            schema, param = StructuredOutput(json=tool.function.parameters_schema), f"tools[{i}].function.parameters"
            if self._cached(schema, param) is None:
                to_compile.append((schema, param))
        # The template renders every message's text and name (and text of its own): a bound on the tokens.
        self.check_num_chars(sum(m.num_chars for m in req.messages), "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if offered else None

        def render(messages: list[dict], definitions: list[dict] | None) -> str:
            return tokenizer.render_chat(messages, tools=definitions, template_kwargs=req.chat_template_kwargs)

        try:  # the server's tool format writes the offered tools, and the history's calls and results
            text = (self.tool_parser or ToolParser).render_prompt(render, [m.template_data() for m in req.messages],
                                                                  tools)
            ids = tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # a chat template that fails on these messages (jinja raises its own types)
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
        reasoning = self.reasoning
        output = OutputFormat(reasoning, bool(reasoning and reasoning.starts_inside(text)), parser,
                              {t.function.name: t.function.parameters_schema for t in req.tools or []})
        if isinstance(reasoning, HarmonyFormat) and gen.structured_output is not None and \
                gen.structured_output.grammar is None:  # gpt-oss answers in its final channel, after any analysis
            lark = harmony_answer_grammar(gen.structured_output, tokenizer.single_token_id)
            gen = dataclasses.replace(gen, structured_output=StructuredOutput(grammar=lark))
        forced = offered and mode in ("required", "named")
        if forced or (offered and parser.constrains_auto):
            answer = None  # the request's own JSON structured output, held as the answer of a constrains_auto format
            if gen.structured_output is not None:
                if forced:
                    raise bad_request("give either a structured output or tool_choice 'required' (or a named "
                                      "function), not both", constraint_param)
                kind, answer = gen.structured_output.source()
                if kind != "json_schema":
                    raise bad_request(f"{constraint_param}: with tools in the generic tool format, the answer can "
                                      "hold a JSON schema or json_object only; give a regex, choice or grammar "
                                      "without tools, or with tool_choice none", constraint_param)
                output = dataclasses.replace(output, tool_parser=parser.with_json_answers())
            lark = tool_call_grammar(parser, req.called_tools(), req.parallel_tool_calls, tokenizer.single_token_id,
                                     required=forced, answer_schema=answer)
            gen = dataclasses.replace(gen, structured_output=StructuredOutput(grammar=lark))
            if answer is None:
                constraint_param = "tool_choice" if forced else "tools"
        if gen.structured_output is not None and reasoning is not None and reasoning.thinks_after(text):
            if self._reasoning_end_id is None:
                raise bad_request(f"{constraint_param}: the structured output would start after the thinking, but "
                                  f"{reasoning.end} is not one token of this model", constraint_param)
            gen = dataclasses.replace(gen, structured_output_after_token=self._reasoning_end_id)
        keeps_special = self._reasoning_markers_special or (parser is not None and self._tool_markers_special)
        if gen.skip_special_tokens and keeps_special:
            gen = dataclasses.replace(gen, skip_special_tokens=False)  # the parsers read them
        return ids, output, gen, constraint_param

    async def in_pool(self, fn, *args):
        """``fn(*args)`` in this server's preparation pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _too_long(self, param: str, what: str) -> APIError:
        return bad_request(f"This model's maximum context length is {self.engine.engine.session_len} tokens. "
                           f"However, {what}. Please reduce the length of the {param}.", param)

    def check_num_chars(self, num_chars: int, param: str) -> None:
        """Refuses a text that no tokenization fits in the context, before it is tokenized (or rendered)."""
        if num_chars > self.max_prompt_chars:
            min_tokens = -(-num_chars // self.max_token_chars)
            raise self._too_long(param, f"your {param} has {num_chars} characters, at least {min_tokens} tokens "
                                        f"(no token of this model is longer than {self.max_token_chars} characters)")

    def text_ids(self, text: str, param: str = "prompt", name: str | None = None) -> list[int]:
        """The token ids of a prompt text (special tokens added); a 400 naming ``param`` for a text no
        tokenization fits in the context, or that is not valid Unicode. ``name``: the text in messages (default
        ``param``)."""
        self.check_num_chars(len(text), param)
        try:
            return self.engine.engine.encode(text)
        except ValueError as e:
            raise bad_request(f"{name}: {e}" if name else str(e), param) from None

    def checked_ids(self, ids: list[int], param: str = "prompt", name: str | None = None) -> list[int]:
        """Token ids as given, once they fit the context and the model's vocabulary (a 400 naming ``param``;
        ``name``: the ids in messages, default ``param``)."""
        engine, name = self.engine.engine, name or param
        if len(ids) >= engine.session_len:
            raise self._too_long(param, f"your {name} has {len(ids)} tokens")
        vocab = engine.spec.vocab_size
        bad = first_id_outside(ids, vocab)
        if bad is not None:
            raise bad_request(f"{name} has token id {ids[bad]} outside the vocabulary [0, {vocab})", param)
        return list(ids)

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
        ``--generation-config auto``): a field the request leaves out takes the model's value, and a model whose
        file does not ask to sample is greedy, as in `lmkit generate` and pipeline() (ModelSpec.generation_config)."""
        engine = self.engine.engine
        return engine.default_generation_config(
            max_new_tokens=max_new, min_new_tokens=req.min_tokens, temperature=req.temperature,
            top_k=None if req.top_k is None else max(0, req.top_k), top_p=req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, random_seed=None if req.seed is None else req.seed % 2**64,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop_token_ids=list(req.stop_token_ids or []), stop=req.stop_list,
            include_stop_str_in_output=req.include_stop_str_in_output, n=req.n, logprobs=req.num_logprobs,
            prompt_logprobs=req.num_prompt_logprobs,
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
            prediction=self._prediction_ids(req), speculative=req.speculative,
        )

    def _prediction_ids(self, req: AnyRequest) -> list[int] | None:
        """The request's predicted output as token ids (tokenized here, in preparation, off the event loop), or
        None when it gave none or the engine does not speculate."""
        if req.prediction is None:
            return None
        text = req.prediction.text
        self.check_num_chars(len(text), "prediction")
        try:
            return self.engine.engine.prediction_ids(text) or None
        except ValueError as e:
            raise bad_request(str(e), "prediction") from None

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

    # ---- engine -> events -> OpenAI shapes ----------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._token_text.get(token_id)
        if hit is None:
            raw = self.engine.tokenizer.token_bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = hit
        return hit

    def renderer(self, req: AnyRequest, prepared: Prepared) -> ChatRenderer | CompletionRenderer:
        """The answer's renderer; sets prepared.response_id to the answer's id."""
        if isinstance(req, ChatCompletionRequest):
            renderer = ChatRenderer(self.model_name, self._token, req.logprobs, req.top_logprobs or 0,
                                    prepared.output.reasoning is not None, prepared.prompt_ids, req.prompt_logprobs)
        else:
            renderer = CompletionRenderer(self.model_name, self._token, req.logprobs, prepared.prompt_texts,
                                          prepared.gen.n, req.echo, prepared.prompt_ids, req.prompt_logprobs)
        prepared.response_id = renderer.head["id"]
        return renderer

    @staticmethod
    def new_choices(prepared: Prepared) -> list[Choice]:
        choices = []
        for i in range(len(prepared.prompt_ids) * prepared.gen.n):
            reasoning, tools = prepared.output.parsers()
            choices.append(Choice(i, reasoning_parser=reasoning, tool_parser=tools))
        return choices

    def _finish(self, r: Response, prepared: Prepared) -> str:
        """OpenAI's finish_reason for an engine's last Response, or the APIError it is."""
        if r.finish_reason == "error":
            if r.error_kind == "does_not_fit":
                raise bad_request(r.error, "max_tokens")
            if r.error_kind == "grammar":  # the request's grammar cannot go on (too complex for the parser, ...)
                param = prepared.constraint_param
                raise bad_request(f"{param}: the structured output failed while generating: "
                                  f"{grammar_error_summary(r.error)}", param)
            raise internal_error(f"the engine failed a request (prompt {r.index}, completion {r.sample_index}): "
                                 f"{r.error}")
        if r.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled by the server (shutting down)")
        return r.finish_reason or "stop"

    def _record(self, choice: Choice, started_at: float, prompt_len: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_completion(choice.first_token_at, started_at, time.perf_counter(), prompt_len,
                                            choice.num_tokens, choice.finish_reason or "error")

    async def events(self, prepared: Prepared, streams: list[RequestStream], choices: list[Choice],
                     started_at: float, tokens_per_event: int = 1) -> AsyncIterator[ChoiceEvent]:
        """The request's ChoiceEvents as they happen (``choices`` gather them), each with up to
        ``tokens_per_event`` new tokens of its completion (a stream_interval); an engine error raises APIError."""
        n = prepared.gen.n
        started = [False] * len(choices)
        responses = self.responses(streams)
        if tokens_per_event > 1:
            responses = in_chunks_of(tokens_per_event, responses)
        async for r in responses:
            c = choices[r.index * n + r.sample_index]
            if r.token_ids and c.first_token_at is None:
                c.first_token_at = time.perf_counter()
            event = c.event(r, self._finish(r, prepared) if r.finish_reason else None)
            if event.finish_reason:
                self._record(c, started_at, len(prepared.prompt_ids[r.index]))
            event.is_first = not started[c.index]
            started[c.index] = True
            if not event.is_empty or event.is_first:
                yield event

    async def collect(self, prepared: Prepared, streams: list[RequestStream], started_at: float,
                      choices: list[Choice] | None = None) -> list[Choice]:
        """Runs every completion to its end (non-streaming), gathered in ``choices`` (default: new_choices)."""
        choices = self.new_choices(prepared) if choices is None else choices
        async for _ in self.events(prepared, streams, choices, started_at):
            pass
        return choices

    async def response(self, req: AnyRequest, prepared: Prepared, choices: list[Choice]) -> responses.Response:
        """The whole answer, encoded in pieces (encoding.encode_pieces) in this server's thread pool, off the event
        loop: one piece is sent with its length, more are streamed as they are made, so that an answer of
        per-token scores (85 MB for an 8,100-token prompt echoed with 20 alternatives into 5 completions) is
        never held whole and holds the interpreter ~1 ms at a time."""
        loop = asyncio.get_running_loop()

        def start() -> tuple:
            pieces = encode_pieces(self.renderer(req, prepared).response(choices, prepared.num_prompt_tokens))
            return pieces, next(pieces), next(pieces, None)

        pieces, first, second = await loop.run_in_executor(self._pool, start)
        if second is None:
            return responses.Response(first, media_type="application/json")

        async def rest() -> AsyncIterator[str]:
            yield first
            yield second
            async for piece in self._made_in_pool(pieces):
                yield piece

        return responses.StreamingResponse(rest(), media_type="application/json")

    async def _made_in_pool(self, pieces: Iterator[str]) -> AsyncIterator[str]:
        """The rest of ``pieces`` (encoding.encode_pieces), each made in the thread pool."""
        loop = asyncio.get_running_loop()
        while (piece := await loop.run_in_executor(self._pool, next, pieces, None)) is not None:
            yield piece

    async def stream(self, req: AnyRequest, prepared: Prepared, streams: list[RequestStream], started_at: float,
                     choices: list[Choice] | None = None) -> AsyncIterator[str]:
        """SSE lines of a streamed completion (chat or text), as OpenAI sends them; [DONE] last. The completions
        are gathered in ``choices`` (default: new_choices)."""
        renderer = self.renderer(req, prepared)
        choices = self.new_choices(prepared) if choices is None else choices
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk_body(entry: dict) -> dict:
            body = renderer.chunk_body([entry])
            if include_usage:
                body["usage"] = usage(prepared.num_prompt_tokens, choices) if continuous else None
            return body

        for entry in renderer.prelude(choices):
            yield sse(chunk_body(entry))
        loop = asyncio.get_running_loop()
        try:
            async for event in self.events(prepared, streams, choices, started_at, self.stream_interval):
                if not event.prompt_logprobs:
                    for entry in renderer.chunks(event):
                        yield sse(chunk_body(entry))
                    continue
                # a scored prompt's echo: built and encoded in pieces in the thread pool, off the event loop
                for entry in await loop.run_in_executor(self._pool, renderer.chunks, event):
                    yield "data: "
                    async for piece in self._made_in_pool(encode_pieces(chunk_body(entry))):
                        yield piece
                    yield "\n\n"
        except APIError as e:
            yield sse(error_body(e.status, e.message, e.param, e.code))
            return
        if include_usage:
            yield sse({**renderer.chunk_body([]), "usage": usage(prepared.num_prompt_tokens, choices)})
        yield sse("[DONE]")
