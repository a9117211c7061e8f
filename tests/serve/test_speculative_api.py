"""Speculative decoding through the OpenAI API: a chat completion with OpenAI's `prediction` (Predicted Outputs)
answers as one without it, its drafts are verified and counted in /metrics per proposer; `speculative: false`
opts out; a malformed prediction is a 400 naming it; a Qwen3.5 model's MTP head drafts behind the server too."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.harness import ServerThread


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    """The bundled model speculating (fp32: the same tokens with and without drafts), whose answers are text a
    prediction can give back (a random byte model's are not valid UTF-8)."""
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app

    engine = AsyncEngine(smollm2_path, EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64,
                                                    max_batch_size=4, session_len=1024, speculative="ngram",
                                                    # every proposal verified: adaptive drafts follow step
                                                    # times, and under load may verify none (a flaky count)
                                                    speculative_adaptive=False))
    server = ServerThread(create_app(engine, ServerConfig(model_name="smollm2")))
    yield server
    server.stop()
    engine.close()


def chat(url: str, **extra) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "List the days of the week, one a line."}],
            "max_tokens": 48, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def spec_counters(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("lmkit_spec_") and "{" in line:
            name, rest = line.split("{", 1)
            label, value = rest.split("}")
            out[(name.removesuffix("_total"), label.split('"')[1])] = float(value)
    return out


@pytest.mark.slow
def test_prediction_gives_the_same_answer_and_is_counted(smollm2_server):
    url = smollm2_server.url
    plain = chat(url, speculative=False)["choices"][0]["message"]["content"]
    before = spec_counters(url)
    # the prediction: the answer itself with a word changed (kept, rejected, kept again)
    predicted = plain[:20] + " Someday " + plain[20:]
    answer = chat(url, prediction={"type": "content", "content": [{"type": "text", "text": predicted}]})
    assert answer["choices"][0]["message"]["content"] == plain
    after = spec_counters(url)
    key = ("lmkit_spec_accepted_tokens", "prediction")
    assert after[key] > before.get(key, 0), (before, after)
    assert {proposer for _, proposer in after} == {"prediction", "ngram", "suffix", "mtp", "draft"}


def test_malformed_prediction_is_a_400(api_server):
    for bad in ({"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": 5}):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prediction": bad}
        r = httpx.post(f"{api_server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert "prediction" in r.json()["error"]["message"] or r.json()["error"].get("param", "").startswith("prediction")
    r = httpx.post(f"{api_server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "speculative": "yes"},
                   timeout=30)
    assert r.status_code == 400


def test_mtp_head_drafts_behind_the_server(tmp_path):
    """A tiny Qwen3.5 with an MTP head served with speculative='mtp': a greedy completion answers as the server
    without speculation does, and /metrics counts the head's verifications (proposer mtp)."""
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app
    from tests.factories import QWEN3_5, TOKEN_IDS, add_mtp_head, write_qwen3_5_multimodal

    write_qwen3_5_multimodal(tmp_path, "Qwen3_5Config", dict(QWEN3_5, num_hidden_layers=4, max_position_embeddings=512,
                                                             **TOKEN_IDS), seed=90)
    add_mtp_head(tmp_path, 91)
    body = {"model": "q", "prompt": [5, 17, 99, 3, 42, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = {}
    for spec in ("off", "mtp"):
        engine = AsyncEngine(tmp_path, EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=32,
                                                    session_len=256, speculative=spec, speculative_adaptive=False))
        server = ServerThread(create_app(engine, ServerConfig(model_name="q")))
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts[spec] = r.json()["choices"][0]["text"]
            counters = spec_counters(server.url)
        finally:
            server.stop()
            engine.close()
    assert texts["mtp"] == texts["off"]
    assert counters[("lmkit_spec_verifications", "mtp")] > 0, counters
