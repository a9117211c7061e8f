"""The proxy: each strategy's choice on constructed node states; the openai client through the proxy in
front of two api_servers (routing by model, /v1/models union, streams unbuffered, admin key); a node
killed mid-test (no client error, marked down, back in rotation once restarted and healthy)."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter

import httpx
import openai
import pytest

from lmkit.serve.proxy import Node, make_strategy
from tests.serve.harness import ADMIN_KEY as ADMIN
from tests.serve.harness import ServerThread, free_port, lmkit_subprocess, wait_healthy


# ---- strategies on constructed states ---------------------------------------------------------------------

def node(url, *, speed=1.0, in_flight=0, latencies=()):
    n = Node(url, speed=speed, is_up=True, models=[{"id": "m"}])
    n.num_in_flight = in_flight
    n.latencies_s.extend(latencies)
    return n


def test_random_is_weighted_by_speed():
    fast, slow = node("fast", speed=3.0), node("slow", speed=1.0)
    strategy = make_strategy("random", random.Random(0))
    picks = Counter(strategy.choose([fast, slow]).url for _ in range(4000))
    assert 0.72 < picks["fast"] / 4000 < 0.78, picks


def test_min_expected_latency():
    strategy = make_strategy("min_expected_latency", random.Random(0))
    a, b = node("a", speed=2.0, in_flight=4), node("b", speed=1.0, in_flight=2)  # 5/2 = 2.5 < 3/1
    assert strategy.choose([a, b]) is a
    c = node("c", in_flight=0)
    assert strategy.choose([a, b, c]) is c
    b.num_in_flight = 1  # 2/1 = 2 < 2.5
    assert strategy.choose([a, b]) is b
    even = Counter(strategy.choose([node("x"), node("y")]).url for _ in range(200))
    assert min(even.values()) > 60, even  # ties are shared


def test_min_observed_latency_tries_new_nodes():
    strategy = make_strategy("min_observed_latency", random.Random(0))
    quick, slow = node("quick", latencies=[0.1, 0.1]), node("slow", latencies=[0.3])
    assert strategy.choose([quick, slow]) is quick
    quick.num_in_flight = 3  # 0.1 x 4 = 0.4 > 0.3 x 1
    assert strategy.choose([quick, slow]) is slow
    new = node("new")  # no observation: optimistic prior = the best latency seen (0.1)
    assert strategy.choose([quick, slow, new]) is new
    quick.num_in_flight = 0
    tied = Counter(strategy.choose([quick, new]).url for _ in range(200))
    assert min(tied.values()) > 60, tied
    fresh = Counter(strategy.choose([node("p"), node("q", in_flight=1)]).url for _ in range(50))
    assert fresh == {"p": 50}  # nothing observed anywhere: fewest in flight


def test_unknown_strategy_lists_known():
    with pytest.raises(ValueError, match="min_expected_latency.*min_observed_latency.*random"):
        make_strategy("round_robin")


# ---- a proxy in front of two api_servers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def second_engine(tiny_llama):
    from tests.serve.harness import tiny_async_engine

    with tiny_async_engine(tiny_llama[0]) as engine:
        yield engine


@pytest.fixture(scope="module")
def cluster(tiny_engine, second_engine):
    """Two api_servers serving `tiny` (and one serving `other`) behind a proxy with an admin key."""
    from lmkit.serve import ProxyConfig, ServerConfig, create_app, create_proxy_app

    a = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny")))
    b = ServerThread(create_app(second_engine, ServerConfig(model_name="tiny")))
    other = ServerThread(create_app(second_engine, ServerConfig(model_name="other")))
    proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(a.url, b.url), admin_key=ADMIN,
                                                      health_interval_s=0.5)))
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": other.url}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["is_up"], r.text
    yield {"proxy": proxy, "a": a, "b": b, "other": other}
    for s in (proxy, a, b, other):
        s.stop()


def status(proxy) -> dict[str, dict]:
    r = httpx.get(f"{proxy.url}/nodes/status", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return {n["url"]: n for n in r.json()["nodes"]}


def proxy_client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_through_proxy(cluster):
    direct = openai.OpenAI(base_url=f"{cluster['a'].url}/v1", api_key="none", max_retries=0)
    client = proxy_client(cluster["proxy"])
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = direct.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == expected
    text = client.completions.create(model="tiny", prompt="ab", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    parts = client.completions.create(model="tiny", prompt="ab", max_tokens=5, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in parts) == text


def test_models_union_and_routing_by_model(cluster):
    client = proxy_client(cluster["proxy"])
    assert sorted(m.id for m in client.models.list().data) == ["other", "tiny"]
    before = status(cluster["proxy"])
    for _ in range(16):
        client.completions.create(model="tiny", prompt="ab", max_tokens=2)
    client.completions.create(model="other", prompt="ab", max_tokens=2)
    after = status(cluster["proxy"])
    got = {url: after[url]["num_requests"] - before[url]["num_requests"] for url in after}
    assert got[cluster["other"].url] == 1
    assert got[cluster["a"].url] > 0 and got[cluster["b"].url] > 0, got  # both nodes share the load
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="missing", prompt="ab", max_tokens=2)


def test_admin_routes_need_the_key(cluster):
    proxy = cluster["proxy"]
    assert httpx.get(f"{proxy.url}/nodes/status").status_code == 401
    r = httpx.post(f"{proxy.url}/nodes/add", json={"url": "http://127.0.0.1:1"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{proxy.url}/nodes/remove", json={"url": "http://127.0.0.1:1"},
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 404


def test_stream_passes_through_unbuffered(cluster, tiny_engine, second_engine):
    """The first chunk reaches the client while the node is still generating."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "n": 8,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster['proxy'].url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        running = tiny_engine.engine.metrics().num_running + second_engine.engine.metrics().num_running
        assert first.startswith("data: ") and running > 0
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"


