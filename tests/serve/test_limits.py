"""Safe defaults of the servers: generation requests admitted by the sequences they run (prompts x n) up to
a limit derived from the engine (429 with Retry-After beyond it, 400 for a request that can never fit,
released however the request ends); header and body read timeouts (slowloris, a body that stalls: 408);
SIGTERM drains (health and new requests 503 at once, streams in progress finish up to --drain-timeout,
then are cancelled) and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.helpers import assert_blocks_free
from tests.serve.harness import (ADMIN_KEY, LONG_COMPLETION, free_port, lmkit_subprocess, streams_in_progress,
                                 wait_healthy)

SHORT = {"model": "tiny", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
# Two waves of the slow engine's batch of 8 x 480 tokens: many seconds, well past a 1 s drain.
LONGER = {**LONG_COMPLETION, "prompt": ["a", "b"], "n": 8, "stream": True}


class DrainingServerThread:
    """An app behind the servers' own uvicorn setup (serve_app's server: header timeout, draining) on a
    thread of this process; ``drain()`` does what SIGTERM does to `lmkit serve`."""

    def __init__(self, gate):
        from lmkit.serve.asgi import DrainingServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = DrainingServer(gate, "127.0.0.1", self.port, log_level="warning")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(self.server.serve()),
                                       daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout_s=30)

    def drain(self) -> None:
        self.server.start_draining()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


def admitted(url: str) -> tuple[float, float]:
    """(sequences admitted now, the limit) from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {name: float(v) for name, v in re.findall(r"^(lmkit_\w+) (\S+)$", text, re.M)}
    return values["lmkit_num_seqs_admitted"], values["lmkit_max_num_seqs_admitted"]


def wait_admitted(url: str, num_seqs: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while admitted(url)[0] != num_seqs:
        assert time.monotonic() < deadline, f"{admitted(url)} admitted, expected {num_seqs}"
        time.sleep(0.02)


# ---- sequences admitted -----------------------------------------------------------------------------------

def test_sequences_beyond_the_limit_get_429(slow_server):
    """The slow engine runs 8 (max_batch_size) and the server admits as many again waiting: 16 sequences.
    One request of 3 prompts x n=4 holds 12 of them; 5 more get 429, 4 more fit."""
    server, engine = slow_server
    url = server.url
    assert admitted(url) == (0, 16)
    held = {**LONG_COMPLETION, "prompt": ["a", "b", "c"], "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=held, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping the iterator closes the connection
        next(lines)
        assert admitted(url) == (12, 16)
        r2 = httpx.post(f"{url}/v1/completions", json={**SHORT, "n": 5}, timeout=30)
        assert r2.status_code == 429, r2.text
        assert r2.headers["retry-after"] == "1"
        error = r2.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
        assert "16" in error["message"] and "max_waiting_seqs" in error["message"], error
        r3 = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 5,
                              "max_tokens": 2})
        assert r3.status_code == 429, r3.text
        # exactly the 4 left fit (a stream answers its status as soon as it is admitted)
        with httpx.stream("POST", f"{url}/v1/completions", json={**SHORT, "n": 4, "stream": True}, timeout=30) as r4:
            assert r4.status_code == 200
            assert admitted(url) == (16, 16)
    wait_admitted(url, 0)
    r5 = httpx.post(f"{url}/v1/completions", json={**SHORT, "n": 5}, timeout=60)
    assert r5.status_code == 200 and len(r5.json()["choices"]) == 5
    assert_blocks_free(engine)


