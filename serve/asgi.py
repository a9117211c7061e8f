"""Running the servers' ASGI apps: the event loop, uvicorn with hooks at ready and shutdown, and handlers
that stop their work when the client goes away. Shared by the api_server and the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import Request
from fastapi.responses import Response

log = logging.getLogger("lmkit.serve")


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Awaits ``work``; cancels it (and so its engine requests) when the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


def _on_lifespan_shutdown(app, hook):
    """``app`` that awaits ``hook()`` when uvicorn announces shutdown (before it re-raises the signal that
    stopped it, which would cut short anything run after serve() returns)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def hooked_receive():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                try:
                    await hook()
                except Exception as e:  # shutting down anyway
                    log.warning("shutdown hook failed: %s", e)
            return message

        return await app(scope, hooked_receive, send)

    return wrapped


def run_event_loop(main) -> None:
    """Runs the coroutine ``main`` to completion on uvloop where it is installed (a libuv event loop: the
    servers spend a good part of their CPU relaying small SSE chunks, which it makes cheaper), else on
    asyncio's own loop. uvicorn then also parses HTTP with httptools when that is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def serve_app(app, host: str, port: int, log_level: str = "info", on_ready=None, on_shutdown=None) -> None:
    """Runs ``app`` under uvicorn until a signal stops it; ``on_ready()`` runs once the socket accepts,
    ``on_shutdown()`` when the server begins to shut down."""
    import uvicorn

    if on_shutdown is not None:
        app = _on_lifespan_shutdown(app, on_shutdown)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                                           access_log=False))

    async def after_start() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        if on_ready is not None:
            await on_ready()

    ready = asyncio.ensure_future(after_start())
    try:
        await server.serve()
    finally:
        ready.cancel()
