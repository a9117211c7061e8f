"""The door every request passes before the app: API keys (401), body size (413), concurrent generation
requests (429), and a per-status request count. Pure ASGI (no BaseHTTPMiddleware), so streamed responses
pass through unbuffered and a client disconnect still reaches the handler at once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Awaitable, Callable

from lmkit.serve.errors import error_body

ASGIApp = Callable[..., Awaitable[None]]

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class GateConfig:
    api_keys: tuple[str, ...] = ()
    """Bearer tokens accepted on /v1/ routes; empty: no authentication."""
    max_body_bytes: int = 4 * 2**20
    """Request bodies larger than this are refused with 413."""
    max_concurrent_requests: int | None = None
    """Generation requests (chat/completions) in flight at most; more are refused with 429. None: no limit."""
    protected_prefix: str = "/v1/"
    """Paths that need an API key (health and metrics stay open for probes)."""


async def send_error(send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text[:7].lower() == "bearer " else ""
    return None


class Gate:
    """ASGI middleware; ``on_response(path, status)`` is called once per HTTP response (for metrics)."""

    def __init__(self, app: ASGIApp, config: GateConfig,
                 on_response: Callable[[str, int], None] | None = None):
        self.app = app
        self.config = config
        self.on_response = on_response
        self.num_in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.on_response is not None:
            send = self._counting(path, send)
        config = self.config
        if config.api_keys and path.startswith(config.protected_prefix):
            token = bearer_token(scope["headers"])
            if token is None:
                return await send_error(send, 401, "You didn't provide an API key. Pass it in the Authorization "
                                                   "header: 'Authorization: Bearer YOUR_KEY'.", "invalid_api_key")
            if token not in config.api_keys:
                return await send_error(send, 401, "Incorrect API key provided.", "invalid_api_key")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive)
            if body is None:
                return await send_error(send, 413, f"The request body is larger than the limit of "
                                                   f"{config.max_body_bytes} bytes.", "request_too_large")
            receive = _replay(body, receive)
        limited = config.max_concurrent_requests is not None and path in GENERATION_PATHS
        if limited and self.num_in_flight >= config.max_concurrent_requests:
            return await send_error(send, 429, f"The server is busy: {self.num_in_flight} requests in flight, the "
                                               f"limit is {config.max_concurrent_requests}. Retry later.",
                                    "rate_limit_exceeded", [(b"retry-after", b"1")])
        if not limited:
            return await self.app(scope, receive, send)
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (declared or counted)."""
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""  # disconnected: the app sees an empty body and the disconnect after it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _counting(self, path: str, send):
        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.on_response(path, message["status"])
            await send(message)

        return counting_send


def _replay(body: bytes, receive):
    """A receive() that gives the already-read body once, then the client's later messages (disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
