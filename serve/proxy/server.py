"""The proxy: one OpenAI endpoint in front of many api_servers.

A generation request is routed by its ``model`` to a node chosen by the strategy. Until the node's first
body byte arrives nothing has reached the client, so a node that fails by then (connection refused or
reset, 502/503/504) is marked down and the request is sent to another node; 429 tries another node
without marking anyone down. After the first byte the body passes through chunk by chunk as the node
sends it (no buffering). A client that leaves closes the node connection, which cancels the engine work.

A node's own error text (the body of a 5xx, of a failed health check) stays in the proxy's log: clients
and /nodes/status see status codes and error kinds only, since a node may be anyone's server.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (union of the nodes'), GET /health,
GET / (the chat page: serve/web);
the admin routes POST /nodes/add, POST /nodes/remove, GET /nodes/status are closed (403) unless the proxy
has an admin key, or opens them to loopback clients (unsafe_open_admin_on_loopback, on a loopback host).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from lmkit.serve.asgi import (OffLoopJSONRoute, RelayedResponse, parse_json, run_event_loop, serve_app,
                              unless_disconnected)
from lmkit.serve.errors import APIError, error_body, error_response, install_error_handlers
from lmkit.serve.gate import BEARER_CHALLENGE, Gate, GateConfig, bearer_token, is_loopback, send_error, warn_if_exposed
from lmkit.serve.proxy.netpolicy import NodeNetworkPolicy, PolicyResolver
from lmkit.serve.proxy.registry import Node, NodeFailed, NodeRegistry, body_start, node_host, normalize_node_url
from lmkit.serve.proxy.strategies import make_strategy
from lmkit.serve.web import add_web_ui

log = logging.getLogger("lmkit.serve.proxy")

_RETRY_STATUSES = {502, 503, 504}
ADMIN_PREFIX = "/nodes/"
_PASS_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after")


@dataclass(frozen=True)
class ProxyConfig:
    """How the proxy listens, routes and checks its nodes."""

    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 8000
    strategy: str = "min_expected_latency"
    """random | min_expected_latency | min_observed_latency | prefix (lmkit.serve.proxy.strategies)"""
    nodes: tuple[str, ...] = ()
    """Node URLs known at start, http(s)://HOST[:PORT] (more register with POST /nodes/add)."""
    admin_key: str | None = None
    """Bearer token that opens /nodes/add, /nodes/remove, /nodes/status; None: they answer 403."""
    unsafe_open_admin_on_loopback: bool = False
    """Open /nodes/* without a key to loopback clients (any process on this machine); host must be loopback."""
    allow_node_networks: tuple[str, ...] = ()
    """Networks (CIDR) that nodes may be on although the default refuses them: link-local and cloud metadata
    addresses (netpolicy.py)."""
    gate: GateConfig = field(default_factory=GateConfig)
    """Client API keys, body size limit, concurrent request limit (of the proxy itself)."""
    health_interval_s: float = 3.0
    """Seconds between health checks of every node."""
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 2.0
    """A node that does not accept the connection within this time counts as failed."""
    web_ui: bool = True
    """Serve the chat page (serve/web) at GET /, open without an API key (it asks the user for one); False: /
    answers 404."""

    def __post_init__(self) -> None:
        if self.unsafe_open_admin_on_loopback and not is_loopback(self.host):
            raise ValueError(f"--unsafe-open-admin-on-loopback needs a loopback --host (127.0.0.1, ::1 or "
                             f"localhost), got {self.host!r}: on a proxy other hosts can reach, set --admin-key "
                             f"to manage nodes")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("--admin-key is empty: give a secret token, or leave it out to close /nodes/*")
        object.__setattr__(self, "nodes", tuple(normalize_node_url(url) for url in self.nodes))
        policy = self.network_policy
        for url in self.nodes:
            policy.check_host(node_host(url))

    @property
    def network_policy(self) -> NodeNetworkPolicy:
        """The addresses nodes may have (ValueError naming a malformed allow_node_networks entry)."""
        return NodeNetworkPolicy.allowing(self.allow_node_networks)


class AddNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    api_key: str | None = None
    speed: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class RemoveNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str


