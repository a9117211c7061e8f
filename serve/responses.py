"""POST /v1/responses (OpenAI's Responses API) on the chat path: a request becomes the chat request that answers it
(serve/responses_protocol.py), which OpenAIServing prepares, runs and turns into ChoiceEvents (serve/stream.py);
those events become the Response's output items: a ``reasoning`` item (the thinking, as reasoning_text content),
``message`` items (one output_text each) and ``function_call`` items, in the order the answer writes them.

Streamed, the same items go out as OpenAI's typed SSE events (``event: TYPE`` and ``data: {...}`` with a
``sequence_number``): response.created, response.in_progress, then per item output_item.added, its content part
and text (or arguments) deltas and their done events, output_item.done, and last response.completed or
response.incomplete (an engine failure: an error event, then response.failed). The whole and the streamed response
are built by one OutputItems from one event stream, so they cannot differ.

``previous_response_id`` continues a response kept by ResponseStore: a bounded, in-memory store, off unless the
server is given a size (ServerConfig.responses_store_max_bytes); a response with ``store: false`` is never kept.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import responses
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from lmkit.engine import RequestStream
from lmkit.serve.encoding import dumps
from lmkit.serve.errors import APIError, bad_request, validation_error
from lmkit.serve.openai_serving import OpenAIServing, Prepared
from lmkit.serve.protocol import ChatCompletionRequest
from lmkit.serve.responses_protocol import InputItem, ResponsesRequest, chat_messages, responses_param
from lmkit.serve.stream import Choice, ChoiceEvent

log = logging.getLogger("lmkit.serve")

_ITEMS = TypeAdapter(list[InputItem])
ENTRY_OVERHEAD_BYTES = 1024
"""What a kept response costs beyond its text (its Response object, dicts, the store's own record)."""


def approx_bytes(value) -> int:
    """About the memory of a JSON-like value: its strings' lengths plus a few words per container and number."""
    if isinstance(value, str):
        return len(value) + 48
    if isinstance(value, dict):
        return 64 + sum(approx_bytes(k) + approx_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 56 + sum(approx_bytes(v) for v in value)
    return 32


def renamed(e: APIError) -> APIError:
    """A chat request's error as the Responses request's: its parameter by the name the client sent."""
    param = responses_param(e.param)
    if param == e.param:
        return e
    message = e.message.replace(e.param, param) if e.param and ("_" in e.param or "." in e.param) else e.message
    return APIError(e.status, message, param, e.code, e.headers)


@dataclass
class StoredResponse:
    """A kept response: its Response object and its chat so far (input without instructions, and output)."""

    body: dict
    messages: list[dict]
    num_chat_bytes: int
    """approx_bytes of ``messages``."""
    num_bytes: int
    """What it costs the store: ENTRY_OVERHEAD_BYTES, its chat and the text of its body."""


class ResponseStore:
    """Responses kept for ``previous_response_id`` and GET /v1/responses/{id}, least recently used evicted first
    while their approximate bytes exceed ``max_bytes`` (0: keeps none). A response counts its whole chat, the
    history it continued included (which its messages share with the response before it, so the count is an upper
    bound). Event-loop only (no locks). Invariant: ``num_bytes`` is the sum of the kept entries' and <=
    ``max_bytes``."""

    def __init__(self, max_bytes: int = 0):
        if max_bytes < 0:
            raise ValueError(f"responses_store_max_bytes must be >= 0 (0: keeps none), got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def is_on(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The kept response (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keeps ``entry``, evicting the least recently used until all fit; False (nothing kept) when it alone is
        larger than the store."""
        if entry.num_bytes > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        while self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry is not None

    def __repr__(self) -> str:
        return f"ResponseStore({len(self._entries)} responses, {self.num_bytes}/{self.max_bytes} bytes)"


_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """One response's output items, built from its completion's ChoiceEvents as they come: ``feed`` returns the
    stream events (without sequence numbers) of what it added, ``finish`` those that close the last item. An
    answer without any output gets one empty message. ``num_reasoning_tokens``: the tokens before the first
    message or call, when the answer thought."""

    def __init__(self):
        self.items: list[dict] = []
        """The closed items."""
        self.num_reasoning_tokens = 0
        self._kind: str | None = None  # of the open item: reasoning | message | function_call
        self._id = ""
        self._parts: list[str] = []  # the open item's text (or arguments) so far
        self._call = ("", "")  # (call_id, name) of an open function call
        self._thought = False
        self._answered = False
        self._num_tokens_before_answer = 0

    def feed(self, e: ChoiceEvent) -> list[dict]:
        out: list[dict] = []
        if e.reasoning:
            out += self._add("reasoning", e.reasoning)
        if e.text:
            out += self._add("message", e.text)
        for delta in e.tool_calls:
            if delta.name is not None:  # a call's first delta
                out += self._close("completed")
                out += self._open("function_call", (delta.id, delta.name))
            if delta.arguments:
                out += self._delta(delta.arguments)
        if not self._answered:
            if self._kind in ("message", "function_call"):
                self._answered = True
                self.num_reasoning_tokens = self._num_tokens_before_answer if self._thought else 0
            else:
                self._num_tokens_before_answer += len(e.token_ids)
        return out

    def finish(self, is_incomplete: bool) -> list[dict]:
        """Closes the open item (status incomplete when the answer was cut short)."""
        out: list[dict] = []
        if not self.items and self._kind is None:
            out += self._open("message")
        if not self._answered and self._thought:
            self.num_reasoning_tokens = self._num_tokens_before_answer
        return out + self._close("incomplete" if is_incomplete else "completed")

    def _add(self, kind: str, text: str) -> list[dict]:
        out = [] if self._kind == kind else self._close("completed") + self._open(kind)
        return out + self._delta(text)

    def _where(self) -> dict:
        return {"item_id": self._id, "output_index": len(self.items)}

    def _item(self, status: str, text: str | None) -> dict:
        """The open item with ``text`` (None: the item as added, before its content)."""
        if self._kind == "function_call":
            return {"id": self._id, "type": "function_call", "call_id": self._call[0], "name": self._call[1],
                    "arguments": text or "", "status": status}
        parts = [] if text is None else [self._part(text)]
        if self._kind == "reasoning":
            return {"id": self._id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": self._id, "type": "message", "role": "assistant", "status": status, "content": parts}

    def _part(self, text: str) -> dict:
        if self._kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _open(self, kind: str, call: tuple[str, str] = ("", "")) -> list[dict]:
        self._kind, self._id, self._parts, self._call = kind, _new_id(_PREFIX[kind]), [], call
        self._thought = self._thought or kind == "reasoning"
        out = [{"type": "response.output_item.added", "output_index": len(self.items),
                "item": self._item("in_progress", None)}]
        if kind != "function_call":
            out.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                        "part": self._part("")})
        return out

    def _delta(self, text: str) -> list[dict]:
        self._parts.append(text)
        if self._kind == "function_call":
            return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": text}]
        if self._kind == "reasoning":
            return [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": text}]
        return [{"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                 "logprobs": []}]

    def _close(self, status: str) -> list[dict]:
        if self._kind is None:
            return []
        text = "".join(self._parts)
        item = self._item(status, text)
        where = self._where()
        if self._kind == "function_call":
            out = [{"type": "response.function_call_arguments.done", **where, "name": self._call[1],
                    "arguments": text}]
        else:
            done = ({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
                    if self._kind == "reasoning" else
                    {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []})
            out = [done, {"type": "response.content_part.done", **where, "content_index": 0,
                          "part": self._part(text)}]
        out.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})
        self.items.append(item)
        self._kind = None
        return out


@dataclass
class PreparedResponse:
    """A validated Responses request: the chat request that answers it, prepared, and what its Response says."""

    prepared: Prepared
    messages: list[dict]
    """Its chat without instructions (the previous response's, then this input): what the store keeps."""
    num_input_bytes: int
    """approx_bytes of ``messages``."""
    settings: dict
    """The request's settings its Response repeats (ResponsesRequest.settings)."""
    is_stored: bool
    id: str
    created_at: int
    output: OutputItems = field(default_factory=OutputItems)
    """The answer's items, as they are made."""

    # what a trace span reads of a prepared request (serve/tracing.py)
    @property
    def gen(self):
        return self.prepared.gen

    @property
    def prompt_ids(self) -> list[list[int]]:
        return self.prepared.prompt_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.prepared.num_prompt_tokens

    @property
    def response_id(self) -> str:
        return self.id


class ResponsesServing:
    """Answers /v1/responses next to an OpenAIServing (its engine, model, preparation pool and event stream), with
    the methods the api_server's ``complete`` calls (prepare, submit, collect, response, stream)."""

    def __init__(self, serving: OpenAIServing, store_max_bytes: int = 0):
        self.serving = serving
        self.store = ResponseStore(store_max_bytes)

    # ---- request -> chat request ------------------------------------------------------------------------

    def _previous(self, response_id: str) -> StoredResponse:
        if not self.store.is_on:
            raise bad_request("previous_response_id needs a server that keeps responses: start it with "
                              "--responses-store-max-bytes N (the memory it may use), or send the whole "
                              "conversation as input", "previous_response_id")
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(400, f"Previous response with id '{response_id}' not found: it was never kept (sent with "
                                "store false, or to another server), or it was evicted to keep the store within its "
                                "--responses-store-max-bytes", "previous_response_id", "previous_response_not_found")
        return entry

    def _chat(self, body: ResponsesRequest, history: list[dict], history_bytes: int):
        """(chat request, its chat without instructions, approx_bytes of that chat, the settings its Response
        repeats), in the preparation pool."""
        new = body.input_messages()
        messages = [*history, *new]
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body(messages))
        except ValidationError as e:
            raise renamed(validation_error(RequestValidationError(e.errors()))) from None
        except APIError as e:
            raise renamed(e) from None
        return chat, messages, history_bytes + approx_bytes(new), body.settings()

    async def prepare(self, body: ResponsesRequest) -> PreparedResponse:
        """The chat request of ``body``, prepared (off the event loop); APIError 400 naming the Responses
        parameter, 404 for another model."""
        self.serving.check_model(body.model)
        history, history_bytes = [], 0
        if body.previous_response_id is not None:
            entry = self._previous(body.previous_response_id)
            history, history_bytes = entry.messages, entry.num_chat_bytes
        self.serving.num_preparing += 1
        try:
            chat, messages, num_bytes, settings = await self.serving.in_pool(self._chat, body, history, history_bytes)
        finally:
            self.serving.num_preparing -= 1
        try:
            prepared = await self.serving.prepare(chat)
        except APIError as e:
            raise renamed(e) from None
        return PreparedResponse(prepared, messages, num_bytes, settings,
                                self.store.is_on and body.store is not False, _new_id("resp"), int(time.time()))

    def submit(self, p: PreparedResponse) -> list[RequestStream]:
        return self.serving.submit(p.prepared)

    # ---- events -> Response --------------------------------------------------------------------------------

    async def _events(self, p: PreparedResponse, streams: list[RequestStream], choices: list[Choice],
                      started_at: float) -> AsyncIterator[ChoiceEvent]:
        """The completion's events, in the chunks a stream sends (whole and streamed alike); APIError renamed."""
        try:
            async for event in self.serving.events(p.prepared, streams, choices, started_at,
                                                   self.serving.stream_interval):
                yield event
        except APIError as e:
            raise renamed(e) from None

    def _body(self, p: PreparedResponse, status: str, choice: Choice | None = None, error: dict | None = None) -> dict:
        """The Response object with the items closed so far; usage once ``choice`` has finished."""
        gen = p.prepared.gen
        usage = None
        if choice is not None:
            num_input = p.prepared.num_prompt_tokens
            usage = {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens": choice.num_tokens,
                     "output_tokens_details": {"reasoning_tokens": p.output.num_reasoning_tokens},
                     "total_tokens": num_input + choice.num_tokens}
        return {
            "id": p.id, "object": "response", "created_at": p.created_at, "status": status, "background": False,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.serving.model_name, "output": list(p.output.items), "store": p.is_stored,
            "temperature": gen.temperature if gen.do_sample else 0.0, "top_p": gen.top_p if gen.do_sample else 1.0,
            **p.settings, "usage": usage, **({"completed_at": int(time.time())} if status == "completed" else {}),
        }

    def _final(self, p: PreparedResponse, choice: Choice) -> dict:
        """The finished Response (completed, or incomplete when cut at max_output_tokens); kept where it may be."""
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        final = self._body(p, status, choice)
        if p.is_stored:
            answer = chat_messages(_ITEMS.validate_python(p.output.items))
            num_answer_bytes = approx_bytes(answer)
            num_chat_bytes = p.num_input_bytes + num_answer_bytes
            num_bytes = ENTRY_OVERHEAD_BYTES + num_chat_bytes + num_answer_bytes  # the body holds the answer again
            if not self.store.put(p.id, StoredResponse(final, [*p.messages, *answer], num_chat_bytes, num_bytes)):
                log.info("response %s not kept: its %d bytes exceed --responses-store-max-bytes %d", p.id, num_bytes,
                         self.store.max_bytes)
        return final

    def new_choices(self, p: PreparedResponse) -> list[Choice]:
        return self.serving.new_choices(p.prepared)

    async def collect(self, p: PreparedResponse, streams: list[RequestStream], started_at: float,
                      choices: list[Choice]) -> list[Choice]:
        """Runs the completion to its end (non-streaming), its items made in ``p.output``."""
        async for event in self._events(p, streams, choices, started_at):
            p.output.feed(event)
        p.output.finish(choices[0].finish_reason == "length")
        return choices

    async def response(self, body: ResponsesRequest, p: PreparedResponse, choices: list[Choice]) -> responses.Response:
        """The Response of a collected completion, encoded in the preparation pool."""
        final = self._final(p, choices[0])
        content = await self.serving.in_pool(dumps, final)
        return responses.Response(content, media_type="application/json")

    async def stream(self, body: ResponsesRequest, p: PreparedResponse, streams: list[RequestStream],
                     started_at: float, choices: list[Choice]) -> AsyncIterator[str]:
        """The SSE lines of a streamed response, as OpenAI sends them."""
        numbers = itertools.count()

        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {dumps({**event, 'sequence_number': next(numbers)})}\n\n"

        yield sse({"type": "response.created", "response": self._body(p, "in_progress")})
        yield sse({"type": "response.in_progress", "response": self._body(p, "in_progress")})
        output = p.output
        try:
            async for event in self._events(p, streams, choices, started_at):
                for e in output.feed(event):
                    yield sse(e)
        except APIError as e:
            yield sse({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            error = {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message}
            yield sse({"type": "response.failed", "response": self._body(p, "failed", error=error)})
            return
        for e in output.finish(choices[0].finish_reason == "length"):
            yield sse(e)
        final = self._final(p, choices[0])
        yield sse({"type": f"response.{final['status']}", "response": final})

    # ---- GET and DELETE /v1/responses/{id} ---------------------------------------------------------------

    def _kept(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"No response with id '{response_id}' is kept here"
                                + ("" if self.store.is_on else " (this server keeps none: --responses-store-max-bytes "
                                                                "0)"), None, "not_found")
        return entry

    def retrieve(self, response_id: str) -> dict:
        return self._kept(response_id).body

    def delete(self, response_id: str) -> dict:
        self._kept(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
