"""The two deployments of lmkit's Ray Serve application.

``ModelServer`` is one replica of one model: an engine and the api_server's own ASGI app (``create_app``),
so a replica answers exactly as an api_server does: the same routes, streaming, errors, limits, API keys
and metrics. Ray's HTTP proxy calls that app directly where the application serves one model (the class is
a Ray Serve ingress whose app is built after its constructor, ``__serve_build_asgi_app__``); the router
calls it through ``forward`` (``bridge.call_asgi``) where there are several. Ray Serve autoscales it on
ongoing requests, health-checks it (``check_health``: the engine answers) and replaces a replica that dies.

``Router`` is the HTTP ingress of an application of several models, or of one routed by prefix: it reads the
body (413 past the limit), picks the model's deployment by the request's ``model``, attaches the prefix keys of
the request's leading text when the replicas are routed by prefix (serve/ray/routing.py), and relays the
replica's response as it streams. A replica that dies before its first byte is retried once on another; one that dies mid-stream ends
the stream (an SSE client gets an error event). /v1/models and /health ask every model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from starlette.requests import Request
from starlette.responses import Response

from lmkit.serve.asgi import RelayedResponse, parse_json
from lmkit.serve.errors import error_body, error_response
from lmkit.serve.gate import GENERATION_PATHS
from lmkit.serve.proxy.strategies import prefix_keys, request_text
from lmkit.serve.ray.bridge import ForwardedRequest, ResponseStart, call_asgi

log = logging.getLogger("lmkit.serve")

_ENGINE_GAUGES = (("lmkit_num_requests_running", "Requests running in the engine", "num_running"),
                  ("lmkit_num_requests_waiting", "Requests waiting for KV blocks or a batch slot", "num_waiting"),
                  ("lmkit_kv_cache_usage_ratio", "Fraction of KV blocks held by running requests", "kv_usage"))
"""Engine gauges each replica exports through Ray's metrics agent (Ray adds its deployment and replica tags;
Prometheus sees them with Ray's ray_ prefix), refreshed at every health check."""


