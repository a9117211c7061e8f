"""Closed by default: the proxy's admin routes answer 403 until an admin key is set (or they are opened to
loopback clients on a loopback proxy); node URLs are validated; no node error body reaches a client; docs
and metrics need the API key like the API; a server reachable from other hosts without keys warns at
start. The attacker's node is a tiny HTTP server on loopback that records everything it receives."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.serve.harness import ADMIN_KEY, ServerThread, lmkit_subprocess

SECRET = "node-internal-secret-7f3a"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "my private prompt"}], "max_tokens": 2}


class FakeNode:
    """Looks like an api_server serving `tiny` (/health, /ready, /v1/models, an answer to every POST) and records
    every request it receives as (method, path, body). ``post_status`` != 200: POSTs answer that status with
    SECRET in the body; ``models_status`` != 200: /v1/models does."""

    def __init__(self, post_status: int = 200, models_status: int = 200, ready_status: int = 200):
        self.requests: list[tuple[str, str, str]] = []
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the proxy read enough and left
                    pass

            def do_GET(self) -> None:
                node.requests.append(("GET", self.path, ""))
                if self.path == "/v1/models" and models_status != 200:
                    return self._answer(models_status, {"error": {"message": SECRET}})
                if self.path == "/ready" and ready_status != 200:
                    return self._answer(ready_status, {"error": {"message": "not ready"}})
                self._answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
                             if self.path == "/v1/models" else {})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
                node.requests.append(("POST", self.path, body))
                if post_status != 200:
                    return self._answer(post_status, {"error": {"message": SECRET, "type": "server_error"}})
                self._answer(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": "pwned"}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def servers():
    """make(kind, ...) starts a FakeNode ('node') or a proxy ('proxy', ProxyConfig fields); all stop at the end."""
    from lmkit.serve import ProxyConfig, create_proxy_app

    started = []

    def make(kind: str, **kwargs):
        if kind == "node":
            s = FakeNode(**kwargs)
        else:
            s = ServerThread(create_proxy_app(ProxyConfig(**{"health_interval_s": 0.2, **kwargs})))
        started.append(s)
        return s

    yield make
    for s in reversed(started):
        s.stop()


# ---- the admin routes -------------------------------------------------------------------------------------

def test_admin_routes_closed_without_a_key(servers, api_server):
    """The attack of the issue: without --admin-key nobody can add a node (which would get health checks and
    users' prompts), remove the real ones, or list them. With the key, the same add works."""
    fake = servers("node")
    proxy = servers("proxy", nodes=(api_server.url,))
    for method, route, body in (("POST", "add", {"url": fake.url}), ("POST", "remove", {"url": api_server.url}),
                                ("GET", "status", None)):
        r = httpx.request(method, f"{proxy.url}/nodes/{route}", json=body, headers=ADMIN)
        assert r.status_code == 403, r.text
        assert "--admin-key" in r.json()["error"]["message"], r.json()
    for _ in range(6):
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] != "pwned", r.text
    assert fake.requests == []

    proxy = servers("proxy", admin_key=ADMIN_KEY)
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": fake.url + "/"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer ") and fake.requests == []
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": fake.url + "/"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["is_up"] and r.json()["url"] == fake.url, r.text  # normalised
    assert ("GET", "/ready", "") in fake.requests
    r = httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN)
    assert [n["url"] for n in r.json()["nodes"]] == [fake.url]
    assert httpx.post(f"{proxy.url}/nodes/remove", json={"url": fake.url}, headers=ADMIN).status_code == 200


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/x?y", "http://127.0.0.1:1?y", "http://127.0.0.1:1/#f",
                                 "http://127.0.0.1:1/v1", "ftp://127.0.0.1:21", "file:///etc/passwd",
                                 "http://user:pw@127.0.0.1:1", "http://@127.0.0.1:1", "http://", "http://:80",
                                 "127.0.0.1:1", "http://127.0.0.1:99999", "http://127.0.0.1:0",
                                 "http://127.0.0.1:abc", "http://127.0.0.1:1:2", "http://a b:1",
                                 "http://127.0.0.1:1\r\nX: y", "http://[::1%eth0]:1"])
