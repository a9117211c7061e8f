"""Bad requests get OpenAI's status and error body naming the problem, and the server keeps serving:
malformed JSON, wrong types, unknown fields, impossible values, context overflow, unknown model, API keys,
oversized bodies, too many requests at once. Pydantic's validation errors are 400, never 422."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tests.serve.conftest import ServerThread

KEY = "sk-test"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def guarded(tiny_engine):
    """The tiny model with an API key, a 64 KiB body limit and at most 2 generation requests at once."""
    from lmkit.serve import GateConfig, ServerConfig, create_app

    gate = GateConfig(api_keys=(KEY,), max_body_bytes=64 * 1024, max_concurrent_requests=2)
    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", gate=gate)))
    yield server
    server.stop()


def post(server, path, body=None, *, content=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30, **kw)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *, param=..., match: str = "", code=...) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    assert match.lower() in error["message"].lower(), error
    return error


def assert_still_serves(server) -> None:
    r = post(server, "/v1/chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body, param, match", [
    ({**CHAT, "temperature": "hot"}, "temperature", "valid number"),
    ({**CHAT, "max_tokens": "10"}, "max_tokens", "valid integer"),
    ({**CHAT, "messages": "hello"}, "messages", "valid list"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "role"),
    ({**CHAT, "stream": "yes"}, "stream", "boolean"),
    ({**CHAT, "foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "max_tokens": 10**9}, "max_tokens", "maximum context length is 512"),
    ({**CHAT, "messages": []}, "messages", "at least 1"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 600}]}, "messages", "maximum context length is 512"),
    ({**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({**CHAT, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream'"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({**CHAT, "min_tokens": 10}, "min_tokens", "must not exceed"),
    ({k: v for k, v in CHAT.items() if k != "model"}, "model", "Missing required parameter"),
])
def test_bad_chat_requests(guarded, body, param, match):
    assert_error(post(guarded, "/v1/chat/completions", body), 400, param=param, match=match)


@pytest.mark.parametrize("body, param, match", [
    ({"model": "tiny", "prompt": ""}, "prompt", "empty"),
    ({"model": "tiny", "prompt": []}, "prompt", "empty"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, "prompt", "outside the vocabulary"),
    ({"model": "tiny", "prompt": "a" * 600}, "prompt", "maximum context length"),
    ({"model": "tiny", "prompt": "ab", "logprobs": 50}, "logprobs", "less than or equal to 20"),
    ({"model": "tiny", "prompt": "ab", "suffix": "x"}, "suffix", "not supported"),
])
def test_bad_completion_requests(guarded, body, param, match):
    assert_error(post(guarded, "/v1/completions", body), 400, param=param, match=match)


def test_malformed_json(guarded):
    assert_error(post(guarded, "/v1/chat/completions", content=b'{"model": "tiny", "messages": ['), 400,
                 match="parse the JSON")
    assert_error(post(guarded, "/v1/chat/completions", content=b"[1, 2]"), 400)
    assert_error(post(guarded, "/v1/chat/completions", content=b""), 400)
    assert_still_serves(guarded)


def test_unknown_model_is_404(guarded):
    assert_error(post(guarded, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404, param="model",
                 code="model_not_found", match="gpt-9")
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_api_keys(guarded):
    assert_error(post(guarded, "/v1/chat/completions", CHAT, key=None), 401, code="invalid_api_key")
    assert_error(post(guarded, "/v1/chat/completions", CHAT, key="wrong"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{guarded.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no key
    assert_still_serves(guarded)


def test_oversized_body_is_413(guarded):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert_error(post(guarded, "/v1/chat/completions", big), 413, match="larger than the limit")

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    assert_error(post(guarded, "/v1/chat/completions", content=chunked()), 413)
    assert_still_serves(guarded)


def stalled_stream(server, body: dict) -> socket.socket:
    """A streaming request whose client reads nothing with a tiny receive window: the server's send blocks,
    so the request stays in flight until the socket closes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_too_many_concurrent_requests_is_429(guarded, tiny_engine):
    # 8 completions with top-20 logprobs: ~6 MB of chunks, more than the socket buffers hold
    long = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20,
            "n": 8}
    socks = [stalled_stream(guarded, long) for _ in range(2)]
    try:
        deadline = time.monotonic() + 20
        while (r := post(guarded, "/v1/chat/completions", CHAT)).status_code != 429:
            assert time.monotonic() < deadline, "two stalled streams never filled the limit of 2"
            time.sleep(0.05)
        assert_error(r, 429, code="rate_limit_exceeded")
        assert r.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(**CHAT)
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while post(guarded, "/v1/chat/completions", CHAT).status_code == 429:
        assert time.monotonic() < deadline, "slots not given back after the clients left"
        time.sleep(0.05)
    assert_still_serves(guarded)


def test_unknown_route_and_method(guarded):
    assert_error(httpx.get(f"{guarded.url}/v2/nothing"), 404, match="Invalid URL")
    assert_error(httpx.get(f"{guarded.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)
