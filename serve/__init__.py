"""lmkit.serve: the OpenAI-compatible api_server, the proxy that routes across servers, and `lmkit chat`.

Names are imported on first use, so that `lmkit --help` does not load FastAPI.
"""

from importlib import import_module

_EXPORTS = {
    "ServerConfig": "lmkit.serve.api_server", "create_app": "lmkit.serve.api_server",
    "run_api_server": "lmkit.serve.api_server", "GateConfig": "lmkit.serve.gate",
    "ProxyConfig": "lmkit.serve.proxy", "create_proxy_app": "lmkit.serve.proxy", "run_proxy": "lmkit.serve.proxy",
    "run_chat": "lmkit.serve.chat",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmkit.serve' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
