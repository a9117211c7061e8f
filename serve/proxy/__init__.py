"""The proxy in front of many api_servers: node registry and health checks, routing strategies, retries."""

from lmkit.serve.proxy.registry import Node, NodeRegistry, normalize_node_url
from lmkit.serve.proxy.server import ProxyConfig, create_proxy_app, run_proxy
from lmkit.serve.proxy.strategies import STRATEGIES, make_strategy

__all__ = ["Node", "NodeRegistry", "ProxyConfig", "create_proxy_app", "run_proxy", "STRATEGIES", "make_strategy",
           "normalize_node_url"]
