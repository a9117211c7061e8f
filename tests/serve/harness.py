"""The serving tests' harness: real uvicorn servers on loopback ports (in a thread of this process, or as
`lmkit serve ...` subprocesses), waiting for them, leaving requests half-way, and reading chat completions back."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx

TINY_ENGINE = dict(device="cpu", dtype="float32", cache_max_entry_count=256, max_batch_size=32, cache_block_seq_len=16,
                   session_len=512, num_threads=1)


@contextmanager
def tiny_async_engine(folder):
    """An AsyncEngine of the model in ``folder`` with TINY_ENGINE's settings, closed on exit."""
    from lmkit import AsyncEngine, EngineConfig

    engine = AsyncEngine(folder, EngineConfig(**TINY_ENGINE))
    try:
        yield engine
    finally:
        engine.close()
ADMIN_KEY = "admin-secret"
"""The admin key of the test proxies (their /nodes/* routes are closed without one)."""


class ServerThread:
    """An ASGI app under uvicorn on 127.0.0.1 (a free port), its own event loop on a daemon thread."""

    def __init__(self, app, port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout_s} s")


def lmkit_subprocess(*args: str, **kwargs) -> subprocess.Popen:
    """`python -m lmkit ARGS` with one OpenMP thread, its output in a pipe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lmkit", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kwargs)


# A request that takes the slow model seconds: 4 x 480 tokens.
LONG_COMPLETION = {"model": "tiny", "prompt": "x", "max_tokens": 480, "n": 4, "ignore_eos": True}


def leave_long_completion(url: str, stream: bool, started=None, body: dict | None = None,
                          headers: dict[str, str] | None = None) -> None:
    """Sends ``body`` (LONG_COMPLETION) to ``url``'s /v1/completions and leaves while it is generated: a
    stream after its first line; a non-streamed request once ``started()`` says the engine is at work on it
    (polled), by closing the raw connection. A read timeout instead would leave it to the machine's speed
    whether the answer had already come (it had, on fast cores). Fails if the answer came before the client
    left."""
    body = {**(body or LONG_COMPLETION), "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the iterator dropped at once
        return
    assert started is not None, "a non-streamed request needs started() to know when to leave"
    target = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = [f"POST {target.path.rstrip('/')}/v1/completions HTTP/1.1", f"Host: {target.host}:{target.port}",
            "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((target.host, target.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        deadline = time.monotonic() + 30
        while not started():
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        sock.setblocking(False)
        try:
            answer = sock.recv(65536)
        except BlockingIOError:
            answer = None
        assert answer is None, f"the request was answered before the client left: {answer[:200]!r}"


def streams_in_progress(url: str, model: str, count: int, max_tokens: int, timeout_s: float = 60.0):
    """``count`` streamed completions of ``max_tokens`` tokens to ``url``, each in a thread; returns once every one
    has its first line (the work is under way), with the threads (to join) and index -> the stream's non-empty
    lines (each entry written when its stream ends)."""
    started = threading.Barrier(count + 1, timeout=60)
    results: dict[int, list[str]] = {}

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"p{i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            lines = r.iter_lines()
            seen = [next(lines)]
            started.wait()
            results[i] = seen + [line for line in lines if line]

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    started.wait()
    return threads, results


def generating(engine):
    """started() for leave_long_completion: ``engine`` (an Engine) has generated a token since now."""
    before = engine.metrics().num_generated_tokens
    return lambda: engine.metrics().num_generated_tokens > before


def in_flight(proxy) -> dict[str, int]:
    """The proxy's in-flight request count per node (the proxy was started with ``admin_key=ADMIN_KEY``)."""
    r = httpx.get(f"{proxy.url}/nodes/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    return {n["url"]: n["num_in_flight"] for n in r.json()["nodes"]}


def wait_idle(proxy=None, engine=None, timeout_s: float = 5.0) -> None:
    """Until ``proxy`` has nothing in flight and ``engine`` nothing running or waiting (either may be None)."""
    deadline = time.monotonic() + timeout_s
    while (proxy is not None and any(in_flight(proxy).values())) or (
            engine is not None and engine.metrics().num_running + engine.metrics().num_waiting):
        assert time.monotonic() < deadline, (proxy and in_flight(proxy), engine and engine.metrics())
        time.sleep(0.005)


# ---- the chat families' servers (the `servers` fixture of tests/serve/conftest.py)

# tool schemas of every shape Gemma 4's call grammar writes (serve/tools/grammar.py _Gemma4Grammar)
GEMMA4_SCHEMAS = [  # optional-only properties, a nested object, arrays of objects, untyped values, no properties
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "number"}},
                                            "required": ["x"]},
                                      "l": {"type": "array", "items": {"type": "object"}, "minItems": 1,
                                            "maxItems": 3},
                                      "z": {}}, "required": ["o", "z"]},
    {"type": "object"},
]

TOOL_FAMILIES = ["qwen2.5", "qwen3", "llama3.1", "mistral", "qwen3_coder", "gpt_oss", "gemma4"]
# prompt pacing on (chunks sized from measured times), as users run: the tool tests' seeded requests (whole, then
# streamed) compute alike however their prompts were cut (the kernels are batch- and chunk-invariant, AMX included)
FAMILY_ENGINE = dict(device="cpu", max_batch_size=8, cache_max_entry_count=256, cache_block_seq_len=16,
                     session_len=4096)


def client_of(servers, family):
    import openai

    return openai.OpenAI(base_url=f"{servers[family].url}/v1", api_key="none", max_retries=0, timeout=120)


def reassemble(chunks) -> tuple[str, list[dict], str | None, str]:
    """(content, calls as {id, name, arguments}, finish_reason, reasoning) of a streamed chat completion."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call has its id, type and name, once
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


class HealthPoller:
    """Polls GET /health on a thread until stopped; keeps (latency_s, status) of every probe."""

    def __init__(self, url: str, interval_s: float = 0.01):
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    status = http.get(f"{self.url}/health").status_code
                except httpx.HTTPError:
                    status = -1
                self.samples.append((time.perf_counter() - started, status))
                time.sleep(self.interval_s)

    def __enter__(self) -> "HealthPoller":
        # A served process freezes its startup heap (serve_app); this one holds every test's objects, and a full
        # collection of a pytest worker stops the server threads in it for 0.4-0.8 s: frozen while probing.
        gc.collect()
        gc.freeze()
        self._thread.start()
        deadline = time.monotonic() + 10
        while len(self.samples) < 3:
            if time.monotonic() > deadline:
                self._stop.set()
                gc.unfreeze()
                raise AssertionError("/health did not answer before the load started")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # a few probes after the load
        self._stop.set()
        self._thread.join(timeout=15)
        gc.unfreeze()

    def check(self, label: str, limit_s: float = 1.0) -> None:
        """Every probe answered 200, the slowest within ``limit_s`` (generous for a loaded 2-core machine)."""
        latencies = sorted(s for s, _ in self.samples)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"\n{label}: {len(latencies)} /health probes, p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
        assert all(status == 200 for _, status in self.samples), [st for _, st in self.samples if st != 200]
        assert latencies[-1] < limit_s, f"/health took {latencies[-1]:.2f} s under load (p99 {p99:.3f} s)"
