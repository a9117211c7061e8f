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


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_prefix_follows_the_prefix_and_spreads_the_rest():
    from lmkit.serve.proxy.strategies import CHUNK_CHARS

    strategy = make_strategy("prefix", random.Random(0))
    nodes = [node("a"), node("b"), node("c")]
    tenants = [f"tenant {t}: " + "you are a careful assistant. " * 60 for t in range(9)]  # ~1,800 characters
    first = {t: strategy.choose(nodes, chat(p, "hi")).url for t, p in enumerate(tenants)}
    # nothing cached for a new tenant: among equally loaded nodes the one holding the fewest keys takes it
    assert sorted(list(first.values()).count(n.url) for n in nodes) == [3, 3, 3]
    for turn in range(3):
        for t, p in enumerate(tenants):
            assert strategy.choose(nodes, chat(p, f"question {turn}")).url == first[t]
    # a short request (no whole chunk) and one without text go by load, as min_expected_latency
    nodes[0].num_in_flight = nodes[1].num_in_flight = 1
    assert strategy.choose(nodes, chat("x", "y")) is nodes[2]
    assert strategy.choose(nodes, {"model": "m"}) is nodes[2]
    assert len(chat(tenants[0], "q")["messages"][0]["content"]) > 4 * CHUNK_CHARS


def test_prefix_is_bounded_by_load():
    strategy = make_strategy("prefix", random.Random(0))
    hot, other = node("hot"), node("other")
    system = "the one system prompt everyone shares. " * 40
    assert strategy.choose([hot, other], chat(system, "1")) in (hot, other)
    holder = hot if strategy.views.get("hot") else other
    spare = other if holder is hot else hot
    holder.num_in_flight = 8  # 8 more than the other: still the holder
    assert strategy.choose([hot, other], chat(system, "2")) is holder
    holder.num_in_flight = 9  # 9 more: the load bound sends it elsewhere, and that node learns the prefix
    assert strategy.choose([hot, other], chat(system, "3")) is spare
    assert strategy.views[spare.url].match(list(strategy.views[holder.url].keys)) > 0


def test_prefix_keys_chain_the_text():
    from lmkit.serve.proxy.strategies import CHUNK_CHARS, MAX_KEYS, prefix_keys, request_text

    a, b = "x" * (3 * CHUNK_CHARS + 10), "x" * (2 * CHUNK_CHARS) + "y" + "x" * CHUNK_CHARS
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert len(prefix_keys("z" * (CHUNK_CHARS * (MAX_KEYS + 50)))) == MAX_KEYS
    assert request_text({"prompt": "abc"}) == "abc" and request_text({"input": ["a", "b"]}) == '["a", "b"]'
    assert request_text([1, 2]) == "" and request_text({"model": "m"}) == ""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert "hi" in request_text(parts)


def test_unknown_strategy_lists_known():
    with pytest.raises(ValueError, match="min_expected_latency.*min_observed_latency.*prefix.*random"):
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
        # the first chunk with a generated token (the role chunks go out before the request is scheduled)
        first = next(line for line in lines if '"content":"' in line and '"content":""' not in line)
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


def test_prefix_strategy_keeps_each_tenant_on_the_node_that_caches_it(tiny_llama):
    """Three api_servers with their own engines behind a proxy with --strategy prefix: each tenant (its own long
    system prompt) lands on one node turn after turn, and that node serves the prompt from its prefix cache."""
    from contextlib import ExitStack

    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ProxyConfig, ServerConfig, create_app, create_proxy_app
    from tests.serve.harness import TINY_ENGINE

    with ExitStack() as stack:
        engines = [AsyncEngine(tiny_llama[0], EngineConfig(**TINY_ENGINE, enable_prefix_caching=True))
                   for _ in range(3)]
        for e in engines:
            stack.callback(e.close)
        servers = [ServerThread(create_app(e, ServerConfig(model_name="tiny"))) for e in engines]
        for s in servers:
            stack.callback(s.stop)
        proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=tuple(s.url for s in servers), admin_key=ADMIN,
                                                          strategy="prefix", health_interval_s=0.5)))
        stack.callback(proxy.stop)
        engine_of = {s.url: e for s, e in zip(servers, engines)}
        client = proxy_client(proxy)
        used = set()
        for tenant in range(4):
            system = f"Tenant {tenant}. " + "Answer briefly and cite the manual. " * 9  # ~330 characters
            nodes = []
            for turn in range(3):
                before = {u: n["num_requests"] for u, n in status(proxy).items()}
                hits = {u: e.metrics().num_prefix_hit_tokens for u, e in engine_of.items()}
                client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
                    {"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}])
                (url,) = [u for u, n in status(proxy).items() if n["num_requests"] > before[u]]
                nodes.append(url)
                if turn:  # the system prompt's blocks were cached by the turn before, on this node
                    assert engine_of[url].metrics().num_prefix_hit_tokens - hits[url] >= 16 * 10
            assert len(set(nodes)) == 1, nodes
            used.add(nodes[0])
        assert len(used) == 3  # a new tenant went to the idle node caching the fewest prefixes
