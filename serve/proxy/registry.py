"""The proxy's nodes: what each serves, whether it is up, how loaded and how fast it has been.

State changes (all on the proxy's event loop):
```
added --health check passes--> up --request fails before its first byte--> down
  ^                             ^                                            |
  |                             +------------ health check passes -----------+
  +-- a node starts down until its first check passes; /nodes/add checks at once
```
A health check asks the node's /ready (readiness: a node that is alive but saturated or stalled is left alone
until it catches up) and its /v1/models.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp

from lmkit.serve.proxy.netpolicy import NodeNetworkPolicy

log = logging.getLogger("lmkit.serve.proxy")

_NETLOC = re.compile(r"(?P<host>\[[^\]]*\]|[^:\[\]]*)(?::(?P<port>[0-9]{1,5}))?")
_DNS_NAME = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*\.?")
_IPV4 = re.compile(r"[0-9.]+")
_IPV6 = re.compile(r"\[[0-9a-f:.]+\]")  # no zone (%eth0)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_node_url(url: str) -> str:
    """``scheme://host:port`` with scheme http or https, a DNS name or IP address as host, and nothing
    else (no user, path, query or fragment), in one spelling per server: lower-cased, the address in its
    canonical form, a name without its trailing dot, the scheme's default port written out, no trailing
    slash. ValueError naming what is wrong otherwise."""
    text = url.strip()

    def bad(why: str) -> ValueError:
        return ValueError(f"url {url!r}: {why}; a node URL is http://HOST:PORT (or https://)")

    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise bad("the scheme must be http or https")
    if not text.isprintable() or any(c.isspace() for c in text):
        raise bad("spaces and control characters are not allowed")
    if "?" in rest or "#" in rest:
        raise bad("a query or fragment is not allowed")
    netloc, _, path = rest.partition("/")
    if path:
        raise bad("a path is not allowed")
    if "@" in netloc:
        raise bad("a user name or password is not allowed")
    m = _NETLOC.fullmatch(netloc.lower())
    if m is None:
        raise bad("the port must be a number")
    host, port = m["host"], m["port"]
    if not host:
        raise bad("the host is missing")
    if host.startswith("["):
        valid = _IPV6.fullmatch(host) is not None and _is_ip(host[1:-1])
    elif _IPV4.fullmatch(host):
        valid = _is_ip(host)
    else:
        valid = _DNS_NAME.fullmatch(host) is not None
    if not valid:
        raise bad("the host is not a valid name or IP address")
    if port is not None and not 0 < int(port) < 65536:
        raise bad("the port must be in 1..65535")
    # one spelling per server: the address's canonical text, a name without its root dot, the port always
    if host.startswith("["):
        host = f"[{ipaddress.ip_address(host[1:-1]).compressed}]"
    elif _IPV4.fullmatch(host):
        host = ipaddress.ip_address(host).compressed
    else:
        host = host.rstrip(".")
    port = int(port) if port is not None else _DEFAULT_PORTS[scheme.lower()]
    return f"{scheme.lower()}://{host}:{port}"


def node_host(url: str) -> str:
    """The host of a URL as normalize_node_url writes it (an IPv6 address in brackets)."""
    return url.split("://", 1)[1].rsplit(":", 1)[0]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass
class Node:
    """One api_server behind the proxy."""

    url: str
    api_key: str | None = None
    """Bearer token the proxy sends to this node (its --api-keys), if it has keys."""
    speed: float = 1.0
    """Relative throughput (a node twice as fast: 2.0); weights `random` and `min_expected_latency`."""
    models: list[dict] = field(default_factory=list)
    """The node's /v1/models entries."""
    is_up: bool = False
    num_in_flight: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=32))
    """Recent times from dispatch to the node's first byte."""
    last_error: str | None = None
    """Why the node last failed: a status code or an error kind (the details are in the proxy's log)."""
    num_failures: int = 0
    num_requests: int = 0

    @property
    def model_names(self) -> list[str]:
        return [m["id"] for m in self.models]

    @property
    def observed_latency_s(self) -> float | None:
        """Mean of the recent first-byte latencies; None before the first one."""
        return sum(self.latencies_s) / len(self.latencies_s) if self.latencies_s else None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def status(self) -> dict:
        return {"url": self.url, "is_up": self.is_up, "models": self.model_names, "speed": self.speed,
                "num_in_flight": self.num_in_flight, "num_requests": self.num_requests,
                "observed_latency_s": self.observed_latency_s, "num_failures": self.num_failures,
                "last_error": self.last_error}