def test_node_urls_are_validated(servers, url):
    fake = servers("node")
    proxy = servers("proxy", admin_key=ADMIN_KEY)
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": url}, headers=ADMIN)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "url" and "url" in r.json()["error"]["message"], r.json()
    assert fake.requests == []


def test_node_urls_are_normalised():
    """One spelling per server, so that one server is one node."""
    from lmkit.serve.proxy import normalize_node_url

    assert normalize_node_url(" HTTP://LocalHost:23333/ ") == "http://localhost:23333"
    assert normalize_node_url("https://[::1]:8443") == "https://[::1]:8443"
    assert normalize_node_url("http://node-a.internal") == "http://node-a.internal:80"
    for same in ("http://[0:0:0::1]:81", "http://[::0001]:81/", "HTTP://[::1]:081"):
        assert normalize_node_url(same) == "http://[::1]:81", same
    assert normalize_node_url("https://node-a.internal.:443") == normalize_node_url("https://NODE-A.internal")


def test_one_server_is_one_node_however_it_is_spelled(servers):
    fake = servers("node")
    proxy = servers("proxy", admin_key=ADMIN_KEY)
    port = fake.url.rsplit(":", 1)[1]
    for url in (fake.url, f"{fake.url}/", f" HTTP://127.0.0.1:{port}/ ", f"http://127.0.0.1:{int(port):05d}"):
        assert httpx.post(f"{proxy.url}/nodes/add", json={"url": url}, headers=ADMIN).status_code == 200, url
    status = httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN).json()
    assert [n["url"] for n in status["nodes"]] == [fake.url], status


@pytest.mark.parametrize("url", ["http://169.254.169.254", "http://169.254.170.2:80", "http://[fe80::1]:8000",
                                 "http://[::ffff:169.254.169.254]:80", "http://[fd00:ec2::254]",
                                 "http://100.100.100.200", "http://metadata.google.internal",
                                 "http://METADATA.google.internal.:80", "http://instance-data"])
def test_link_local_and_metadata_nodes_are_refused(servers, url):
    """A proxy's admin could otherwise point it at the host's metadata service (server-side request forgery):
    400 naming why and the flag that opens it; nothing is added."""
    proxy = servers("proxy", admin_key=ADMIN_KEY)
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": url}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
    assert "refuses" in r.json()["error"]["message"], r.json()
    assert httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN).json()["nodes"] == []


@pytest.mark.parametrize("speed", ["Infinity", "-Infinity", "NaN", "1e999", "0", "-1"])
def test_a_node_speed_must_be_a_finite_positive_number(servers, speed):
    """Python's JSON reads Infinity and NaN: such a speed would take all traffic and break /nodes/status."""
    fake = servers("node")
    proxy = servers("proxy", admin_key=ADMIN_KEY)
    r = httpx.post(f"{proxy.url}/nodes/add", content=f'{{"url": "{fake.url}", "speed": {speed}}}'.encode(),
                   headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speed", r.text
    status = httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN)
    assert status.status_code == 200 and status.json()["nodes"] == [], status.text


def test_allow_node_network_opens_what_the_default_refuses():
    from lmkit.serve import ProxyConfig

    with pytest.raises(ValueError, match="169.254.0.0/16.*--allow-node-network"):
        ProxyConfig(nodes=("http://169.254.10.20:8000",))
    config = ProxyConfig(nodes=("http://169.254.10.20:8000",), allow_node_networks=("169.254.10.0/24",))
    assert config.nodes == ("http://169.254.10.20:8000",)
    with pytest.raises(ValueError, match="169.254.169.254.*refuses"):  # the rest of link-local stays closed
        ProxyConfig(nodes=("http://169.254.169.254",), allow_node_networks=("169.254.10.0/24",))
    with pytest.raises(ValueError, match="--allow-node-network 'nope': not a network"):
        ProxyConfig(allow_node_networks=("nope",))


