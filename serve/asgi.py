"""Running the servers' ASGI apps: the event loop; uvicorn with a header timeout, a drain on SIGTERM/SIGINT
that exits 0, and hooks at ready and shutdown; and handlers that stop their work when the client goes away.
Shared by the api_server and the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import HANDLED_SIGNALS

from lmkit.serve.errors import APIError, BodyRefused, error_response, validation_error
from lmkit.serve.gate import GATE_SCOPE_KEY, Gate, drain_ended_message

log = logging.getLogger("lmkit.serve")


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Awaits ``work``; cancels it (and so its engine requests) when the client goes away first, or when the
    server's drain time runs out first (the client then gets a 503 naming it)."""
    task = asyncio.ensure_future(work)
    watches = {asyncio.ensure_future(until_disconnected(request))}
    gate = request.scope.get(GATE_SCOPE_KEY)
    if gate is not None:
        watches.add(asyncio.ensure_future(gate.drain_ended.wait()))
    try:
        await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watch in watches:
            watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        if gate is not None and gate.drain_ended.is_set():
            return error_response(503, drain_ended_message(gate.config.drain_timeout_s), None,
                                  "server_shutting_down", {"connection": "close"})
        return Response(status_code=499)  # nobody reads it
    return task.result()


class RelayedResponse(StreamingResponse):
    """A response relayed from another server (the proxy's node, a Ray replica); ``on_end()`` runs however it
    ends, also when the client left before the first chunk and the generator (with its own finally) never
    started."""

    def __init__(self, content, on_end, **kwargs):
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


_JSON_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmkit-json")
"""One thread parses request bodies. json.loads holds the GIL for its whole call (~0.1 s per MiB of
small values), so no pool makes parsing concurrent; what one thread does is hand the event loop the GIL
between bodies, so /health waits behind one parse at most, never behind every body that arrived."""


def _loads_without_gc(body: bytes):
    """json.loads with the cyclic garbage collector paused: a body of many small lists or objects would
    trigger full collections over the whole heap as it allocates (0.66 s instead of 0.07 s for 800 k one-item
    lists in a process with transformers loaded). The pool's one thread is the only one that pauses it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(body)
    finally:
        if was_enabled:
            gc.enable()


async def parse_json(body: bytes):
    """``json.loads(body)`` off the event loop (ValueError for invalid JSON, as json.loads)."""
    return await asyncio.get_running_loop().run_in_executor(_JSON_POOL, _loads_without_gc, body)


def _parse_and_validate(body: bytes, field, content_type: str | None):
    """The body parsed and, given its route's body ``field``, validated (its model, which FastAPI then takes as
    it is); BodyRefused with the answer FastAPI's validation would have given."""
    data = _loads_without_gc(body)
    if field is None:
        return data
    errors: list = []
    try:
        value, errors = field.validate(data, {}, loc=("body",))
    except APIError as e:  # a model validator's own answer
        value, refused = None, e
    else:
        refused = validation_error(RequestValidationError(errors), content_type) if errors else None
    if refused is None:
        return value
    del data, errors  # freed here, not on the event loop with the exception's frame (~80 ms for 800 k lists)
    raise BodyRefused(refused)


class _OffLoopJSONRequest(Request):
    def __init__(self, request: Request, body_field):
        super().__init__(request.scope, request.receive)
        self.body_field = body_field  # the route's: what the body is validated against

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.get_running_loop().run_in_executor(
                _JSON_POOL, _parse_and_validate, body, self.body_field, self.headers.get("content-type"))
        return self._json


class OffLoopJSONRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed and validated on the JSON thread (FastAPI does both on the
    event loop: a 1 MiB body of 200,000 one-token prompts takes ~35 ms to parse and ~70 ms to refuse)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def off_loop(request: Request):
            return await handler(_OffLoopJSONRequest(request, self.body_field))

        return off_loop


def run_event_loop(main) -> None:
    """Runs the coroutine ``main`` to completion on uvloop where it is installed (a libuv event loop: the
    servers spend a good part of their CPU relaying small SSE chunks, which it makes cheaper), else on
    asyncio's own loop. HTTP is parsed by httptools (DrainingServer's protocol)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete within
    ``header_timeout_s``: counted from the connection's opening for its first request, from a request's
    first byte on a kept-alive connection (the idle time between requests is uvicorn's keep-alive timeout).
    uvicorn has no header timeout of its own: a client that sends half a request line holds its socket."""

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug("closing %s: no complete request headers within %g s", self.client, self.header_timeout_s)
            self.transport.close()


_CLEANUP_GRACE_S = 2.0
"""After the drain: how long handlers whose clients were cut off may take to clean up before uvicorn
cancels them."""


