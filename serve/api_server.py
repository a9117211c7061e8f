"""The OpenAI-compatible HTTP server of one model.

``create_app(engine, config)`` is the ASGI app (FastAPI behind a ``Gate``); ``run_api_server`` loads the
model, serves it with uvicorn and, when ``proxy_url`` is set, registers with that proxy once the socket
accepts requests (and unregisters when it begins to shut down). Generation requests are admitted by the
sequences they run (``Admission``: 429 beyond the engine's batch plus as many waiting).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (and GET, DELETE
/v1/responses/{id}: serve/responses.py), GET /v1/models, GET /health (liveness), GET /ready
(readiness: serve/readiness.py), GET /metrics, GET / (the chat page: serve/web).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmkit.cpus import format_cpu_list, move_other_threads
from lmkit.engine import AsyncEngine
from lmkit.serve.admission import Admission, Reservation
from lmkit.serve.asgi import OffLoopJSONRoute, run_event_loop, serve_app, unless_disconnected
from lmkit.serve.embeddings import DetokenizeRequest, EmbeddingRequest, EmbeddingServing, TokenizeRequest
from lmkit.serve.errors import APIError, error_body, install_error_handlers
from lmkit.serve.gate import GATE_SCOPE_KEY, Gate, GateConfig, drain_ended_message, warn_if_exposed
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.openai_serving import OpenAIServing, num_prepare_threads, sse
from lmkit.serve.readiness import Readiness
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.serve.reasoning import HarmonyFormat, detect_reasoning_format, reasoning_format
from lmkit.serve.responses import ResponsesRequest, ResponsesServing
from lmkit.serve.tools.parsers import OpenAIToolParser, detect_tool_parser, tool_parser_class
from lmkit.serve.web import add_web_ui

log = logging.getLogger("lmkit.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServerConfig:
    """How the api_server listens and whom it serves."""

    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface, then set API keys)."""
    port: int = 23333
    """TCP port."""
    model_name: str | None = None
    """The name clients pass as `model`; default: the model folder's name."""
    gate: GateConfig = field(default_factory=GateConfig)
    """API keys, body size limit, concurrent request limit, header/body timeouts, drain time."""
    max_waiting_seqs: int | None = None
    """Sequences (prompts x n) admitted beyond the engine's max_batch_size running, to wait for a slot;
    a request beyond gets 429. None: max_batch_size (the server admits twice the batch)."""
    proxy_url: str | None = None
    """Register with this lmkit proxy once ready (POST {proxy_url}/nodes/add)."""
    proxy_admin_key: str | None = None
    """The proxy's --admin-key, when it has one."""
    advertise_url: str | None = None
    """The URL the proxy should use for this server; default: http://HOST:PORT (this host's address for 0.0.0.0)."""
    health_timeout_s: float = 5.0
    """/health and /ready fail when the engine does not answer within this time."""
    ready_max_preparing: int | None = None
    """/ready answers 503 while more requests than this wait for preparation (tokenization, templates); None:
    four per preparation thread."""
    ready_stall_s: float = 30.0
    """/ready answers 503 while the engine holds requests and has not stepped for this many seconds."""
    tool_call_parser: str = "auto"
    """How tool calls are written: hermes, llama3_json, mistral, qwen3_coder, openai (gpt-oss), gemma4, generic
    (JSON taught by a system message: serve/tools/generic.py); auto: the format the chat template teaches, else
    generic; none: requests with tools get a 400."""
    reasoning_parser: str = "auto"
    """How thinking is marked: qwen3, deepseek_r1, openai_gptoss, gemma4; auto: the one the chat template writes
    (serve/reasoning.py detect_reasoning_format); none: the thinking stays in content."""
    stream_interval: int = 1
    """Tokens per chunk of a streamed completion (vLLM's and SGLang's --stream-interval): a completion's first
    token and its end are sent at once, the tokens between in chunks of this many. Larger: less work per
    token in the server and whatever relays its stream (a Ray replica's transport), a less smooth stream."""
    web_ui: bool = True
    """Serve the chat page (serve/web) at GET /, open without an API key (it asks the user for one); False: /
    answers 404."""
    responses_store_max_bytes: int = 0
    """Memory (approximate bytes of input and output) for keeping /v1/responses answers, so that a request may
    continue one by previous_response_id (and GET or DELETE it), least recently used evicted first; 0: none kept."""
    otlp_traces_endpoint: str | None = None
    """Send an OpenTelemetry span per generation and embedding request to this OTLP/HTTP collector URL
    (http://HOST:4318, or the whole URL of its /v1/traces), as vLLM's --otlp-traces-endpoint (serve/tracing.py;
    needs pip install -e ".[otel]"); None: no tracing."""

    def __post_init__(self) -> None:
        if not (isinstance(self.stream_interval, int) and self.stream_interval >= 1):
            raise ValueError(f"stream_interval must be an integer >= 1 (tokens per streamed chunk), got "
                             f"{self.stream_interval!r}")
        if self.max_waiting_seqs is not None and self.max_waiting_seqs < 0:
            raise ValueError(f"max_waiting_seqs must be >= 0 (0: admit only what runs at once), got "
                             f"{self.max_waiting_seqs}")
        if self.tool_call_parser not in ("auto", "none"):
            tool_parser_class(self.tool_call_parser)
        if self.reasoning_parser not in ("auto", "none"):
            reasoning_format(self.reasoning_parser)
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint must be an OTLP/HTTP URL, http(s)://HOST:PORT[/v1/traces], got "
                             f"{self.otlp_traces_endpoint!r}")

    def parsers(self, chat_template: str | None):
        """(tool parser class, reasoning format) for a model with this chat template."""
        if self.tool_call_parser == "auto":
            tools = detect_tool_parser(chat_template)
        else:
            tools = None if self.tool_call_parser == "none" else tool_parser_class(self.tool_call_parser)
        if self.reasoning_parser == "auto":
            reasoning = detect_reasoning_format(chat_template)
        else:
            reasoning = None if self.reasoning_parser == "none" else reasoning_format(self.reasoning_parser)
        if tools is OpenAIToolParser and not isinstance(reasoning, HarmonyFormat):
            raise ValueError("--tool-call-parser openai reads the calls --reasoning-parser openai_gptoss passes on "
                             "(gpt-oss's harmony channels): use both, or leave both on auto")
        return tools, reasoning

    @property
    def url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"