class _NodeBroken(Exception):
    """A node answered a 5xx that is not retried (the request itself may be the cause)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class Proxy:
    """Routing, retries and pass-through; owns the registry and the HTTP session."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.registry = NodeRegistry(config.health_timeout_s, config.network_policy)
        self.strategy = make_strategy(config.strategy)
        for url in config.nodes:
            self.registry.add(url)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        # aiohttp, not httpx: with its C HTTP parser the proxy spends ~90 us of CPU per relayed token, against
        # ~230 us with httpx's pure-Python h11 (4,096 streamed tokens at concurrency 8), and on a machine
        # that also runs the nodes that CPU is the engines'
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # no cap: the nodes bound their own load; names resolve to addresses the network policy allows only
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, resolver=PolicyResolver(self.registry.policy))
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        await self.registry.check_all(self.session)
        self._health_task = asyncio.ensure_future(
            self.registry.run_health_checks(self.session, self.config.health_interval_s))

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()

    async def forward(self, path: str, body: bytes) -> Response:
        try:
            payload = await parse_json(body)  # off the event loop: a 4 MiB body takes ~0.1-0.5 s
        except ValueError:
            raise APIError(400, "We could not parse the JSON body of your request.") from None
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            raise APIError(400, "Missing required parameter: 'model'.", "model", "missing_required_parameter")
        tried: set[str] = set()
        errors: list[str] = []  # status codes and error kinds only: the nodes' own words stay in the log
        last_refusal: _Refused | None = None
        while True:
            nodes = [n for n in self.registry.candidates(model) if n.url not in tried]
            if not nodes:
                break
            node = self.strategy.choose(nodes, payload) if getattr(self.strategy, "uses_request", False) \
                else self.strategy.choose(nodes)
            tried.add(node.url)
            try:
                return await self._try_node(node, path, body)
            except NodeFailed as e:
                errors.append(str(e))
                if hasattr(self.strategy, "forget"):  # down: whatever it cached may be gone when it returns
                    self.strategy.forget(node.url)
            except _Refused as e:
                last_refusal = e
            except _NodeBroken as e:
                raise APIError(e.status, f"the node serving `{model}` failed (answered {e.status}); the details "
                                         f"are in the proxy's log") from None
        if last_refusal is not None:
            return error_response(429, f"every node serving `{model}` is busy (answered 429); retry later",
                                  code="rate_limit_exceeded", headers=last_refusal.headers)
        if not self.registry.knows(model):
            known = sorted({m["id"] for m in self.registry.models()})
            raise APIError(404, f"The model `{model}` does not exist. Available: {known}.", "model", "model_not_found")
        if errors:
            raise APIError(502, f"every node serving `{model}` failed before answering ({'; '.join(errors)}); "
                                f"retry later")
        raise APIError(503, f"no node serving `{model}` is up; retry later")

    async def _try_node(self, node: Node, path: str, body: bytes) -> Response:
        """Sends the request to ``node`` and waits for its first body chunk; raises NodeFailed (node
        marked down), _Refused (429) or _NodeBroken (another 5xx) before anything was sent to the client."""
        node.num_in_flight += 1
        sent_at = time.perf_counter()
        response = None
        try:
            headers = {"content-type": "application/json", **node.headers()}
            response = await self.session.post(node.url + path, data=body, headers=headers)
            if response.status in _RETRY_STATUSES:
                raise NodeFailed(f"answered {response.status}", await body_start(response))
            if response.status == 429:
                retry_after = response.headers.get("retry-after")
                raise _Refused({"retry-after": retry_after} if retry_after else {})
            if response.status >= 500:
                log.warning("node %s answered %d to %s: %s", node.url, response.status, path,
                            await body_start(response))
                raise _NodeBroken(response.status)
            first = await response.content.readany()
        except (_Refused, _NodeBroken):
            node.num_in_flight -= 1
            response.close()
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, NodeFailed) as e:
            node.num_in_flight -= 1
            if response is not None:
                response.close()
            if isinstance(e, NodeFailed):
                why, details = str(e), e.details
            else:
                why, details = type(e).__name__, f"{type(e).__name__}: {e}"
            self.registry.mark_down(node, f"request failed before its first byte: {why}", details)
            raise NodeFailed(why) from None
        except BaseException:  # cancelled: the client left while we waited for the node
            node.num_in_flight -= 1
            if response is not None:
                response.close()
            raise
        node.latencies_s.append(time.perf_counter() - sent_at)
        node.num_requests += 1
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")

        released = False

        def release(complete: bool) -> None:
            nonlocal released
            if released:
                return
            released = True
            node.num_in_flight -= 1
            if complete:  # the connection goes back to the pool
                response.release()
            else:  # the client left or the node failed: closing the connection cancels the node's work
                response.close()

        async def relay():
            complete = False
            try:
                chunk = first
                while chunk:  # readany: whatever has arrived, b"" at the end
                    yield chunk
                    chunk = await response.content.readany()
                complete = True
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # the node died mid-response: too late to retry; it leaves the rotation until a health check
                # passes, and an SSE client hears why in its own terms
                kind = type(e).__name__
                self.registry.mark_down(node, f"failed mid-response: {kind}", f"{kind}: {e}")
                if is_sse:
                    yield f"data: {json.dumps(error_body(502, f'the node serving this request failed: {kind}'))}\n\n"
            finally:
                release(complete)

        return RelayedResponse(relay(), functools.partial(release, False), status_code=response.status,
                               headers=_passed_headers(response))


class _Refused(Exception):
    """A node answered 429: the headers to pass on (retry-after) if no other node takes the request."""

    def __init__(self, headers: dict[str, str]):
        super().__init__(429)
        self.headers = headers


def _passed_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: response.headers[k] for k in _PASS_HEADERS if k in response.headers}


