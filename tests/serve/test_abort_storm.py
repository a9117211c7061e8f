"""Abort storm: 500 streaming requests, each dropped by its client at a random point (before the first
byte, mid-stream, or never). Afterwards no KV block, batch slot or concurrency slot is held, the engine's
bookkeeping is exact, and the server still answers correctly."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from lmkit import GenerationConfig
from tests.helpers import assert_blocks_free
from tests.serve.harness import ServerThread, generating, leave_long_completion, wait_idle


@pytest.fixture(scope="module")
def storm_server(tiny_engine):
    from lmkit.serve import GateConfig, ServerConfig, create_app

    # room for every storm request at once: this test is about aborts, not admission (tests/serve/test_limits.py)
    app = create_app(tiny_engine, ServerConfig(model_name="tiny", gate=GateConfig(max_concurrent_requests=1000),
                                               max_waiting_seqs=1000))
    server = ServerThread(app)
    yield server, app
    server.stop()


async def storm(url: str, num_requests: int, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(i: int) -> None:
            chat = rng.random() < 0.5
            body = {"model": "tiny", "max_tokens": rng.randint(16, 96), "ignore_eos": True, "stream": True,
                    "n": rng.choice([1, 1, 1, 2])}
            body.update({"messages": [{"role": "user", "content": f"q{i}"}]} if chat else {"prompt": f"p{i}"})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            stop_after = rng.choice([0, 1, 2, 5, 20, 10**9])  # chunks to read before hanging up
            async with sem:
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    seen = 0
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if seen >= stop_after:
                            break
                        seen += 1
                    key = "completed" if stop_after == 10**9 else "aborted"
                    outcomes[key] = outcomes.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(num_requests)))
    return outcomes


@pytest.mark.slow
def test_abort_storm_leaks_nothing(storm_server, tiny_engine, tiny_llama_pipe):
    server, app = storm_server
    started = time.monotonic()
    outcomes = asyncio.run(storm(server.url, 500, concurrency=48, seed=7))
    assert outcomes["aborted"] > 300 and outcomes["completed"] > 50, outcomes
    engine = tiny_engine.engine
    deadline = time.monotonic() + 10
    while engine.metrics().num_running + engine.metrics().num_waiting or app.num_in_flight:
        assert time.monotonic() < deadline, (f"still busy after the storm: {engine.metrics()}, "
                                             f"{app.num_in_flight} HTTP requests in flight")
        time.sleep(0.01)
    assert_blocks_free(engine)
    # still answers, and correctly
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    expected = tiny_llama_pipe("check", gen).text
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "check", "max_tokens": 12,
                                                         "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_engine_request_at_once(slow_server, stream):
    server, engine = slow_server
    before = engine.metrics().num_generated_tokens
    leave_long_completion(server.url, stream, started=generating(engine))
    wait_idle(engine=engine)
    generated = engine.metrics().num_generated_tokens - before
    assert generated < 4 * 480 / 4, f"{generated} tokens generated after the client left"
