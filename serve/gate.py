"""The door every request passes before the app: API keys (401), body size (413), a body that stalls (408),
concurrent generation requests (429), 503 to all once the server drains, and a per-status request count.
Keys are asked everywhere once set (docs and metrics too), except on the probes (/health, /ready) and for
GET / (the chat page, which asks the user for a key itself). Pure ASGI (no BaseHTTPMiddleware), so streamed
responses pass through unbuffered and a client disconnect still reaches the handler at once."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from lmkit.serve.errors import error_body

ASGIApp = Callable[..., Awaitable[None]]

log = logging.getLogger("lmkit.serve")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
PUBLIC_PATHS = ("/health", "/ready")  # probes: liveness and readiness, no key
"""Open without an API key: the probes."""
PAGE_PATHS = ("/",)
"""Open to GET without an API key: the chat page (serve/web), which asks the user for a key itself."""


@dataclass(frozen=True)
class GateConfig:
    api_keys: tuple[str, ...] = ()
    """Bearer tokens accepted; when set, every path needs one (the API, /metrics, /openapi.json, /docs,
    /redoc) except the probes, GET / (the chat page) and routes that check a key of their own; empty: no
    authentication."""
    max_body_bytes: int | None = None
    """Request bodies larger than this are refused with 413. None: the server's default (the api_server: 32
    bytes per token of its context, at least 1 MiB, so that parsing the largest body stalls nothing for long;
    the proxy: 4 MiB)."""
    max_concurrent_requests: int | None = None
    """Generation requests (chat/completions) in flight at most; more are refused with 429. None: no limit."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a request's complete headers this long after it opened (or after the
    request's first byte, on a kept-alive connection) is closed: slowloris clients hold no socket for long."""
    body_timeout_s: float = 30.0
    """A request body not complete this long after its headers gets 408 and the connection is closed."""
    drain_timeout_s: float = 30.0
    """On SIGTERM or SIGINT: /health and new requests get 503 at once, requests in progress may finish for
    this long, then what is left is cancelled and the server exits (status 0)."""
    public_metrics: bool = False
    """/metrics answers without an API key even when api_keys is set (for a scraper that cannot send one)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes is not None and not self.max_body_bytes > 0:
            raise ValueError(f"max_body_bytes (--max-body-bytes) must be > 0, got {self.max_body_bytes!r}")
        for name in ("header_timeout_s", "body_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be > 0 seconds, got {getattr(self, name)!r}")

    def needs_key(self, path: str, method: str = "GET") -> bool:
        """Whether a ``method`` request for ``path`` must carry one of ``api_keys``."""
        return (bool(self.api_keys) and path not in PUBLIC_PATHS and not (method == "GET" and path in PAGE_PATHS)
                and not (self.public_metrics and path == "/metrics"))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to listen on, or a client's) is this machine only: localhost,
    127.0.0.0/8, ::1 (also IPv4-mapped). 0.0.0.0, ::, other names and addresses: False."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_exposed(host: str, port: int, config: GateConfig) -> bool:
    """Logs a warning when the server listens beyond loopback without API keys; returns whether it did."""
    if config.api_keys or is_loopback(host):
        return False
    log.warning("listening on %s port %d without API keys: anyone who can reach this port can use the server. "
                "Set --api-keys KEY (clients then send 'Authorization: Bearer KEY'), or listen on this machine "
                "only with --host 127.0.0.1.", host or "every interface", port)
    return True


GATE_SCOPE_KEY = "lmkit.gate"  # the ASGI scope's entry of the Gate a request came through (its drain state)
BEARER_CHALLENGE = (b"www-authenticate", b'Bearer realm="lmkit"')  # RFC 6750: how a 401 says what it wants


def drain_ended_message(drain_timeout_s: float) -> str:
    """What a request still running when the drain time ran out is told (a 503, or a stream's error event)."""
    return (f"The server shut down before this request finished (its drain time of {drain_timeout_s:g} s ran out): "
            "send it again, to another server.")


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


def route_path(scope) -> str:
    """The request's path below the app's mount point: ASGI's ``path`` holds ``root_path`` in front (an app
    served under a prefix, as Ray Serve's route_prefix), and the routes the gate knows are the app's own."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


class Gate:
    """ASGI middleware; ``on_response(path, status)`` is called once per HTTP response (for metrics).
    ``own_key_prefixes``: paths whose routes check a key of their own (the proxy's /nodes/, its admin key),
    where the API keys are not asked. ``default_max_body_bytes``: the body limit when the config gives none."""

    def __init__(self, app: ASGIApp, config: GateConfig,
                 on_response: Callable[[str, int], None] | None = None, own_key_prefixes: tuple[str, ...] = (),
                 default_max_body_bytes: int = 4 * 2**20):
        self.app = app
        self.config = config
        self.max_body_bytes = config.max_body_bytes or default_max_body_bytes
        self.on_response = on_response
        self.own_key_prefixes = own_key_prefixes
        self.num_in_flight = 0
        self.is_draining = False
        """Set when the server begins to shut down: every new request (/health too) gets 503."""
        self.drain_ended = asyncio.Event()
        """Set when the drain time is up: streams still running end with an error event (api_server._Streamed)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        scope[GATE_SCOPE_KEY] = self
        if self.on_response is not None:
            send = self._counting(path, send)
        if self.is_draining:
            return await send_error(send, 503, "The server is shutting down: send the request to another server.",
                                    "server_shutting_down", [(b"connection", b"close")])
        config = self.config
        if config.needs_key(path, scope["method"]) and not path.startswith(self.own_key_prefixes):
            token = bearer_token(scope["headers"])
            if token is None:
                return await send_error(send, 401, "You didn't provide an API key. Pass it in the Authorization "
                                                   "header: 'Authorization: Bearer YOUR_KEY'.", "invalid_api_key",
                                        [BEARER_CHALLENGE])
            if not any(hmac.compare_digest(token.encode(), key.encode()) for key in config.api_keys):
                return await send_error(send, 401, "Incorrect API key provided.", "invalid_api_key",
                                        [BEARER_CHALLENGE])
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(scope, receive), config.body_timeout_s)
            except asyncio.TimeoutError:
                return await send_error(send, 408, f"The request body did not arrive within "
                                                   f"{config.body_timeout_s:g} s of its headers.", "request_timeout",
                                        [(b"connection", b"close")])
            if body is None:
                return await send_error(send, 413, f"The request body is larger than the limit of "
                                                   f"{self.max_body_bytes} bytes (--max-body-bytes).",
                                        "request_too_large")
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
        limit = self.max_body_bytes
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
