"""Running the api_server's ASGI app on a request that arrived elsewhere (Ray Serve's router): the request
as plain data, the response as an async stream of plain data, so that it crosses a process boundary and the
replica answers exactly as an api_server would (the Gate, the routes, the errors, the metrics)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer",
                        b"proxy-authorization", b"proxy-authenticate", b"content-length", b"host"})
"""Request headers not passed on: they describe the hop to the router, not the request."""


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the router received it (headers lower-cased bytes, the body whole), and the prefix keys
    of its leading text when the replicas are routed by prefix (serve/ray/routing.py)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    prefix_keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a forwarded response: its status and headers."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call_asgi(app, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Runs ``app`` on ``request``; yields one ResponseStart, then the body's chunks as the app sends them.

    When the consumer stops early (the client left; Ray cancels the call), the app hears http.disconnect, as
    from a client that closed its connection, and is then cancelled: its handlers' cleanup runs (engine
    requests cancelled, admitted sequences released) before this generator returns. Raises RuntimeError when
    the app ends without a complete response.
    """
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    headers = [(k, v) for k, v in request.headers if k not in HOP_BY_HOP]
    headers += [(b"host", b"lmkit-replica"), (b"content-length", str(len(request.body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
             "headers": headers, "client": request.client, "server": ("lmkit-replica", 0), "state": {}}
    app_task = asyncio.ensure_future(app(scope, receive, sent.put))
    complete = False
    try:
        while not complete:
            message = asyncio.ensure_future(sent.get())
            await asyncio.wait({message, app_task}, return_when=asyncio.FIRST_COMPLETED)
            if not message.done():
                message.cancel()
                if sent.empty():
                    app_task.result()  # raises what the app raised
                    raise RuntimeError(f"the app ended without a complete response to {request.method} "
                                       f"{request.path}")
                continue
            m = message.result()
            if m["type"] == "http.response.start":
                yield ResponseStart(m["status"], tuple((bytes(k), bytes(v)) for k, v in m.get("headers", ())))
            elif m["type"] == "http.response.body":
                if m.get("body"):
                    yield bytes(m["body"])
                complete = not m.get("more_body", False)
    finally:
        disconnected.set()
        if not app_task.done():
            if not complete:
                app_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await app_task
