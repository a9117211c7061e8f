"""lmkit.serve: the OpenAI-compatible api_server, the proxy that routes across servers, and `lmkit chat`."""

from lmkit.serve.api_server import ServerConfig, create_app, run_api_server
from lmkit.serve.gate import GateConfig

__all__ = ["ServerConfig", "GateConfig", "create_app", "run_api_server"]
