"""The serving path on a mixture-of-experts model (issue 23: it works unchanged): a tiny Qwen3-MoE with int8 KV
and prefix caching behind the OpenAI server; a completion equals the engine's own greedy output, streamed
and not, and a client that disconnects mid-stream leaves no KV block held."""

from __future__ import annotations

import json
import time

import httpx

from tests.serve.harness import ServerThread


def test_moe_model_serves_and_releases_its_blocks(tmp_path):
    from lmkit import AsyncEngine, EngineConfig, GenerationConfig, pipeline
    from lmkit.serve import ServerConfig, create_app
    from tests.factories import make_moe_model

    make_moe_model(tmp_path, "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     intermediate_size=128))

    engine = AsyncEngine(tmp_path, EngineConfig(device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                                                 session_len=512, num_threads=1, quant_policy=8,
                                                 enable_prefix_caching=True))
    server = ServerThread(create_app(engine, ServerConfig(model_name="moe")))
    try:
        prompt = "The experts of a sparse layer "
        body = {"model": "moe", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        text = plain["choices"][0]["text"]
        assert plain["usage"]["completion_tokens"] == 12, plain
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"]
                               for line in r.iter_lines() if line.startswith("data: {"))
        assert streamed == text
        with pipeline(tmp_path, EngineConfig(device="cpu", cache_max_entry_count=64, quant_policy=8)) as pipe:
            assert pipe(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).text == text

        # a long stream dropped after its first chunk: its request ends and its blocks come back
        long = {**body, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        deadline = time.monotonic() + 30
        while engine.metrics().num_running + engine.metrics().num_waiting:
            assert time.monotonic() < deadline, engine.metrics()
            time.sleep(0.05)
        m = engine.metrics()
        assert m.num_active_blocks == 0 and m.num_free_blocks + m.num_cached_blocks == m.num_total_blocks, m
    finally:
        server.stop()
        engine.close()
