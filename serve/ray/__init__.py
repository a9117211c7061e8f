"""lmkit on Ray Serve: replicas of lmkit's engine with the api_server's routes, autoscaled by Ray Serve.

``build_app`` for ``serve.run``, ``app_builder`` for a Ray Serve config file (``import_path:
lmkit.serve.ray:app_builder``), ``run_ray`` for ``lmkit serve ray``; they need the optional extra
(``pip install -e ".[ray]"``). Names are imported on first use.
"""

from importlib import import_module

_EXPORTS = {
    "RAY_SERVE_ENV": "lmkit.serve.ray.config", "cluster_auth_env": "lmkit.serve.ray.config",
    "ReplicaConfig": "lmkit.serve.ray.config", "model_name_of": "lmkit.serve.ray.config",
    "named_models": "lmkit.serve.ray.config", "app_builder": "lmkit.serve.ray.app",
    "build_app": "lmkit.serve.ray.app", "deploy": "lmkit.serve.ray.app", "run_ray": "lmkit.serve.ray.app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmkit.serve.ray' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
