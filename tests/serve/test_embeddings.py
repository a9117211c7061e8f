"""/v1/embeddings through the openai client (texts and token ids, float and base64, dimensions), equal to the
engine's own vectors and to HF's fp64 pooling; /tokenize and /detokenize; bad inputs as 400s naming the field;
a client that leaves cancels its inputs; the proxy routes embeddings."""

from __future__ import annotations

import base64
import copy
import time

import httpx
import numpy as np
import pytest
import torch

from tests.serve.harness import ServerThread


def test_embeddings_equal_the_engine_and_hf(client, tiny_engine, tiny_llama):
    texts = ["first text", "the second one is longer " * 8]
    r = client.embeddings.create(model="tiny", input=texts)
    assert r.object == "list" and r.model == "tiny" and [d.index for d in r.data] == [0, 1]
    engine = tiny_engine.engine
    ids = [engine.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    expected = engine.embed(texts)
    ref = copy.deepcopy(tiny_llama[1].model).to(torch.float64)  # the session's reference stays fp32
    for d, want, prompt_ids in zip(r.data, expected, ids):
        got = np.array(d.embedding, dtype=np.float32)
        assert np.array_equal(got, want)  # JSON floats round trip float32 exactly
        with torch.no_grad():
            h = ref(torch.tensor([prompt_ids])).last_hidden_state[0, -1].numpy()
        assert np.abs(got - h / np.linalg.norm(h)).max() < 2e-5  # last token, normalized: no ST files
    by_ids = client.embeddings.create(model="tiny", input=ids)
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in r.data]
    one = client.embeddings.create(model="tiny", input=ids[0])
    assert one.data[0].embedding == r.data[0].embedding


def test_more_inputs_than_the_server_admits_go_through_in_turn(api_server, tiny_engine):
    """150 inputs on a server that admits 64 sequences (max_batch_size 32 + 32 waiting): they go into the engine
    32 at a time, and each vector is what it is alone."""
    texts = [f"text number {i}" for i in range(150)]
    r = httpx.post(f"{api_server.url}/v1/embeddings", json={"model": "tiny", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(150))
    for i in (0, 77, 149):
        assert np.array_equal(np.array(data[i]["embedding"], np.float32), tiny_engine.engine.embed([texts[i]])[0])


def test_base64_and_dimensions(api_server):
    body = {"model": "tiny", "input": "encode me"}
    plain = httpx.post(f"{api_server.url}/v1/embeddings", json=body, timeout=30).json()["data"][0]["embedding"]
    packed = httpx.post(f"{api_server.url}/v1/embeddings", json={**body, "encoding_format": "base64"},
                        timeout=30).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == plain
    short = httpx.post(f"{api_server.url}/v1/embeddings", json={**body, "dimensions": 16},
                       timeout=30).json()["data"][0]["embedding"]
    head = np.array(plain[:16])
    assert len(short) == 16 and np.allclose(short, head / np.linalg.norm(head), atol=1e-6)


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "empty"),
    ({"input": ["ok", ""]}, "input", "input 1 is empty"),
    ({"input": [[1, 2], [999999]]}, "input", "outside the vocabulary"),
    ({"input": "x" * 40000}, "input", "maximum context length"),
    ({"input": "x", "dimensions": 100000}, "dimensions", "at most"),
    ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "float"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "pooling": "max"}, "pooling", "Unrecognized"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(api_server, tiny_engine, body, param, words):
    r = httpx.post(f"{api_server.url}/v1/embeddings", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    m = tiny_engine.engine.metrics()
    assert m.num_running == m.num_waiting == 0


def test_tokenize_and_detokenize(api_server, tiny_engine):
    engine = tiny_engine.engine
    r = httpx.post(f"{api_server.url}/tokenize", json={"model": "tiny", "prompt": "hello there"}, timeout=30).json()
    assert r["tokens"] == engine.encode("hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.session_len
    bare = httpx.post(f"{api_server.url}/tokenize", json={"prompt": "hello", "add_special_tokens": False},
                      timeout=30).json()
    assert bare["tokens"] == engine.tokenizer.encode("hello", add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{api_server.url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert chat["tokens"] == engine.encode(messages)
    text = httpx.post(f"{api_server.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()["prompt"]
    assert text == engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages},
                                                              "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "nope"}, "model")):
        bad = httpx.post(f"{api_server.url}{path}", json=body, timeout=30)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text


def test_client_that_leaves_cancels_its_inputs(slow_server):
    """A client that disconnects while its 16 long inputs are computed: the rest are cancelled, every block
    free after."""
    server, engine = slow_server
    before = engine.metrics().num_prompt_tokens
    body = {"model": "tiny", "input": [[5] * 480] * 16}  # two steps at least: 8 sequences a step
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=0.3)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = engine.metrics()
        if m.num_running == m.num_waiting == 0 and m.num_free_blocks == engine.num_total_blocks:
            break
        time.sleep(0.05)
    m = engine.metrics()
    assert m.num_running == m.num_waiting == 0 and m.num_free_blocks == engine.num_total_blocks
    assert 0 < m.num_prompt_tokens - before < 16 * 480  # cancelled part way


def test_proxy_routes_embeddings(api_server):
    from lmkit.serve.proxy import ProxyConfig, create_proxy_app

    proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(api_server.url,), health_interval_s=0.2)))
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not httpx.get(f"{proxy.url}/v1/models", timeout=5).json()["data"]:
            time.sleep(0.1)
        body = {"model": "tiny", "input": "through the proxy"}
        via = httpx.post(f"{proxy.url}/v1/embeddings", json=body, timeout=30)
        direct = httpx.post(f"{api_server.url}/v1/embeddings", json=body, timeout=30)
        assert via.status_code == 200 and via.json()["data"] == direct.json()["data"]
    finally:
        proxy.stop()