def _cancel_all(streams) -> None:
    """Cancels whatever is still running (a stream the client left before it started has no finally)."""
    for s in streams:
        s.cancel()


async def until_drain_ends(lines: AsyncIterator[str], gate: Gate) -> AsyncIterator[str]:
    """The SSE ``lines`` of a stream, ended by an error event when the server's drain time runs out (the gate's
    drain_ended) rather than by a cut connection, which a client cannot tell from a network fault. Once the drain
    has begun each line is raced against that end; a stream that sends nothing from the drain's start to its end
    is cut as before."""
    iterator = aiter(lines)
    while not gate.is_draining:
        try:
            line = await anext(iterator)
        except StopAsyncIteration:
            return
        yield line
    ended = asyncio.ensure_future(gate.drain_ended.wait())
    try:
        while True:
            following = asyncio.ensure_future(anext(iterator))
            await asyncio.wait({following, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await following
                yield sse(error_body(503, drain_ended_message(gate.config.drain_timeout_s), None,
                                     "server_shutting_down"))
                return
            try:
                line = following.result()
            except StopAsyncIteration:
                return
            yield line
    finally:
        ended.cancel()


class _Streamed(StreamingResponse):
    """An SSE response that, however it ends (finished, client gone, cancelled at shutdown, even before its
    first chunk), cancels its engine requests and releases its admitted sequences; at the end of a drain, with
    an error event (until_drain_ends)."""

    def __init__(self, content, streams, reservation: Reservation):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.streams = streams
        self.reservation = reservation

    async def __call__(self, scope, receive, send) -> None:
        gate = scope.get(GATE_SCOPE_KEY)
        if gate is not None:
            self.body_iterator = until_drain_ends(self.body_iterator, gate)
        try:
            await super().__call__(scope, receive, send)
        finally:
            _cancel_all(self.streams)
            self.reservation.release()


def default_max_body_bytes(session_len: int) -> int:
    """The api_server's body limit unless one is given: room for a prompt of the whole context (32 bytes per
    token: JSON-escaped non-ASCII text, or token ids, fit), at least 1 MiB. A body of tiny JSON values takes
    ~0.1 s per MiB to parse, holding the GIL, so the limit also bounds what one body can stall."""
    return max(2**20, 32 * session_len)


def create_app(engine: AsyncEngine, config: ServerConfig | None = None) -> Gate:
    """The ASGI app serving ``engine``. The caller owns the engine (and closes it)."""
    config = config or ServerConfig()
    model_name = config.model_name or Path(str(engine.engine.model_path)).name
    max_batch_size = engine.engine.config.max_batch_size
    admission = Admission(max_batch_size, max_batch_size if config.max_waiting_seqs is None else
                          config.max_waiting_seqs)
    metrics = ServerMetrics(engine.engine, admission, model_name)
    tool_parser, reasoning = config.parsers(engine.tokenizer.chat_template)
    serving = OpenAIServing(engine, model_name, metrics, tool_parser, reasoning, config.stream_interval)
    tracing = None
    if config.otlp_traces_endpoint is not None:
        try:  # opentelemetry is imported only when tracing is on
            from lmkit.serve.tracing import RequestTracing
        except ImportError as e:
            raise RuntimeError(f'otlp_traces_endpoint needs OpenTelemetry: pip install -e ".[otel]" ({e})') from None
        tracing = RequestTracing(config.otlp_traces_endpoint, model_name)
    app = FastAPI(title="lmkit api_server", version="0.1.0",
                  description=f"OpenAI-compatible API serving `{model_name}`.",
                  **({"telemetry": tracing.telemetry, "lifespan": tracing.lifespan} if tracing else {}))
    app.state.tracing = tracing
    app.router.route_class = OffLoopJSONRoute  # request bodies are parsed off the event loop
    app.state.serving = serving
    app.state.admission = admission
    install_error_handlers(app)

    @app.get("/v1/models", summary="The served model")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    async def complete(body, request: Request, handler=serving):
        """One OpenAI completion request, answered by ``handler`` (OpenAIServing, or ResponsesServing for
        /v1/responses): SSE when body.stream, else one JSON body (cancelled when the client disconnects first).
        Its sequences are admitted first (429 beyond the limit) and released when it ends, however it ends."""
        started_at = time.perf_counter()
        num_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
        reservation = admission.admit(num_prompts, body.n)
        try:
            prepared = await handler.prepare(body)
            streams = handler.submit(prepared)
        except BaseException:
            reservation.release()
            raise
        choices = handler.new_choices(prepared)
        request_trace = tracing.generation(body, prepared, choices, streams) if tracing is not None else None
        if body.stream:
            lines = handler.stream(body, prepared, streams, started_at, choices)
            return _Streamed(lines if request_trace is None else request_trace.until_end(lines), streams, reservation)

        async def run():
            try:
                await handler.collect(prepared, streams, started_at, choices)
            except APIError as e:
                return e.response()
            finally:
                _cancel_all(streams)
            return await handler.response(body, prepared, choices)

        try:
            return await unless_disconnected(request, run())
        finally:
            reservation.release()
            if request_trace is not None:
                request_trace.end()

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI)")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await complete(body, request)

    @app.post("/v1/completions", summary="Text completion (OpenAI legacy)")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(body, request)

    responding = ResponsesServing(serving, config.responses_store_max_bytes)

    @app.post("/v1/responses", summary="Model response (OpenAI Responses API)")
    async def create_response(body: ResponsesRequest, request: Request):
        return await complete(body, request, responding)

    @app.get("/v1/responses/{response_id}", summary="A kept response (--responses-store-max-bytes)")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responding.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}", summary="Forget a kept response")
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(responding.delete(response_id))

    embedding = EmbeddingServing(serving, admission)

    @app.post("/v1/embeddings", summary="Embeddings of texts or token ids (OpenAI)")
    async def embeddings(body: EmbeddingRequest, request: Request):
        async def run():
            answer = await embedding.embeddings(body)
            if tracing is not None:
                tracing.embedded(answer)
            return JSONResponse(answer)

        return await unless_disconnected(request, run())

    @app.post("/tokenize", summary="Token ids of a text or chat (vLLM)")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await embedding.tokenize(body))

    @app.post("/detokenize", summary="Text of token ids (vLLM)")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await embedding.detokenize(body))

    async def engine_metrics():
        try:
            return await asyncio.wait_for(asyncio.to_thread(engine.engine.metrics), config.health_timeout_s)
        except Exception as e:  # closed engine, timeout
            raise APIError(503, f"the engine does not answer: {type(e).__name__} {e}") from None

    @app.get("/health", summary="Liveness: 200 when the engine answers")
    async def health() -> Response:
        await engine_metrics()
        return Response(status_code=200)

    readiness = Readiness(config.ready_max_preparing if config.ready_max_preparing is not None
                          else 4 * num_prepare_threads(), config.ready_stall_s)

    @app.get("/ready", summary="Readiness: 200 when a request would start in reasonable time")
    async def ready() -> Response:
        m = await engine_metrics()
        why = readiness.reason_not_ready(serving.num_preparing, m.num_steps, m.num_running + m.num_waiting)
        if why is not None:
            raise APIError(503, f"not ready: {why}", None, "not_ready")
        return Response(status_code=200)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    if config.web_ui:
        add_web_ui(app)
    return Gate(app, config.gate, on_response=metrics.on_response,
                default_max_body_bytes=default_max_body_bytes(engine.engine.session_len))


