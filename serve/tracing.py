"""OpenTelemetry traces of the api_server's requests (``ServerConfig.otlp_traces_endpoint``, as vLLM's
``--otlp-traces-endpoint``), exported over OTLP/HTTP (protobuf) to a collector (Jaeger, Tempo, the
OpenTelemetry Collector). Imported only when tracing is on: a server without it loads no OpenTelemetry SDK or
exporter (FastAPI itself imports the OpenTelemetry API, which does nothing without a provider).

The SERVER span of a request is FastAPI's native telemetry on this server's own TracerProvider
(``FastAPI(telemetry=RequestTracing.telemetry)``): ``POST /v1/chat/completions`` (/v1/completions, /v1/responses,
/v1/embeddings; no other route is traced), from its arrival to the last byte of its answer (a stream's last event),
child of the W3C ``traceparent`` the client sent, with HTTP's attributes (method, route, status; ERROR for a 5xx).
The route adds vLLM's attributes (``gen_ai.request.*``, ``gen_ai.usage.*``, ``gen_ai.latency.*`` in seconds) and,
for a generation the engine ran, four child spans, its phases on the server's clock:

    arrival ── prepare ──> submitted ── queue ──> scheduled ── prefill ──> first token ── decode ──> end
    (body, admission,        (the engine's wait for a   (the prompt's      (every completion's tokens; a
     tokenization, template,  batch slot and KV blocks:  forward, in        whole answer's encoding; the end
     grammar compile)         until its first step is    chunks)            is the stream's last event)
                              planned)

``gen_ai.latency.time_in_queue`` is the queue phase (RequestOutput.scheduled_at, the engine's clock, taken to the
server's), ``lmkit.latency.time_in_prepare`` the prepare phase, ``time_in_model_prefill`` the prefill phase,
``time_to_first_token`` the three together. Spans go to a
BatchSpanProcessor, whose own thread encodes and sends them: the event loop only starts and ends spans.
``OTEL_EXPORTER_OTLP_*`` variables configure the exporter as usual (headers, timeout, compression) and
``OTEL_SERVICE_NAME`` names the service (default ``lmkit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from lmkit.engine import Engine
from lmkit.serve.gate import route_path
from lmkit.serve.protocol import CompletionRequest

TRACED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"})
"""The routes whose POSTs are traced."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given, or with /v1/traces when it has no path."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


def _resource() -> Resource:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), named lmkit when those name no service."""
    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: "lmkit"}))
    return detected


def _not_traced(scope) -> bool:
    return scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in TRACED_ROUTES


class RequestTracing:
    """The tracer of one server: its own TracerProvider (not the process's global one, so that several servers
    live in one process), exporting to ``endpoint`` (traces_url) in a BatchSpanProcessor's thread."""

    def __init__(self, endpoint: str, model_name: str):
        self.model_name = model_name
        self.provider = TracerProvider(resource=_resource())
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self._tracer = self.provider.get_tracer("lmkit.serve")

    @property
    def telemetry(self) -> dict:
        """FastAPI's native telemetry settings: a SERVER span per request to a TRACED_ROUTES route on this
        provider, nothing else (no metrics, logs, spans of FastAPI's own steps, global providers)."""
        return {"tracer_provider": self.provider, "tracing": True, "metrics": False, "logs": False,
                "operation_spans": False, "auto_configure": False, "exclude": _not_traced}

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The app's lifespan: at shutdown the spans left are exported (in a thread) and the exporter closed."""
        yield
        await asyncio.to_thread(self.provider.shutdown)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Exports the ended spans now (blocking: call it off the event loop); False when time ran out."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def generation(self, body, prepared, choices, streams=()) -> "GenerationTrace | None":
        """The trace of the current request, a generation the engine has just been given (``body``: the
        ChatCompletionRequest, CompletionRequest or ResponsesRequest; ``prepared``: its openai_serving.Prepared
        (responses.PreparedResponse); ``choices``: its
        stream.Choice, filled as it runs; ``streams``: its engine requests, lmkit.engine.RequestStream, whose
        timing says when the engine first scheduled them); None outside a traced request."""
        span = trace.get_current_span()
        if not span.is_recording() or span.attributes.get("http.route") not in TRACED_ROUTES:
            return None
        return GenerationTrace(self._tracer, span, self.model_name, body, prepared, choices, streams)

    def embedded(self, answer: dict) -> None:
        """Adds an embedding answer (the /v1/embeddings body) to the current request's span."""
        span = trace.get_current_span()
        span.set_attributes({"gen_ai.operation.name": "embeddings", "gen_ai.request.model": self.model_name,
                             "gen_ai.response.model": answer["model"],
                             "gen_ai.usage.prompt_tokens": answer["usage"]["prompt_tokens"],
                             "lmkit.request.num_prompts": len(answer["data"])})