class NodeRegistry:
    """Nodes by URL, with the health checks that move them between up and down."""

    def __init__(self, health_timeout_s: float = 2.0, policy: NodeNetworkPolicy | None = None):
        self.nodes: dict[str, Node] = {}
        self.health_timeout_s = health_timeout_s
        self.policy = policy or NodeNetworkPolicy()

    def add(self, url: str, api_key: str | None = None, speed: float | None = None) -> Node:
        """Adds a node (down until checked), or updates the key/speed of a known one. ValueError for an
        invalid url (see normalize_node_url), an address the network policy refuses, or a speed that is not a
        finite number > 0."""
        url = normalize_node_url(url)
        self.policy.check_host(node_host(url))
        if speed is not None and not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        node = self.nodes.get(url)
        if node is None:
            node = self.nodes[url] = Node(url, api_key, speed or 1.0)
        else:
            node.api_key = api_key if api_key is not None else node.api_key
            node.speed = speed or node.speed
        return node

    def remove(self, url: str) -> Node | None:
        """The node forgotten, None if unknown; ValueError for an invalid url."""
        return self.nodes.pop(normalize_node_url(url), None)

    def candidates(self, model: str) -> list[Node]:
        """Nodes that are up and serve ``model``."""
        return [n for n in self.nodes.values() if n.is_up and model in n.model_names]

    def knows(self, model: str) -> bool:
        """Whether any node, up or down, has listed ``model``."""
        return any(model in n.model_names for n in self.nodes.values())

    def models(self) -> list[dict]:
        """The union of the /v1/models entries of the nodes that are up (first entry per id)."""
        seen: dict[str, dict] = {}
        for node in self.nodes.values():
            if node.is_up:
                for m in node.models:
                    seen.setdefault(m["id"], m)
        return list(seen.values())

    def mark_down(self, node: Node, why: str, details: str = "") -> None:
        """``why``: a status code or error kind, shown in /nodes/status; ``details`` (what the node said)
        only reach the log, once per change of ``why``."""
        if node.is_up or why != node.last_error:
            log.warning("node %s is down: %s%s", node.url, why, f" ({details})" if details else "")
        node.is_up = False
        node.last_error = why
        node.num_failures += 1

    async def check(self, node: Node, session: aiohttp.ClientSession) -> bool:
        """GET /ready (/health where a node has no /ready: another OpenAI server), then /v1/models; the node is up
        when both answer 200."""
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        try:
            for probe in ("/ready", "/health"):
                async with session.get(f"{node.url}{probe}", timeout=timeout) as r:
                    status, details = r.status, (await body_start(r) if r.status != 200 else "")
                if status != 404:
                    break
            if status != 200:
                raise NodeFailed(f"{probe} answered {status}", details)
            async with session.get(f"{node.url}/v1/models", headers=node.headers(), timeout=timeout) as r:
                if r.status != 200:
                    raise NodeFailed(f"/v1/models answered {r.status}", await body_start(r))
                data = await r.json()
            node.models = [m for m in data.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except NodeFailed as e:
            self.mark_down(node, f"health check failed: {e}", e.details)
            return False
        except Exception as e:  # any failure of any kind means: not serving
            self.mark_down(node, f"health check failed: {type(e).__name__}", f"{type(e).__name__}: {e}")
            return False
        if not node.is_up:
            log.info("node %s is up, serving %s", node.url, node.model_names)
        node.is_up = True
        node.last_error = None
        return True

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(n, session) for n in list(self.nodes.values())))

    async def run_health_checks(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Checks every node every ``interval_s`` seconds, forever (cancel to stop)."""
        while True:
            started = time.monotonic()
            await self.check_all(session)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


class NodeFailed(Exception):
    """A node failed a check or a request: why (a status or an error kind, str(e): what clients and
    /nodes/status see) and what it said (``details``, for the proxy's log only)."""

    def __init__(self, why: str, details: str = ""):
        super().__init__(why)
        self.details = details


async def body_start(response: aiohttp.ClientResponse, num_chars: int = 200) -> str:
    """The start of a node's body, for the proxy's log only (never for a client: the node may be anyone's)."""
    try:
        return (await response.content.read(4 * num_chars)).decode(errors="replace")[:num_chars]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"body unreadable: {type(e).__name__}"