class ModelServer:
    """One replica of one model: the engine and the api_server app on it (see the module docstring)."""

    def __init__(self, model: str | None, engine_config, server_config, chat_template: str | None = None):
        from ray.serve import metrics

        from lmkit.engine import AsyncEngine
        from lmkit.serve.api_server import create_app

        self.engine = AsyncEngine(model, engine_config, chat_template=chat_template)
        self.api_server = create_app(self.engine, server_config)
        self.model_name = self.api_server.app.state.serving.model_name
        self.asgi = _naming_replica(self.api_server, _replica_id())
        self._gauges = [(metrics.Gauge(name, doc, tag_keys=("model_name",)), field)
                        for name, doc, field in _ENGINE_GAUGES]

    def __serve_build_asgi_app__(self):
        """The app Ray's HTTP proxy calls when this deployment is the application's ingress."""
        return self.asgi

    async def forward(self, request: ForwardedRequest):
        """Streams the app's answer to ``request`` (from the router): a ResponseStart, then the body's chunks."""
        async for item in call_asgi(self.asgi, request):
            yield item

    async def check_health(self) -> None:
        """Ray Serve's health check: raises (the replica is replaced) when the engine does not answer."""
        m = await asyncio.wait_for(asyncio.to_thread(self.engine.engine.metrics), 10.0)
        for gauge, field in self._gauges:
            gauge.set(getattr(m, field), tags={"model_name": self.model_name})

    def engine_state(self) -> dict:
        """What the engine holds now, and this replica's process id (for operators and tests)."""
        m = self.engine.engine.metrics()
        return {"pid": os.getpid(), "model_name": self.model_name, "num_running": m.num_running,
                "num_waiting": m.num_waiting, "num_free_blocks": m.num_free_blocks,
                "num_cached_blocks": m.num_cached_blocks, "num_total_blocks": m.num_total_blocks,
                "num_prefix_hit_tokens": m.num_prefix_hit_tokens}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _naming_replica(app, replica_id: str):
    """``app`` answering with an x-lmkit-replica header: which replica served a request, for operators (and
    tests)."""
    header = (b"x-lmkit-replica", replica_id.encode())

    async def asgi(scope, receive, send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await app(scope, receive, send_named)

    return asgi


def _replica_id() -> str:
    """Ray Serve's id of this replica (its logs and state API name it so)."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica (tests that build the class directly)
        return f"pid-{os.getpid()}"


def _replica_failures() -> tuple[type[BaseException], ...]:
    """Errors by which a call learns that its replica died or cannot be reached."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, ReplicaUnavailableError


def _unavailable() -> tuple[type[BaseException], ...]:
    """Errors by which Ray Serve refuses a call: no replica running, or every queue full."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return BackPressureError, DeploymentUnavailableError


def _prefix_keys_of(payload) -> tuple[bytes, ...]:
    return tuple(prefix_keys(request_text(payload)))


_NOT_JSON = object()
"""A body that does not parse as JSON (the Router answers 400 where it must read it)."""

_PASSED_BACK = frozenset({b"content-type", b"content-length", b"cache-control", b"x-accel-buffering",
                          b"retry-after", b"www-authenticate", b"x-lmkit-replica"})


def _passed_back(start: ResponseStart) -> dict[str, str]:
    """The headers of a replica's answer that the router passes on to its client."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k in _PASSED_BACK}


class Router:
    """The HTTP ingress of the application (see the module docstring)."""

    def __init__(self, servers: dict, max_body_bytes: int, by_prefix: bool = False):
        self.servers = servers
        """model name -> DeploymentHandle of its ModelServer."""
        self.max_body_bytes = max_body_bytes
        self.by_prefix = by_prefix
        """The replicas are routed by prefix: each generation request carries its prefix keys."""

    async def __call__(self, request: Request) -> Response:
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return error_response(413, f"the request body is larger than {self.max_body_bytes} bytes")
        payload = None
        if request.method == "POST" and path in GENERATION_PATHS and (len(self.servers) > 1 or self.by_prefix):
            try:
                payload = await parse_json(body)
            except ValueError:
                payload = _NOT_JSON
        keys = ()
        if self.by_prefix and payload is not None and payload is not _NOT_JSON:
            # off the event loop: a message's non-text content is serialized to be hashed
            keys = await asyncio.to_thread(_prefix_keys_of, payload)
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     tuple(request.scope["headers"]), bytes(body),
                                     tuple(request.client) if request.client else None, keys)
        del body  # forwarded holds its copy
        if request.method == "GET" and path == "/v1/models":
            return await self._models(forwarded)
        if request.method == "GET" and path == "/health":
            return await self._health(forwarded)
        if path == "/metrics":
            return error_response(404, "a Ray Serve application has no /metrics of its own: each replica exports "
                                       "lmkit_num_requests_running/_waiting and lmkit_kv_cache_usage_ratio, with "
                                       "Ray Serve's request metrics, through Ray's metrics agent (ray start "
                                       "--metrics-export-port)")
        name = self._model_of(request.method, path, payload)
        del payload  # not held while the answer streams
        if isinstance(name, Response):
            return name
        return await self._forward(name, forwarded)

    def _model_of(self, method: str, path: str, payload) -> str | Response:
        """The model a request goes to: its ``model`` where there are several (``payload``: its parsed body);
        the one there is, else (the replica then judges the body in an api_server's words)."""
        if len(self.servers) == 1:
            return next(iter(self.servers))
        if method != "POST" or path not in GENERATION_PATHS:
            return error_response(404, f"{method} {path} is not a route of this application: it serves "
                                       f"{', '.join(GENERATION_PATHS)}, /v1/models and /health")
        if payload is _NOT_JSON:
            return error_response(400, "We could not parse the JSON body of your request.")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            return error_response(400, "Missing required parameter: 'model'.", "model", "missing_required_parameter")
        if model not in self.servers:
            return error_response(404, f"The model `{model}` does not exist. Available: {sorted(self.servers)}.",
                                  "model", "model_not_found")
        return model

    async def _forward(self, name: str, request: ForwardedRequest) -> Response:
        handle = self.servers[name].options(stream=True)
        for attempt in range(2):
            stream = handle.forward.remote(request)
            try:
                start = await stream.__anext__()
                break
            except _replica_failures() as e:
                stream.cancel()
                log.warning("a replica of %s failed before answering (%s)%s", name, type(e).__name__,
                            "; retrying on another" if attempt == 0 else "")
            except _unavailable() as e:
                stream.cancel()
                return error_response(503, f"no replica of `{name}` can take the request now ({type(e).__name__}); "
                                           f"retry later", headers={"retry-after": "1"})
        else:
            return error_response(503, f"the replicas of `{name}` failed before answering; retry later",
                                  headers={"retry-after": "1"})
        assert isinstance(start, ResponseStart), f"a replica answered {type(start).__name__} first"
        headers = _passed_back(start)
        is_sse = headers.get("content-type", "").startswith("text/event-stream")
        if is_sse:
            headers.pop("content-length", None)

        async def relay():
            try:
                async for chunk in stream:
                    yield chunk
            except _replica_failures() as e:  # too late to retry: the client has had part of the answer
                kind = type(e).__name__
                log.warning("a replica of %s died mid-response: %s", name, kind)
                if is_sse:
                    yield f"data: {json.dumps(error_body(502, f'the replica serving this request failed: {kind}'))}\n\n"

        return RelayedResponse(relay(), stream.cancel, status_code=start.status, headers=headers)

    async def _call(self, name: str, request: ForwardedRequest) -> tuple[int, dict, bytes]:
        """One whole answer of a replica of ``name``: (status, headers, body); 503 when none answers."""
        try:
            parts = [item async for item in self.servers[name].options(stream=True).forward.remote(request)]
        except (*_replica_failures(), *_unavailable()) as e:
            return 503, {}, json.dumps(error_body(503, f"no replica of `{name}` answers: {type(e).__name__}")).encode()
        start = parts[0]
        headers = _passed_back(start)
        return start.status, headers, b"".join(parts[1:])

    async def _models(self, request: ForwardedRequest) -> Response:
        answers = await asyncio.gather(*(self._call(name, request) for name in self.servers))
        data = []
        for status, headers, body in answers:
            if status != 200:  # 401 without a key: the replica's own answer
                headers.pop("content-length", None)
                return Response(body, status_code=status, headers=headers)
            data += json.loads(body)["data"]
        return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")

    async def _health(self, request: ForwardedRequest) -> Response:
        answers = await asyncio.gather(*(self._call(name, request) for name in self.servers))
        failing = [name for name, (status, _, _) in zip(self.servers, answers) if status != 200]
        if failing:
            return error_response(503, f"no replica of {', '.join(failing)} answers /health")
        return Response(status_code=200)
