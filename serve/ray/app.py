"""lmkit's Ray Serve application: one autoscaled ``ModelServer`` deployment per model; the one model's is the
application's ingress, several are behind a ``Router``.

``build_app(models, ...)`` returns the application for ``serve.run``; ``app_builder(args)`` builds it from a
Ray Serve config file's ``args`` (``import_path: lmkit.serve.ray:app_builder``, as KubeRay's RayService
deploys it); ``deploy(app, ...)`` runs it on the connected cluster; ``run_ray(...)`` is ``lmkit serve ray``:
it starts or joins a Ray cluster, runs the application behind Ray's HTTP proxy, and on SIGTERM or SIGINT
deletes it (replicas finish their requests within the drain time) and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
from typing import Mapping, Sequence

from lmkit import env
from lmkit.config import EngineConfig
from lmkit.serve.api_server import ServerConfig, default_max_body_bytes
from lmkit.serve.gate import GateConfig
from lmkit.serve.ray.config import CONSTRUCTOR_RETRIES, RAY_SERVE_ENV, ReplicaConfig, named_models

log = logging.getLogger("lmkit.serve")


def _ray_serve():
    """ray.serve, or an ImportError that says what to install."""
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError(f'lmkit on Ray Serve needs ray[serve]: pip install -e ".[ray]" ({e})') from None
    return serve


def _deployment_name(model_name: str) -> str:
    return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)


def build_app(models: str | Sequence[str] | Mapping[str, str | None] | None = None,
              engine_config: EngineConfig | None = None, server_config: ServerConfig | None = None,
              replicas: ReplicaConfig | None = None, chat_template: str | None = None):
    """The Ray Serve application serving ``models`` (see ``named_models``; None: the bundled model) with the
    api_server's routes, for ``serve.run(app, ...)``: one model's ModelServer deployment as the ingress, or a
    Router in front of several. ``engine_config`` and ``server_config`` are each replica's (the server's host
    and port are Ray's proxy's, not these); the engine runs ``replicas.num_cpus_per_replica`` threads (at
    least 1) unless num_threads is set, unpinned unless cpu_binding lists CPUs (Ray reserves CPU counts, not
    CPU ids)."""
    serve = _ray_serve()
    from lmkit.serve.ray.replica import ModelServer, Router

    named = named_models(models)
    replicas = replicas or ReplicaConfig()
    server = server_config or ServerConfig()
    engine = engine_config or EngineConfig()
    changes = {}
    if engine.num_threads is None:
        changes["num_threads"] = max(1, int(replicas.num_cpus_per_replica))
    if engine.cpu_binding == "auto":
        changes["cpu_binding"] = "off"
    engine = dataclasses.replace(engine, **changes)
    servers = {}
    # one model: its replicas are the ingress (Ray allows one per application); several, or replicas routed by
    # prefix (the router reads each body): the router is
    by_prefix = replicas.request_router == "prefix"
    single = len(named) == 1 and not by_prefix
    server_class = serve.ingress()(ModelServer) if single else ModelServer
    for name, model in named.items():
        options = replicas.deployment_options(engine, server.gate.drain_timeout_s)
        deployment = serve.deployment(server_class, name=_deployment_name(name), **options)
        servers[name] = deployment.bind(model, engine, dataclasses.replace(server, model_name=name), chat_template)
    if single:  # Ray's proxy calls the replicas' app itself: no router hop
        return next(iter(servers.values()))
    max_body_bytes = server.gate.max_body_bytes or default_max_body_bytes(engine.session_len or 32768)
    router = serve.deployment(Router, name="router", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return router.bind(servers, max_body_bytes, by_prefix)


def app_builder(args: dict):
    """``build_app`` from a Ray Serve config file's ``args``: ``models`` (as build_app's), ``engine``
    (EngineConfig fields), ``server`` (ServerConfig fields but host, port and gate), ``gate`` (GateConfig
    fields; api_keys default to LMKIT_API_KEYS where the application is built), ``replicas`` (ReplicaConfig
    fields). Unknown keys are refused, naming the known ones."""
    def take(cls, values, skip=()):
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)} - set(skip)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown} in the application's args; known: "
                             f"{sorted(known)}")
        if "api_keys" in values:
            values["api_keys"] = tuple(values["api_keys"])
        return cls(**values)

    args = dict(args or {})
    unknown = sorted(set(args) - {"models", "engine", "server", "gate", "replicas", "chat_template"})
    if unknown:
        raise ValueError(f"unknown args {unknown}; known: models, engine, server, gate, replicas, chat_template")
    gate = take(GateConfig, {"api_keys": env.api_keys(), **(args.get("gate") or {})})
    server = dataclasses.replace(take(ServerConfig, args.get("server"), skip=("host", "port", "gate")), gate=gate)
    return build_app(args.get("models"), take(EngineConfig, args.get("engine")), server,
                     take(ReplicaConfig, args.get("replicas")), args.get("chat_template"))


def deploy(app, name: str = "lmkit", route_prefix: str = "/", stop: threading.Event | None = None) -> bool:
    """Runs ``app`` on the connected cluster as ``name`` and returns True once it serves (as ``serve.run``: the
    application RUNNING, then Ray's HTTP proxies ready). When it cannot start, the application is deleted and
    the RuntimeError names each failing deployment's own error (Ray's says only that deployments failed): Ray
    fails a deployment none of whose replicas starts (a model that does not load); this also gives up on one
    whose replicas run while another has failed to start CONSTRUCTOR_RETRIES times since, which Ray retries for
    ever (a second engine whose KV pool does not fit beside the first's). ``stop`` set while it waits
    (SIGTERM): the application is deleted and it returns False."""
    serve = _ray_serve()
    serve.run_many([serve.RunTarget(app, name=name, route_prefix=route_prefix)], wait_for_applications_running=False)
    try:
        serving = _wait_until_serving(serve, name, stop)
        if serving:
            _wait_for_route(route_prefix)
    except Exception as e:
        if name in serve.status().applications:
            serve.delete(name)
        if isinstance(e, RuntimeError):
            raise
        raise RuntimeError(f"Ray Serve application {name!r} did not start: {e}") from e
    if not serving:
        serve.delete(name)
    return serving


ROUTE_WAIT_S = 30.0
ROUTE_CONFIRMATIONS = 10
"""Answers in a row that list the route: each on a new connection, so that where several proxies share the
address (a node's each, behind one port or one load balancer) every one of them is likely asked."""


def _wait_for_route(route_prefix: str, timeout_s: float = ROUTE_WAIT_S) -> None:
    """Until the HTTP proxies list ``route_prefix`` in their route tables (``/-/routes``, ROUTE_CONFIRMATIONS
    answers in a row): Ray's proxies learn routes by long polling, each on its own, and a request sent as soon as
    the application runs could get a 404 from one that has not yet (seen with two nodes on a busy machine, where
    one proxy had the route and the next request went to the other). Returns after timeout_s without that (no
    HTTP proxy, or a host it cannot reach: requests tell)."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if config is None or not getattr(config, "port", None):
        return
    host = config.host if config.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{config.port}/-/routes"
    deadline = time.monotonic() + timeout_s
    confirmed = 0
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (the cluster's own proxy)
                listed = route_prefix in json.loads(response.read())
        except (OSError, ValueError):
            listed = False
        confirmed = confirmed + 1 if listed else 0
        if confirmed >= ROUTE_CONFIRMATIONS:
            return
        time.sleep(0.02 if listed else 0.2)


def _wait_until_serving(serve, name: str, stop: threading.Event | None) -> bool:
    """deploy's wait: True once ``name`` serves, False when ``stop`` is set first; a RuntimeError naming each
    failing deployment's error when it cannot start."""
    from ray.serve.context import _get_global_client

    before_running: set[str] = set()  # start failures a deployment showed before any of its replicas ran
    failed_starts: dict[str, set[str]] = {}  # deployment -> its later distinct failures (each names its replica)
    while True:
        status = serve.status().applications.get(name)
        if status is None:
            raise RuntimeError(f"Ray Serve application {name!r} was deleted while it started")
        if status.status == "RUNNING":
            # serve.run's last wait: Ray's proxies routing to the application (the default proxy answers at once)
            _get_global_client().wait_for_proxies_serving(wait_for_applications_running=True)
            return True
        for deployment, details in status.deployments.items():
            message = details.message or ""
            if message.startswith("A replica failed"):
                if not details.replica_states.get("RUNNING"):
                    before_running.add(message)
                elif message not in before_running:
                    failed_starts.setdefault(deployment, set()).add(message)
        stuck = {d for d, messages in failed_starts.items() if len(messages) >= CONSTRUCTOR_RETRIES}
        if status.status == "DEPLOY_FAILED" or stuck:
            causes = []
            for deployment, details in status.deployments.items():
                lines = [line.strip() for line in (details.message or "").splitlines() if line.strip()]
                if lines and (details.status != "HEALTHY" or deployment in stuck):
                    how = (f" ({details.replica_states.get('RUNNING', 0)} replica(s) run; another failed to start "
                           f"{len(failed_starts[deployment])} times)" if deployment in stuck else "")
                    causes.append(f"{deployment}{how}: {lines[-1]}")
            raise RuntimeError(f"Ray Serve application {name!r} did not start: {'; '.join(causes) or status.message}")
        if stop is not None and stop.is_set():
            return False
        time.sleep(0.5)


def run_ray(models, engine_config: EngineConfig, server_config: ServerConfig, replicas: ReplicaConfig,
            address: str | None = None, app_name: str = "lmkit", route_prefix: str = "/",
            chat_template: str | None = None, log_level: str = "info") -> None:
    """Serves ``models`` on Ray Serve at server_config's host and port until SIGTERM or SIGINT; then deletes
    the application (each replica drains for gate.drain_timeout_s) and returns. ``address``: a running
    cluster ("auto", "HOST:PORT"); None: RAY_ADDRESS if set, else a local Ray started for this command."""
    serve = _ray_serve()
    import ray

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    originals = {}
    try:
        if address is None and not os.environ.get("RAY_ADDRESS"):  # a Ray of our own: its processes inherit these
            for name, value in RAY_SERVE_ENV.items():
                os.environ.setdefault(name, value)
        ray.init(address=address, include_dashboard=False, logging_level=log_level.upper(), log_to_driver=False)
        # after ray.init, which installs handlers of its own
        originals = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        app = build_app(models, engine_config, server_config, replicas, chat_template)
        if not deploy(app, app_name, route_prefix, stop):
            log.info("stopped before application %r served: deleted it", app_name)
            return
        names = ", ".join(named_models(models))
        log.info("serving %s on Ray Serve at http://%s:%d%s (application %r)", names, server_config.host,
                 server_config.port, route_prefix.rstrip("/"), app_name)
        while not stop.wait(0.5):
            pass
        log.info("stopping: deleting application %r (replicas drain for up to %g s)", app_name,
                 server_config.gate.drain_timeout_s)
        serve.delete(app_name)
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            ray.shutdown()