def create_proxy_app(config: ProxyConfig | None = None) -> Gate:
    """The proxy's ASGI app; its lifespan opens the HTTP session and starts the health checks."""
    config = config or ProxyConfig()
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="lmkit proxy", version="0.1.0", lifespan=lifespan,
                  description="Routes OpenAI requests across lmkit api_servers by model, load and health.")
    app.router.route_class = OffLoopJSONRoute  # /nodes/* bodies are parsed off the event loop too
    app.state.proxy = proxy
    install_error_handlers(app)
    if config.unsafe_open_admin_on_loopback:
        log.warning("--unsafe-open-admin-on-loopback: /nodes/add, /nodes/remove and /nodes/status answer every "
                    "client on this machine without a key (any local user or process, and whatever a local "
                    "reverse proxy forwards); set --admin-key instead where that is not wanted")
    elif config.admin_key is None:
        log.info("the admin routes /nodes/* are closed (no --admin-key): the nodes are the --node ones")

    # a client that leaves while its node prefills (or, without streaming, generates) cancels the forward,
    # which closes the node's connection and so cancels the node's engine request
    @app.post("/v1/chat/completions", summary="Chat completion, routed to a node")
    async def chat(request: Request):
        return await unless_disconnected(request, proxy.forward("/v1/chat/completions", await request.body()))

    @app.post("/v1/completions", summary="Text completion, routed to a node")
    async def completions(request: Request):
        return await unless_disconnected(request, proxy.forward("/v1/completions", await request.body()))

    @app.post("/v1/responses", summary="Model response (Responses API), routed to a node")
    async def responses(request: Request):
        return await unless_disconnected(request, proxy.forward("/v1/responses", await request.body()))

    @app.post("/v1/embeddings", summary="Embeddings, routed to a node")
    async def embeddings(request: Request):
        return await unless_disconnected(request, proxy.forward("/v1/embeddings", await request.body()))

    @app.get("/v1/models", summary="The models of every node that is up")
    async def models():
        return {"object": "list", "data": proxy.registry.models()}

    @app.post("/nodes/add", summary="Register a node (checked at once); admin")
    async def add(body: AddNode):
        try:
            node = proxy.registry.add(body.url, body.api_key, body.speed)
        except ValueError as e:  # the url: AddNode has checked the speed
            raise APIError(400, str(e), "url", "invalid_value") from None
        await proxy.registry.check(node, proxy.session)
        return node.status()

    @app.post("/nodes/remove", summary="Forget a node; admin")
    async def remove(body: RemoveNode):
        try:
            node = proxy.registry.remove(body.url)
        except ValueError as e:
            raise APIError(400, str(e), "url", "invalid_value") from None
        if node is None:
            raise APIError(404, f"no node {body.url!r} is registered", "url")
        return {"removed": node.url}

    @app.get("/nodes/status", summary="Every node and its state; admin")
    async def status():
        return {"strategy": proxy.strategy.name, "nodes": [n.status() for n in proxy.registry.nodes.values()]}

    @app.get("/health", summary="The proxy answers; num_nodes_up tells how many nodes serve")
    async def health():
        return JSONResponse({"num_nodes_up": sum(n.is_up for n in proxy.registry.nodes.values())})

    if config.web_ui:
        add_web_ui(app)
    # /nodes/* take the admin key, not the API keys
    return Gate(_admin_door(app, config), config.gate, own_key_prefixes=(ADMIN_PREFIX,))


def _admin_door(app, config: ProxyConfig):
    """``app`` with /nodes/* closed (403) except to the admin key, or to loopback clients when
    ``unsafe_open_admin_on_loopback``. Pure ASGI, before the app parses anything."""
    closed = ("The proxy's admin routes (/nodes/add, /nodes/remove, /nodes/status) are closed: start the proxy "
              "with --admin-key KEY and send 'Authorization: Bearer KEY' (or, on a proxy that listens on "
              "127.0.0.1 only, --unsafe-open-admin-on-loopback).")

    async def door(scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ADMIN_PREFIX):
            return await app(scope, receive, send)
        token = bearer_token(scope["headers"])
        client = (scope.get("client") or ("", 0))[0]
        if config.admin_key is not None and token is not None and hmac.compare_digest(token.encode(),
                                                                                      config.admin_key.encode()):
            return await app(scope, receive, send)
        if config.unsafe_open_admin_on_loopback and is_loopback(client):
            return await app(scope, receive, send)
        if config.admin_key is not None:
            return await send_error(send, 401, "This route needs the proxy's admin key: 'Authorization: Bearer "
                                               "ADMIN_KEY' (its --admin-key).", "invalid_api_key", [BEARER_CHALLENGE])
        if config.unsafe_open_admin_on_loopback:
            return await send_error(send, 403, f"The proxy's admin routes are open to loopback clients only "
                                               f"(--unsafe-open-admin-on-loopback), not to {client}; set "
                                               f"--admin-key to manage nodes from other hosts.", "admin_closed")
        return await send_error(send, 403, closed, "admin_closed")

    return door


def run_proxy(config: ProxyConfig, log_level: str = "info") -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("proxy at http://%s:%d, strategy %s, nodes %s", config.host, config.port, config.strategy,
             list(config.nodes))
    warn_if_exposed(config.host, config.port, config.gate)
    run_event_loop(serve_app(create_proxy_app(config), config.host, config.port, log_level))