def test_names_resolving_to_refused_addresses_are_not_connected_to():
    """The resolver of the proxy's connections drops the addresses the policy refuses: a name that resolves
    (or re-resolves, later) only to those is never connected to. Here the policy refuses loopback, so that
    localhost is such a name."""
    import ipaddress

    from lmkit.serve.proxy.netpolicy import NodeNetworkPolicy, PolicyResolver

    policy = NodeNetworkPolicy(refused=(ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")))

    async def resolve(name, policy):
        resolver = PolicyResolver(policy)
        try:
            return await resolver.resolve(name, 80)
        finally:
            await resolver.close()

    with pytest.raises(OSError, match="localhost resolves to no address the proxy may use: 127.0.0.1"):
        asyncio.run(resolve("localhost", policy))
    assert [r["host"] for r in asyncio.run(resolve("localhost", NodeNetworkPolicy()))] == ["127.0.0.1"]
    with pytest.raises(OSError, match="metadata service"):
        asyncio.run(resolve("metadata.google.internal", NodeNetworkPolicy()))


def test_start_nodes_are_validated():
    from lmkit.serve import ProxyConfig

    with pytest.raises(ValueError, match="url 'http://127.0.0.1:1/x.*path"):
        ProxyConfig(nodes=("http://127.0.0.1:1/x",))
    assert ProxyConfig(nodes=("http://127.0.0.1:1/",)).nodes == ("http://127.0.0.1:1",)


def test_open_admin_on_loopback(servers, caplog):
    from lmkit.serve import ProxyConfig, create_proxy_app

    fake = servers("node")
    with caplog.at_level(logging.WARNING, logger="lmkit.serve.proxy"):
        proxy = servers("proxy", unsafe_open_admin_on_loopback=True)
    assert any("--unsafe-open-admin-on-loopback" in r.getMessage() for r in caplog.records), caplog.text
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": fake.url})
    assert r.status_code == 200 and r.json()["is_up"], r.text
    assert httpx.get(f"{proxy.url}/nodes/status").status_code == 200

    async def from_afar() -> httpx.Response:  # the same app, asked by a client that is not on loopback
        app = create_proxy_app(ProxyConfig(unsafe_open_admin_on_loopback=True))
        transport = httpx.ASGITransport(app, client=("10.1.2.3", 4567))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.get("/nodes/status")

    r = asyncio.run(from_afar())
    assert r.status_code == 403 and "loopback" in r.json()["error"]["message"], r.text
    with pytest.raises(ValueError, match="--unsafe-open-admin-on-loopback.*loopback --host"):
        ProxyConfig(host="0.0.0.0", unsafe_open_admin_on_loopback=True)


def test_registration_explains_a_closed_proxy(servers, caplog):
    """An api_server's --proxy-url registration says what to set when the proxy answers 403 or 401."""
    from lmkit.serve import ServerConfig
    from lmkit.serve.api_server import register_with_proxy

    closed, keyed = servers("proxy"), servers("proxy", admin_key=ADMIN_KEY)
    with caplog.at_level(logging.WARNING, logger="lmkit.serve"):
        asyncio.run(register_with_proxy(ServerConfig(port=1, proxy_url=closed.url), None))
        asyncio.run(register_with_proxy(ServerConfig(port=1, proxy_url=keyed.url, proxy_admin_key="no"), None))
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2, caplog.text
    assert "403" in refused[0] and "--admin-key KEY" in refused[0] and "--proxy-admin-key KEY" in refused[0]
    assert "401" in refused[1] and "wrong admin key" in refused[1] and "--proxy-admin-key" in refused[1]


def test_cli_refuses_open_admin_on_every_interface():
    p = lmkit_subprocess("serve", "proxy", "--host", "0.0.0.0", "--unsafe-open-admin-on-loopback")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "loopback --host" in err and "Traceback" not in err, err
    p = lmkit_subprocess("serve", "proxy", "--node", "http://127.0.0.1:1/?x=1")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "query" in err and "Traceback" not in err, err


# ---- node errors stay in the proxy's log ------------------------------------------------------------------

@pytest.mark.parametrize("node_status,client_status", [(503, 502), (500, 500), (429, 429)])
def test_node_error_bodies_do_not_reach_the_client(servers, caplog, node_status, client_status):
    fake = servers("node", post_status=node_status)
    proxy = servers("proxy", nodes=(fake.url,))
    with caplog.at_level(logging.WARNING, logger="lmkit.serve.proxy"):
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == client_status, r.text
    assert SECRET not in r.text and fake.url not in r.text, r.text
    assert r.json()["error"]["message"] and str(node_status) in r.json()["error"]["message"], r.json()
    if node_status != 429:
        assert SECRET in caplog.text  # the details are in the log


def test_health_check_error_bodies_stay_in_the_log(servers):
    fake = servers("node", models_status=500)
    proxy = servers("proxy", nodes=(fake.url,), admin_key=ADMIN_KEY)
    node = httpx.get(f"{proxy.url}/nodes/status", headers=ADMIN).json()["nodes"][0]
    assert not node["is_up"] and "500" in node["last_error"] and SECRET not in node["last_error"], node


# ---- docs and metrics follow the API's keys ---------------------------------------------------------------

DOC_PATHS = ("/openapi.json", "/docs", "/redoc")


@pytest.mark.parametrize("public_metrics", [False, True])
def test_api_server_docs_and_metrics_need_the_key(tiny_engine, api_server, public_metrics):
    from lmkit.serve import GateConfig, ServerConfig, create_app

    gate = GateConfig(api_keys=("k1",), public_metrics=public_metrics)
    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", gate=gate)))
    try:
        for path in DOC_PATHS:
            assert httpx.get(server.url + path).status_code == 401, path
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer k1"}).status_code == 200, path
        assert httpx.get(server.url + "/metrics").status_code == (200 if public_metrics else 401)
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    for path in (*DOC_PATHS, "/metrics", "/health"):  # without keys, all stays open
        assert httpx.get(api_server.url + path).status_code == 200, path


def test_proxy_docs_need_the_key_and_admin_routes_take_the_admin_key(servers):
    from lmkit.serve import GateConfig

    proxy = servers("proxy", gate=GateConfig(api_keys=("k1",)), admin_key=ADMIN_KEY)
    for path in DOC_PATHS:
        assert httpx.get(proxy.url + path).status_code == 401, path
        assert httpx.get(proxy.url + path, headers={"Authorization": "Bearer k1"}).status_code == 200, path
    assert httpx.get(proxy.url + "/health").status_code == 200
    assert httpx.get(proxy.url + "/nodes/status", headers=ADMIN).status_code == 200
    assert httpx.get(proxy.url + "/nodes/status", headers={"Authorization": "Bearer k1"}).status_code == 401


# ---- listening defaults -----------------------------------------------------------------------------------

def test_servers_listen_on_loopback_by_default():
    from lmkit.serve import ProxyConfig, ServerConfig

    assert ServerConfig().host == ProxyConfig().host == "127.0.0.1"
    assert ServerConfig(port=5).url == "http://127.0.0.1:5"
    assert ServerConfig(host="::1", port=5).url == "http://[::1]:5"


@pytest.mark.parametrize("host,keys,warns", [("0.0.0.0", (), True), ("::", (), True), ("10.0.0.7", (), True),
                                             ("0.0.0.0", ("k",), False), ("127.0.0.1", (), False),
                                             ("localhost", (), False), ("::1", (), False)])
def test_warning_when_reachable_without_keys(caplog, host, keys, warns):
    from lmkit.serve.gate import GateConfig, warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="lmkit.serve"):
        assert warn_if_exposed(host, 8000, GateConfig(api_keys=keys)) == warns
    text = caplog.text
    assert (("anyone who can reach" in text and "--api-keys" in text) if warns else text == ""), text


@pytest.mark.parametrize("ready_status, is_up", [(503, False), (404, True)])
def test_the_proxy_asks_a_node_whether_it_is_ready(servers, ready_status, is_up):
    """A node whose /ready answers 503 (alive, but saturated or stalled) is down for the proxy; a server without a
    /ready (another OpenAI server: 404) is checked on its /health instead."""
    fake = servers("node", ready_status=ready_status)
    proxy = servers("proxy", admin_key=ADMIN_KEY)
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": fake.url}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["is_up"] is is_up, r.text
    if not is_up:
        assert r.json()["last_error"] == "health check failed: /ready answered 503", r.json()
    else:
        assert ("GET", "/health", "") in fake.requests
