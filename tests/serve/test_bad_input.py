"""Bad requests get OpenAI's status and error body naming the problem, and the server keeps serving:
malformed JSON, wrong types, unknown fields, impossible values, context overflow, unknown model, API keys,
oversized bodies, too many requests at once. Pydantic's validation errors are 400, never 422."""

from __future__ import annotations

import json
import logging
import re
import socket
import time

import httpx
import openai
import pytest

from tests.serve.harness import ServerThread

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


def assert_healthy(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert_still_serves(server)


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


# Each was a 500 with pybind or engine internals in its message ("TypeError: incompatible function arguments ...
# lmkit._engine.SamplingParams", "OverflowError"), a 400 naming no parameter, or a message hiding the limit.
@pytest.mark.parametrize("path, body, param, match", [
    ("/v1/chat/completions", {**CHAT, "top_k": 2**31}, "top_k", "[0, 2147483647]"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**32]}, "stop_token_ids", "[0, 2147483647]"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [5, 300]}, "stop_token_ids", "vocabulary [0, 300)"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [1] * 2000}, "stop_token_ids", "at most 1024"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e308}, "repetition_penalty", "float32"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1e-50}, "top_p", "as a float32: 0.0"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 1000}, "stop", "at most 16"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", ""]}, "stop", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b" * 1025]}, "stop[1]", "at most 1024 characters"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed", "less than 18446744073709551616"),
    ("/v1/chat/completions", {**CHAT, "seed": -2**63 - 1}, "seed", "greater than or equal to -9223372036854775808"),
    ("/v1/chat/completions", {**CHAT, "n": 64}, "n", "max_batch_size (32)"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, -1]}, "prompt", "token id -1 outside the vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 300]}, "prompt", "token id 300 outside the vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], [3, -1]], "echo": True}, "prompt", "outside the vocab"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1]] * 3000}, "prompt", "at most 2048"),
])
def test_what_the_engine_cannot_take_is_a_400_naming_the_parameter(guarded, path, body, param, match):
    assert_error(post(guarded, path, body), 400, param=param, match=match)
    assert_healthy(guarded)


def test_too_many_messages_is_a_400_before_validation(api_server):
    many = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 5000}] * 2}
    assert_error(post(api_server, "/v1/chat/completions", many), 400, param="messages", match="at most 8192")
    assert_healthy(api_server)


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", rb'{"model": "tiny", "prompt": ["ok", "\udfff"]}', "prompt[1]"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": '
                             rb'[{"type": "text", "text": "\udc00"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}',
     "messages[0].name"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             rb'"stop": ["x", "\ud800"]}', "stop[1]"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": "\udbff"}',
     "stop"),
    ("/v1/chat/completions", rb'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
])
def test_lone_surrogates_are_400s(guarded, path, raw, param):
    """JSON can escape half a UTF-16 pair; no tokenizer or UTF-8 encoder takes one (it was a 500). A whole pair
    is one character."""
    assert_error(post(guarded, path, content=raw), 400, param=param, match="lone surrogate")
    assert_healthy(guarded)
    pair = rb'{"model": "tiny", "messages": [{"role": "user", "content": "smile \ud83d\ude00"}], "max_tokens": 2}'
    assert post(guarded, "/v1/chat/completions", content=pair).status_code == 200


def test_json_infinity_is_a_400_naming_the_parameter(guarded):
    """1e999 parses as inf: refused by name (it was "got inf" with param null)."""
    raw = b'{"model": "tiny", "prompt": "ab", "max_tokens": 2, "repetition_penalty": 1e999}'
    assert_error(post(guarded, "/v1/completions", content=raw), 400, param="repetition_penalty", match="finite")
    assert_healthy(guarded)


def test_a_bug_is_a_500_with_an_error_id_and_no_internals(caplog):
    from fastapi import FastAPI

    from lmkit.serve.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug():
        raise TypeError("incompatible function arguments: lmkit._engine internals")

    server = ServerThread(app)
    try:
        with caplog.at_level(logging.ERROR, logger="lmkit.serve"):
            r = httpx.get(f"{server.url}/bug", timeout=10)
    finally:
        server.stop()
    error = assert_error(r, 500, param=None)
    assert "TypeError" not in error["message"] and "lmkit._engine" not in error["message"], error
    error_id = re.search(r"error id ([0-9a-f]+)", error["message"]).group(1)
    logged = [rec for rec in caplog.records if rec.name == "lmkit.serve" and error_id in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info[0] is TypeError, caplog.text


def test_malformed_json(guarded):
    assert_error(post(guarded, "/v1/chat/completions", content=b'{"model": "tiny", "messages": ['), 400,
                 match="parse the JSON")
    error = assert_error(post(guarded, "/v1/chat/completions", content=b"[1, 2]"), 400, code="invalid_type",
                         match="must be a JSON object (got [1, 2])")
    assert "Content-Type" not in error["message"], error  # it was sent as JSON
    assert_error(post(guarded, "/v1/chat/completions", content=b""), 400)
    assert_still_serves(guarded)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_that_is_not_sent_as_json_names_its_content_type(guarded, content_type):
    """curl -d sends form encoding unless told otherwise: the answer names the header to send."""
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers,
                   timeout=30)
    error = assert_error(r, 400, code="invalid_content_type", match="Content-Type: application/json")
    assert (content_type or "no Content-Type header") in error["message"], error
    assert_still_serves(guarded)


def test_unknown_model_is_404(guarded):
    assert_error(post(guarded, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404, param="model",
                 code="model_not_found", match="gpt-9")
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_api_keys(guarded):
    for key in (None, "wrong"):
        r = post(guarded, "/v1/chat/completions", CHAT, key=key)
        assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"].startswith("Bearer "), r.headers  # RFC 6750's challenge
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
    # with keys set every path but /health needs one: a caller without a key cannot map the routes
    assert_error(httpx.get(f"{guarded.url}/v2/nothing"), 401)
    assert_error(httpx.get(f"{guarded.url}/v2/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404,
                 match="Invalid URL")
    assert_error(httpx.get(f"{guarded.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)