def test_killed_node_is_retried_then_returns(cluster, tiny_llama):
    """A node registered with --proxy-url is killed: requests go on without error (retried on the other
    node), it is marked down, and after a restart it serves again."""
    proxy = cluster["proxy"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "api_server", str(tiny_llama[0]), "--host", "127.0.0.1", "--port", str(port), "--model-name",
            "tiny", "--proxy-url", proxy.url, "--proxy-admin-key", ADMIN, "--session-len", "512",
            "--cache-max-entry-count", "64", "--num-threads", "1", "--log-level", "warning"]
    node_proc = lmkit_subprocess(*args)
    try:
        wait_healthy(url, proc=node_proc)
        deadline = time.monotonic() + 30
        while not status(proxy).get(url, {}).get("is_up"):
            assert time.monotonic() < deadline, "the node did not register itself with the proxy"
            time.sleep(0.1)
        node_proc.send_signal(signal.SIGKILL)
        node_proc.wait(timeout=10)
        client = proxy_client(proxy)
        deadline = time.monotonic() + 30
        i = 0  # some are routed to the dead node (ties are broken at random) or a health check finds it first
        while i < 12 or status(proxy)[url]["is_up"]:
            assert time.monotonic() < deadline, "the killed node was never marked down"
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": str(i)}],
                                               max_tokens=3, stream=i % 2 == 0)
            if i % 2 == 0:
                assert any(c.choices and c.choices[0].finish_reason for c in r)
            else:
                assert r.choices[0].finish_reason in ("stop", "length")
            i += 1
        dead = status(proxy)[url]
        assert not dead["is_up"] and dead["last_error"]
        node_proc = lmkit_subprocess(*args)
        wait_healthy(url, proc=node_proc)
        deadline = time.monotonic() + 30
        while not status(proxy)[url]["is_up"]:
            assert time.monotonic() < deadline, "the restarted node did not come back"
            time.sleep(0.1)
        before = status(proxy)[url]["num_requests"]
        for i in range(16):
            client.completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert status(proxy)[url]["num_requests"] > before
    finally:
        node_proc.send_signal(signal.SIGINT)
        try:
            node_proc.wait(timeout=20)
        except Exception:
            node_proc.kill()
    deadline = time.monotonic() + 10  # a node that shuts down cleanly unregisters itself
    while url in status(proxy):
        assert time.monotonic() < deadline, "the stopped node did not unregister"
        time.sleep(0.1)
