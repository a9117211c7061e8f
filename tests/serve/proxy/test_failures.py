"""The proxy when things go wrong after routing: a client that leaves (before the first byte, mid-stream,
or while a non-streamed answer is being generated) cancels the node's engine request; a node that refuses
(429) has its answer passed on; a node killed mid-stream ends the client's stream with an error event. In
every case the proxy's in-flight count returns to zero and the proxy keeps serving."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.serve.harness import (ADMIN_KEY, LONG_COMPLETION, ServerThread, free_port, generating, in_flight,
                                 leave_long_completion, lmkit_subprocess, wait_healthy, wait_idle)


def make_proxy(*nodes: str) -> ServerThread:
    from lmkit.serve import ProxyConfig, create_proxy_app

    return ServerThread(create_proxy_app(ProxyConfig(nodes=nodes, admin_key=ADMIN_KEY, health_interval_s=0.5)))


@pytest.fixture(scope="module")
def slow_proxy(slow_server):
    server, engine = slow_server
    proxy = make_proxy(server.url)
    yield proxy, engine
    proxy.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_the_proxy_cancels_the_node_request(slow_proxy, stream):
    proxy, engine = slow_proxy
    before = engine.metrics().num_generated_tokens
    # non-streamed, the proxy waits for the node's whole answer: the client leaving must cancel that wait
    leave_long_completion(proxy.url, stream, started=generating(engine))
    wait_idle(proxy, engine)
    generated = engine.metrics().num_generated_tokens - before
    assert generated < 4 * 480 / 4, f"{generated} tokens generated after the client left"
    r = httpx.post(f"{proxy.url}/v1/completions", json={**LONG_COMPLETION, "max_tokens": 3, "n": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_client_leaving_before_the_first_byte(slow_proxy):
    """Clients that hang up before their first byte (their prompts still in prefill on the node): nothing
    stays in flight on the proxy or the node."""
    proxy, engine = slow_proxy
    body = {"model": "tiny", "prompt": "y" * 400, "max_tokens": 8, "n": 4, "stream": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body,
                              timeout=httpx.Timeout(30, read=0.001)) as r:
                r.read()
    wait_idle(proxy, engine)
    # the node may still be preparing a request whose bytes the proxy sent before its client left: it reaches the
    # engine late and ends when the node first writes to the closed connection (no block is kept: the autouse
    # check after the test sees to that); give it time to arrive, then to end
    time.sleep(1.0)
    wait_idle(proxy, engine, timeout_s=60)


def test_node_refusal_is_passed_on(slow_engine):
    """A node at its --max-concurrent-requests answers 429; with no other node the client gets that 429
    (status, OpenAI error body), and once the node is free again the same request goes through."""
    from lmkit.serve import GateConfig, ServerConfig, create_app

    node = ServerThread(create_app(slow_engine, ServerConfig(model_name="tiny",
                                                              gate=GateConfig(max_concurrent_requests=1))))
    proxy = make_proxy(node.url)
    try:
        long = {"model": "tiny", "prompt": "x", "max_tokens": 500, "n": 8, "ignore_eos": True, "stream": True}
        short = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=long, timeout=30) as busy:
            lines = busy.iter_lines()  # held: a dropped iterator closes the connection
            next(lines)
            r = httpx.post(f"{proxy.url}/v1/completions", json=short, timeout=30)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["message"] and r.json()["error"]["type"]
            assert in_flight(proxy) == {node.url: 1}
        wait_idle(proxy, slow_engine.engine)
        r = httpx.post(f"{proxy.url}/v1/completions", json=short, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proxy.stop()
        node.stop()


def test_node_killed_mid_stream_ends_the_stream_with_an_error(slow_llama):
    """The node dies after the client has had chunks: the proxy cannot retry, so the stream ends with an
    OpenAI error event (502) instead of a silent cut, and the proxy goes on serving."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node = lmkit_subprocess("serve", "api_server", str(slow_llama), "--host", "127.0.0.1", "--port", str(port),
                            "--model-name", "tiny", "--dtype", "float32", "--session-len", "512",
                            "--cache-max-entry-count", "64",
                            "--num-threads", "1", "--log-level", "warning")
    proxy = None
    try:
        wait_healthy(url, proc=node)
        proxy = make_proxy(url)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 480, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[len("data: "):])["choices"]
            node.send_signal(signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest and rest[-1].startswith("data: {"), rest[-3:]
        error = json.loads(rest[-1][len("data: "):])["error"]
        assert error["type"] == "server_error" and "the node serving this request failed" in error["message"], error
        wait_idle(proxy)
        assert httpx.get(f"{proxy.url}/health").json() == {"num_nodes_up": 0}  # marked down at once
    finally:
        node.kill()
        node.wait(timeout=10)
        if proxy is not None:
            proxy.stop()