class GenerationTrace:
    """The attributes and phases (see the module's docstring) of one generation request on its SERVER span.
    ``end()`` (once; later calls do nothing) once the answer is made, before its last byte is sent: FastAPI ends
    the span then."""

    def __init__(self, tracer: trace.Tracer, span, model_name: str, body, prepared, choices, streams=()):
        self._tracer = tracer
        self.span = span
        self.prepared = prepared
        self.choices = choices
        self.streams = streams
        self.submitted_at = time.perf_counter()
        self._engine_offset = self.submitted_at - Engine.now()  # the engine's clock -> perf_counter seconds
        self._epoch_ns = time.time_ns() - int(self.submitted_at * 1e9)  # perf_counter seconds -> epoch ns
        self._ended = False
        gen = prepared.gen
        span.set_attributes({
            "gen_ai.operation.name": "text_completion" if isinstance(body, CompletionRequest) else "chat",
            "gen_ai.request.model": model_name, "gen_ai.response.model": model_name,
            "gen_ai.request.max_tokens": gen.max_new_tokens, "gen_ai.request.temperature": gen.temperature,
            "gen_ai.request.top_p": gen.top_p, "gen_ai.request.n": gen.n, "lmkit.request.stream": body.stream,
            "lmkit.request.num_prompts": len(prepared.prompt_ids),
            "gen_ai.usage.prompt_tokens": prepared.num_prompt_tokens})

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * 1e9)

    def end(self) -> None:
        """Adds usage, finish reasons, latencies and the phases' child spans. Nothing once the span has ended
        (a stream closed after the client left)."""
        if self._ended or not self.span.is_recording():
            return
        self._ended = True
        ended_ns = self._ns(time.perf_counter())
        started_ns, submitted_ns = self.span.start_time, self._ns(self.submitted_at)
        choices = self.choices
        first = min((c.first_token_at for c in choices if c.first_token_at is not None), default=None)
        scheduled = min((s.timing.scheduled_at for stream in self.streams for s in stream.states
                         if s.timing.scheduled_at is not None), default=None)
        attributes = {
            "gen_ai.usage.completion_tokens": sum(c.num_tokens for c in choices),
            "gen_ai.usage.num_sequences": len(choices),
            # "abort": a completion that did not finish (the client left, an error, the server stopped it)
            "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in choices],
            "gen_ai.latency.e2e": (ended_ns - started_ns) / 1e9}
        if self.prepared.response_id is not None:
            attributes["gen_ai.request.id"] = self.prepared.response_id
        phases = [("prepare", started_ns, submitted_ns)]
        queued_ns = submitted_ns  # the end of the engine's queue: its first step for the request was planned
        if scheduled is not None:
            queued_ns = min(max(submitted_ns, self._ns(scheduled + self._engine_offset)), ended_ns)
            phases.append(("queue", submitted_ns, queued_ns))
        attributes.update({"lmkit.latency.time_in_prepare": (submitted_ns - started_ns) / 1e9,
                           "gen_ai.latency.time_in_queue": (queued_ns - submitted_ns) / 1e9})
        if first is not None:
            first_ns = max(self._ns(first), queued_ns)
            attributes.update({"gen_ai.latency.time_to_first_token": (first_ns - started_ns) / 1e9,
                               "gen_ai.latency.time_in_model_prefill": (first_ns - queued_ns) / 1e9,
                               "gen_ai.latency.time_in_model_decode": (ended_ns - first_ns) / 1e9})
            phases += [("prefill", queued_ns, first_ns), ("decode", first_ns, ended_ns)]
        self.span.set_attributes(attributes)
        parent = trace.set_span_in_context(self.span)
        for name, start_ns, end_ns in phases:
            self._tracer.start_span(name, parent, SpanKind.INTERNAL, start_time=start_ns).end(end_ns)

    async def until_end(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's SSE ``lines``; ``end()`` when they end (before the response's last message), however."""
        try:
            async for line in lines:
                yield line
        finally:
            self.end()
