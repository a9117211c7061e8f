"""What lmkit's Ray Serve application is made of: the models by name, and each model's replicas. No Ray
import here, so that ``lmkit serve ray --help`` and config checks need neither Ray nor FastAPI."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from lmkit.config import EngineConfig
from lmkit.model_path import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME


RAY_SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                 "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}
"""The Ray Serve settings lmkit runs with (environment variables of every Ray process: `ray start`'s, the
pods' of a RayService): Ray's throughput-optimized mode, which runs user code and request routing on the
replicas' and the proxy's own event loops and drops per-request log lines, with its direct ingress left off
so that Ray's HTTP proxy stays the entry (this halves what Ray adds to a request's TTFT here), and that proxy
reaching the replicas over their gRPC servers: the mode sends calls between deployments over gRPC but, in ray
2.60, leaves the HTTP proxy's on Ray actor calls (a streaming generator item per chunk), and gRPC takes about
a quarter off the CPU a replica spends on Ray per request and off Ray's own (benchmark/results/ray-serve.md); and each
proxy choosing among all replicas by their queues (power of two choices), not first among those on its own
node: Ray's default fills a proxy's local replica up to max_ongoing_requests (2 x max_batch_size) before the
others get any, so with a proxy on every node the spread of requests over replicas was the spread of client
connections over proxies (8 concurrent requests split 1/7 to 4/4 over two replicas; 4/4 or 3/5 without the
preference). `lmkit serve ray` sets them for the Ray it starts itself."""


def cluster_auth_env() -> dict[str, str]:
    """RAY_AUTH_MODE for the nodes a user or a test starts with `ray start`: the one this process has, else
    ``disabled``. Since ray 2.60 a head started where the user has a ~/.ray/auth_token (which any local
    ``ray.init()`` writes, `lmkit serve ray` without --address too) turns token authentication on by itself,
    while a joining node and a driver given an address keep it off, and are refused (InvalidAuthToken)."""
    return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}


CONSTRUCTOR_RETRIES = 3
"""Failed starts after which a model's deployment is given up: Ray Serve's own rule (max_constructor_retry_count)
while none of its replicas has started (a model that does not load fails soon); ``deploy`` applies it to a
replica that keeps failing beside running ones, which Ray would retry for ever."""


REQUEST_ROUTERS = {"power_of_two": None, "prefix": "lmkit.serve.ray.routing:PrefixRequestRouter"}
"""ReplicaConfig.request_router's names, and the class Ray Serve loads for each (None: its default)."""


@dataclass(frozen=True)
class ReplicaConfig:
    """How many replicas of each model run, what each takes, and when Ray Serve adds or removes one."""

    min_replicas: int = 1
    """Replicas of each model at least (0: scale to zero when idle)."""
    max_replicas: int = 1
    """Replicas of each model at most; above min_replicas, Ray Serve autoscales on ongoing requests."""
    target_ongoing_requests: float = 8.0
    """Requests in progress per replica that autoscaling aims at: more on average adds replicas, fewer
    removes them."""
    num_cpus_per_replica: float = 1.0
    """CPUs Ray reserves for each replica; its engine runs that many threads unless num_threads is given."""
    max_ongoing_requests: int | None = None
    """Requests Ray sends one replica at once (more wait in Ray's queue). None: what one api_server admits,
    twice the engine's max_batch_size."""
    upscale_delay_s: float = 5.0
    """Seconds the load must stay above the target before a replica is added."""
    downscale_delay_s: float = 60.0
    """Seconds the load must stay below the target before a replica is removed."""
    look_back_period_s: float = 30.0
    """Seconds of load history each decision averages (Ray Serve's window; keep it above Ray's metrics interval,
    10 s): shorter reacts to a burst and to its end sooner, longer rides out brief spikes."""
    health_check_period_s: float = 5.0
    """Seconds between health checks of a replica (its engine answers); a replica failing one is replaced."""
    request_router: str = "power_of_two"
    """How Ray Serve picks a model's replica for a request: ``power_of_two`` (Ray's: the less loaded of two) or
    ``prefix`` (cache-aware: the replica likely to hold the request's prefix in its KV cache, bounded by load,
    as the proxy's prefix strategy; serve/ray/routing.py). With ``prefix`` the application's Router reads each
    request to route it, one model too (a hop more than the ingress replicas of power_of_two)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.min_replicas, int) and self.min_replicas >= 0):
            raise ValueError(f"min_replicas must be an integer >= 0, got {self.min_replicas!r}")
        if not (isinstance(self.max_replicas, int) and self.max_replicas >= max(1, self.min_replicas)):
            raise ValueError(f"max_replicas must be an integer >= max(1, min_replicas={self.min_replicas}), got "
                             f"{self.max_replicas!r}")
        for name in ("target_ongoing_requests", "num_cpus_per_replica", "health_check_period_s", "look_back_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_ongoing_requests is not None and not self.max_ongoing_requests >= 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests!r}")
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {', '.join(REQUEST_ROUTERS)}, got {self.request_router!r}")

    @property
    def is_autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas

    def deployment_options(self, engine: EngineConfig, drain_timeout_s: float) -> dict:
        """serve.deployment() options of a model's ModelServer."""
        options = dict(ray_actor_options={"num_cpus": self.num_cpus_per_replica},
                       max_ongoing_requests=self.max_ongoing_requests or 2 * engine.max_batch_size,
                       health_check_period_s=self.health_check_period_s,
                       graceful_shutdown_timeout_s=drain_timeout_s,
                       max_constructor_retry_count=CONSTRUCTOR_RETRIES)
        if self.request_router == "prefix":
            options["request_router_config"] = {"request_router_class": REQUEST_ROUTERS["prefix"]}
        if self.is_autoscaled:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": max(1, self.min_replicas), "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s}
        else:
            options["num_replicas"] = self.min_replicas
        return options


def model_name_of(model: str | None) -> str:
    """The name clients pass as ``model`` for a model given as a path, the bundled model's alias or a hub id,
    without loading it: the bundled model's name, else the last part of the path or id."""
    if model is None or model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return DEFAULT_MODEL_NAME
    return Path(model.rstrip("/")).name


def named_models(models: str | Sequence[str] | Mapping[str, str | None] | None) -> dict[str, str | None]:
    """Model name -> model (path, hub id, None for the bundled one). A string may be NAME=MODEL."""
    if isinstance(models, Mapping):
        named = dict(models)
    else:
        items = [models] if models is None or isinstance(models, str) else list(models) or [None]
        named = {}
        for item in items:
            name, sep, model = (item or "").partition("=")
            if not sep or "/" in name or not name:  # a path may hold '=' after a '/'
                name, model = model_name_of(item), item
            if name in named:
                raise ValueError(f"two models are named {name!r}: give one another name as NAME=MODEL")
            named[name] = model or None
    for name in named:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a model name must be a non-empty string, got {name!r}")
    return named