async def register_with_proxy(config: ServerConfig, api_key: str | None, remove: bool = False) -> None:
    """POST this server to the proxy's /nodes/add (or /nodes/remove); retries for a while on failure."""
    import aiohttp

    route = "remove" if remove else "add"
    headers = {"Authorization": f"Bearer {config.proxy_admin_key}"} if config.proxy_admin_key else {}
    payload = {"url": config.url, **({"api_key": api_key} if api_key and not remove else {})}
    url = f"{config.proxy_url.rstrip('/')}/nodes/{route}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        for attempt in range(1 if remove else 30):
            try:
                async with session.post(url, json=payload, headers=headers) as r:
                    if r.status < 300:
                        log.info("%s %s at proxy %s", "unregistered" if remove else "registered", config.url,
                                 config.proxy_url)
                        return
                    said = (await r.text())[:300]
                    if r.status == 403:
                        log.warning("proxy %s refused to %s %s (403, its admin routes are closed): start the proxy "
                                    "with --admin-key KEY and give this server --proxy-admin-key KEY. It said: %s",
                                    config.proxy_url, route, config.url, said)
                    elif r.status == 401:
                        log.warning("proxy %s refused to %s %s (401, %s): give this server the proxy's "
                                    "--admin-key as --proxy-admin-key. It said: %s", config.proxy_url, route,
                                    config.url, "wrong admin key" if config.proxy_admin_key else "no admin key",
                                    said)
                    else:
                        log.warning("proxy %s answered %s: %s", config.proxy_url, r.status, said)
                    if 400 <= r.status < 500:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("cannot reach proxy %s: %s", config.proxy_url, e)
            await asyncio.sleep(min(2.0, 0.2 * (attempt + 1)))


def run_api_server(model: str | None, engine_config, config: ServerConfig, chat_template: str | None = None,
                   log_level: str = "info") -> None:
    """Loads ``model`` (default: the bundled SmolLM2), serves it until interrupted, then closes the engine."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(model, engine_config, chat_template=chat_template)
    try:
        binding = engine.engine.cpu_binding
        if binding is not None and binding.pinned:  # the event loop, tokenizer and pool threads off the engine's CPUs
            moved = move_other_threads(binding)
            if moved:
                log.info("%d threads of this process moved to CPUs %s", moved, format_cpu_list(binding.other_cpus))
        app = create_app(engine, config)
        api_key = config.gate.api_keys[0] if config.gate.api_keys else None
        on_ready = on_shutdown = None
        if config.proxy_url:
            async def on_ready():
                await register_with_proxy(config, api_key)

            async def on_shutdown():
                await register_with_proxy(config, None, remove=True)
        log.info("serving %s at http://%s:%d (model name %r)", engine.engine.model_path, config.host, config.port,
                 app.app.state.serving.model_name)
        warn_if_exposed(config.host, config.port, config.gate)
        run_event_loop(serve_app(app, config.host, config.port, log_level, on_ready, on_shutdown))
    finally:
        engine.close()