def test_a_request_that_can_never_fit_gets_400(slow_server):
    server, engine = slow_server
    url = server.url
    r = httpx.post(f"{url}/v1/completions", json={**SHORT, "prompt": ["p"] * 6, "n": 3}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "18" in error["message"] and "16" in error["message"], error
    r = httpx.post(f"{url}/v1/completions", json={**SHORT, "prompt": ["p"] * 17}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert admitted(url) == (0, 16)
    assert_blocks_free(engine)


def test_sequences_are_released_however_the_request_ends(slow_server):
    """A stream left mid-way, a non-streamed request left while it generates, requests that fail after
    admission (prompt too long, max_tokens too large), a finished stream and a finished request: afterwards
    nothing is admitted, the whole limit can be taken again, and no KV block is held."""
    from tests.serve.harness import generating, leave_long_completion

    server, engine = slow_server
    url = server.url
    leave_long_completion(url, stream=True)
    leave_long_completion(url, stream=False, started=generating(engine))
    r = httpx.post(f"{url}/v1/completions", json={**SHORT, "prompt": "y" * 600, "n": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{url}/v1/completions", json={**SHORT, "max_tokens": 10_000, "n": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    with httpx.stream("POST", f"{url}/v1/completions", json={**SHORT, "n": 4, "stream": True}, timeout=60) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    assert httpx.post(f"{url}/v1/completions", json={**SHORT, "n": 4}, timeout=60).status_code == 200
    wait_admitted(url, 0)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={**SHORT, "prompt": ["a", "b"], "n": 8, "stream": True}) as r:
        assert r.status_code == 200
    wait_admitted(url, 0)
    assert_blocks_free(engine)


# ---- header and body read timeouts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def strict_server(tiny_engine):
    """The tiny model behind serve_app's server with 1 s header and body timeouts."""
    from lmkit.serve import GateConfig, ServerConfig, create_app

    gate = GateConfig(header_timeout_s=1.0, body_timeout_s=1.0)
    server = DrainingServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", gate=gate)))
    yield server
    server.stop()


def closed_within(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before it closed ``sock`` (fails when it stays open longer than ``timeout_s``)."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open over {timeout_s} s") from None
    return received


def test_slowloris_connections_are_closed(strict_server):
    """Connections that send nothing, half a request line, or half the headers of a second request on a
    kept-alive connection are closed after the header timeout, while the server answers others."""
    port = strict_server.port
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]
    halves = []
    for _ in range(10):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HT")
        halves.append(s)
    kept = socket.create_connection(("127.0.0.1", port), timeout=10)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    started = time.monotonic()
    for _ in range(5):
        assert httpx.get(f"{strict_server.url}/health", timeout=5).status_code == 200
    for s in silent + halves + [kept]:
        assert closed_within(s, 5.0) == b""
        s.close()
    assert time.monotonic() - started < 4.0


def test_a_stalled_body_gets_408(strict_server, tiny_engine):
    port = strict_server.port
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = json.dumps(SHORT).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
    started = time.monotonic()
    answer = closed_within(s, 5.0)
    s.close()
    assert time.monotonic() - started < 4.0
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(payload)["error"]
    assert "1 s" in error["message"] and error["type"] == "invalid_request_error", error
    # a body that arrives in time is served
    r = httpx.post(f"{strict_server.url}/v1/completions", json=SHORT, timeout=30)
    assert r.status_code == 200
    assert_blocks_free(tiny_engine.engine)


# ---- draining ------------------------------------------------------------------------------------------------

def test_drain_timeout_cancels_what_is_left(slow_engine):
    """In-process: after start_draining() /health and new requests get 503; a stream still running when the
    drain time is up ends with an error event naming it, and a whole answer still running gets a 503 naming it;
    their engine requests are cancelled, and serve() returns."""
    from lmkit.serve import GateConfig, ServerConfig, create_app

    app = create_app(slow_engine, ServerConfig(model_name="tiny", gate=GateConfig(drain_timeout_s=0.5)))
    server = DrainingServerThread(app)
    whole: list[httpx.Response] = []
    try:  # 4 + 4 sequences of 480 tokens: seconds of the slow model's steps, all running at once (max_batch 8)
        waiting = threading.Thread(target=lambda: whole.append(
            httpx.post(f"{server.url}/v1/completions", json=LONG_COMPLETION, timeout=30)), daemon=True)
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG_COMPLETION, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            waiting.start()
            deadline = time.monotonic() + 10
            while slow_engine.engine.metrics().num_running < 8:
                assert time.monotonic() < deadline, "the whole-answer request never started"
                time.sleep(0.01)
            server.drain()
            started = time.monotonic()
            health = httpx.get(f"{server.url}/health", timeout=5)
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
            refused = httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=5)
            assert refused.status_code == 503, refused.text
            rest = [line for line in lines if line]
        assert rest and "data: [DONE]" not in rest
        error = json.loads(rest[-1][6:])["error"]
        assert error["code"] == "server_shutting_down" and "drain time of 0.5 s" in error["message"], error
        waiting.join(timeout=10)
        assert whole and whole[0].status_code == 503, whole
        assert "drain time of 0.5 s" in whole[0].json()["error"]["message"], whole[0].text
        assert time.monotonic() - started < 6.0
        server.thread.join(timeout=10)
        assert not server.thread.is_alive(), "serve() did not return after the drain timeout"
    finally:
        server.stop()
    assert_blocks_free(slow_engine.engine)


def start_api_server(folder, *extra: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = lmkit_subprocess("serve", "api_server", str(folder), "--host", "127.0.0.1", "--port", str(port),
                            "--model-name", "tiny", "--device", "cpu", "--dtype", "float32", "--max-batch-size", "8",
                            "--session-len", "512", "--cache-block-seq-len", "16", "--cache-max-entry-count", "256",
                            "--num-threads", "1", "--log-level", "warning", *extra)
    try:
        wait_healthy(url, timeout_s=120, proc=proc)
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, url


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_sigterm_drains_streams_and_exits_0(slow_llama):
    """8 streams in progress at SIGTERM all complete; /health and new requests get 503 at once; exit 0."""
    proc, url = start_api_server(slow_llama)
    try:
        threads, results = streams_in_progress(url, "tiny", 8, max_tokens=400)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code != 503:
            assert time.monotonic() - signalled < 2.0, f"/health still {health.status_code} after SIGTERM"
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error", refused.text
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == list(range(8)), f"streams that did not complete: {set(range(8)) - set(results)}"
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
    finally:
        stop(proc)


def test_short_drain_timeout_cuts_a_long_stream_and_exits_0(slow_llama):
    proc, url = start_api_server(slow_llama, "--drain-timeout", "1")
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONGER, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = [line for line in lines if line]
        assert "data: [DONE]" not in rest
        assert json.loads(rest[-1][6:])["error"]["code"] == "server_shutting_down", rest[-3:]
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert time.monotonic() - signalled < 15.0
        assert "ending 1 requests still in progress" in err and "Traceback" not in err, err
    finally:
        stop(proc)


def test_proxy_header_timeout_and_sigterm_exit_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = lmkit_subprocess("serve", "proxy", "--host", "127.0.0.1", "--port", str(port), "--admin-key", ADMIN_KEY,
                            "--header-timeout", "1", "--body-timeout", "1", "--drain-timeout", "5",
                            "--log-level", "warning")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate(timeout=10)[1]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.1)
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        assert closed_within(s, 5.0) == b""
        s.close()
        assert time.monotonic() - started < 4.0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        stop(proc)


# ---- readiness -----------------------------------------------------------------------------------------------

def test_ready_is_503_while_the_preparation_queue_is_saturated(tiny_engine, monkeypatch):
    """/ready (no key needed) answers 503 naming why while more requests wait for preparation than the limit,
    /health stays 200 (alive: nothing to restart), and /ready is 200 again once they are through. The requests
    are held in preparation by a gate on the server's own _prepare."""
    from lmkit.serve import GateConfig, ServerConfig, create_app
    from tests.serve.harness import ServerThread

    app = create_app(tiny_engine, ServerConfig(model_name="tiny", ready_max_preparing=1,
                                               gate=GateConfig(api_keys=("k",))))
    serving = app.app.state.serving
    release = threading.Event()
    prepare = serving._prepare
    monkeypatch.setattr(serving, "_prepare", lambda req: release.wait(30) and prepare(req))
    server = ServerThread(app)
    answers: list[int] = []
    try:
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
        threads = [threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/v1/completions", json=SHORT, headers={"Authorization": "Bearer k"}, timeout=30).status_code))
            for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while serving.num_preparing < 2:
            assert time.monotonic() < deadline, "the requests never reached preparation"
            time.sleep(0.01)
        r = httpx.get(f"{server.url}/ready", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
        assert "preparation queue is saturated: 2 requests" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        release.set()
        for t in threads:
            t.join(timeout=30)
        assert answers == [200, 200]
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
    finally:
        release.set()
        server.stop()
    assert_blocks_free(tiny_engine.engine)


def test_readiness_sees_a_stalled_engine():
    """The verdict's rule on the engine's step counter: requests held and no step for stall_s is stalled; a step,
    or no requests, is not."""
    from lmkit.serve.readiness import Readiness

    ready = Readiness(max_preparing=4, stall_s=0.05)
    assert ready.reason_not_ready(0, num_steps=10, num_requests=3) is None
    time.sleep(0.1)
    assert "stalled: it holds 3 requests" in ready.reason_not_ready(0, num_steps=10, num_requests=3)
    assert ready.reason_not_ready(0, num_steps=11, num_requests=3) is None  # it stepped
    time.sleep(0.1)
    assert ready.reason_not_ready(0, num_steps=11, num_requests=0) is None  # idle is not stalled
    assert "saturated: 5 requests" in ready.reason_not_ready(5, num_steps=11, num_requests=0)