class DrainingServer(uvicorn.Server):
    """uvicorn's Server in front of a Gate, with the gate's timeouts (GateConfig): the header timeout on
    every connection, and a drain on SIGTERM or SIGINT: the gate answers 503 to every new request (/health
    too, so probes and proxies stop sending at once) while the socket stays open; requests in progress may
    finish for ``drain_timeout_s``; then the connections of those left are closed (their handlers end as
    when a client leaves: engine requests cancelled) and uvicorn shuts down. serve() then returns without
    re-raising the signal, so the process exits 0. A second signal ends the drain at once.

    ``on_ready()`` runs once the socket accepts; ``on_shutdown()`` when the drain begins (or, stopped
    without a signal, when uvicorn shuts down); shutdown waits for it."""

    def __init__(self, gate: Gate, host: str, port: int, log_level: str = "info", on_ready=None, on_shutdown=None):
        self.gate = gate
        limits = gate.config
        http = functools.partial(_HeaderTimeoutProtocol, header_timeout_s=limits.header_timeout_s)
        super().__init__(uvicorn.Config(gate, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                                        access_log=False, http=http,
                                        timeout_graceful_shutdown=limits.drain_timeout_s))
        self.on_ready = on_ready
        self.on_shutdown = on_shutdown
        self.drain_deadline: float | None = None
        """time.monotonic() when the drain ends; None: not draining."""
        self._shutdown_hook: asyncio.Future | None = None

    def start_draining(self) -> None:
        """What the first signal does. Sets flags only (it runs in a signal handler, or on another thread in
        tests); the next tick (0.1 s) acts on them."""
        if self.drain_deadline is None:
            self.gate.is_draining = True
            self.drain_deadline = time.monotonic() + self.gate.config.drain_timeout_s

    def handle_exit(self, sig: int, frame) -> None:
        if self.started and self.drain_deadline is None:
            self.start_draining()
        else:  # a second signal, or one before the socket opened: stop now
            self.drain_deadline = time.monotonic()
            self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without re-raising the captured signal once serve() is done (exit status 143 for a
        SIGTERM; a drained server exits 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def serve(self, sockets=None) -> None:
        ready = asyncio.ensure_future(self._after_start())
        try:
            await super().serve(sockets)
        finally:
            ready.cancel()

    async def _after_start(self) -> None:
        while not self.started:
            if self.should_exit:
                return
            await asyncio.sleep(0.05)
        if self.on_ready is not None:
            await self.on_ready()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self._shutdown_hook is None:
                log.info("draining: %d requests in progress may finish within %g s; new requests get 503",
                         len(self.server_state.tasks), self.gate.config.drain_timeout_s)
                self._start_shutdown_hook()
            if not self.server_state.tasks or time.monotonic() >= self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)

    def _start_shutdown_hook(self) -> None:
        async def run() -> None:
            if self.on_shutdown is not None:
                try:
                    await self.on_shutdown()
                except Exception as e:  # shutting down anyway
                    log.warning("shutdown hook failed: %s", e)

        self._shutdown_hook = asyncio.ensure_future(run())

    async def shutdown(self, sockets=None) -> None:
        if self.drain_deadline is not None:
            if self.server_state.tasks:
                # the drain time is up: their clients are cut off, so the handlers end as when a client
                # leaves (cancelling their engine requests); uvicorn cancels whatever outlives the grace
                log.warning("drain over: ending %d requests still in progress", len(self.server_state.tasks))
                self.gate.drain_ended.set()  # streams end with an error event (api_server.until_drain_ends)
                await asyncio.wait(set(self.server_state.tasks), timeout=_CLEANUP_GRACE_S)
                for connection in list(self.server_state.connections):
                    connection.transport.close()
            self.config.timeout_graceful_shutdown = _CLEANUP_GRACE_S
        if self._shutdown_hook is None:
            self._start_shutdown_hook()
        await super().shutdown(sockets)
        # the cancelled handlers run their cleanup (cancelling their engine requests) before the caller
        # closes the engine
        if self.server_state.tasks:
            await asyncio.wait(set(self.server_state.tasks), timeout=5.0)
        await asyncio.wait({self._shutdown_hook}, timeout=10.0)


async def serve_app(app: Gate, host: str, port: int, log_level: str = "info", on_ready=None,
                    on_shutdown=None) -> None:
    """Runs ``app`` under uvicorn until a signal has drained it (see DrainingServer); ``on_ready()`` runs
    once the socket accepts, ``on_shutdown()`` when the server begins to shut down.

    What the process holds before it serves (modules, tokenizer, templates, the app) lives as long as it does,
    so it is frozen out of the collector's reach: a full collection with SmolLM2 loaded stops every thread for
    ~30 ms, frozen for well under 1 ms. (Objects alive now that later become cyclic garbage are never collected:
    nothing of the startup heap is dropped while serving. Ray replicas do not come through here.)"""
    gc.collect()
    gc.freeze()
    await DrainingServer(app, host, port, log_level, on_ready, on_shutdown).serve()
