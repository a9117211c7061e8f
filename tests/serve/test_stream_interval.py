"""--stream-interval (ServerConfig.stream_interval): a streamed completion sends its first token at once, then
chunks of N tokens, and its end at once; the text is the same as one token per chunk and as the whole
answer; a client that leaves mid-stream still frees its engine request and KV blocks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from lmkit.messages import Response
from tests.serve.harness import ServerThread


@pytest.fixture(scope="module")
def chunked_server(tiny_engine):
    """The tiny model as `tiny`, 4 tokens per streamed chunk."""
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", stream_interval=4)))
    yield server
    server.stop()


def sse_chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_chunks_hold_the_interval_and_the_same_text(chunked_server, api_server):
    """n=2, 11 tokens each: per completion the first chunk carries 1 token, the others at least 4 (a speculative
    step may deliver several tokens at once) but the last (with its finish_reason); the texts and logprobs equal
    the stream without an interval's and the whole answer's."""
    body = {"model": "tiny", "prompt": "once upon", "max_tokens": 11, "n": 2, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    chunked = sse_chunks(chunked_server.url, "/v1/completions", body)
    single = sse_chunks(api_server.url, "/v1/completions", body)
    whole = httpx.post(f"{chunked_server.url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    for index in range(2):
        mine = [c["choices"][0] for c in chunked if c["choices"] and c["choices"][0]["index"] == index]
        sizes = [len(c["logprobs"]["tokens"]) for c in mine if c["logprobs"]]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 11, sizes
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        ones = [c["choices"][0] for c in single if c["choices"] and c["choices"][0]["index"] == index]
        assert sum(len(c["logprobs"]["tokens"]) for c in ones if c["logprobs"]) == 11
        text = "".join(c["text"] for c in mine)
        assert text == "".join(c["text"] for c in ones) == whole["choices"][index]["text"]
        logprobs = [lp for c in mine for lp in c["logprobs"]["token_logprobs"]]
        assert logprobs == pytest.approx(whole["choices"][index]["logprobs"]["token_logprobs"], abs=1e-5)


def test_chat_stream_usage_counts_the_interval(chunked_server):
    """A chat stream with logprobs and continuous usage: its chunks carry 1, then at least 4 each, then the rest
    (the random model's bytes are no text until the end: the logprobs show each chunk's tokens), and the usage of
    each chunk counts the tokens sent so far."""
    import openai

    client = openai.OpenAI(base_url=f"{chunked_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=14, temperature=0,
                   logprobs=True, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_tokens = [c for c in chunks if c.choices and c.choices[0].logprobs]
    sizes = [len(c.choices[0].logprobs.content) for c in with_tokens]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 14, sizes
    assert [c.usage.completion_tokens for c in with_tokens] == [sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 14
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = [t.token for c in with_tokens for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]


def test_leaving_a_chunked_stream_frees_the_engine(slow_engine):
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(slow_engine, ServerConfig(model_name="slow", stream_interval=8)))
    engine = slow_engine.engine
    try:
        body = {"model": "slow", "prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first, second = json.loads(next(lines)[6:]), json.loads(next(lines)[6:])
            assert first["choices"][0]["text"] and second["choices"][0]["text"]
            assert engine.metrics().num_running == 1
        deadline = time.monotonic() + 10
        while (m := engine.metrics()).num_running or m.num_free_blocks + m.num_cached_blocks != m.num_total_blocks:
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
    finally:
        server.stop()


def test_in_chunks_of_merges_per_completion_and_closes_its_source():
    """Two completions interleaved, one token per delta: each is merged on its own (text, ids, logprobs and
    the later counts); the first token and the finishing delta pass at once, what is held when the source
    ends comes last; closing early closes the source."""
    from lmkit.serve.stream import in_chunks_of

    def delta(sample: int, token: int, finish: str | None = None) -> Response:
        return Response(f"<{sample}:{token}>", [token], 3, token + 1, finish, sample_index=sample,
                        logprobs=[{token: -0.5}])

    closed = []

    async def source():
        try:
            for token in range(6):
                yield delta(0, token)
                if token < 3:
                    yield delta(1, token, "stop" if token == 2 else None)
        finally:
            closed.append(True)

    async def run(limit: int | None):
        got = []
        chunks = in_chunks_of(3, source())
        async for r in chunks:
            got.append(r)
            if len(got) == limit:
                await chunks.aclose()
                break
        return got

    got = asyncio.run(run(None))
    zero = [r for r in got if r.sample_index == 0]
    assert [r.token_ids for r in zero] == [[0], [1, 2, 3], [4, 5]]  # 4, 5: held until the source ended
    assert zero[1].text == "<0:1><0:2><0:3>" and zero[1].generate_token_len == 4
    assert zero[1].logprobs == [{1: -0.5}, {2: -0.5}, {3: -0.5}]
    one = [r for r in got if r.sample_index == 1]
    assert [(r.token_ids, r.finish_reason) for r in one] == [([0], None), ([1, 2], "stop")]
    assert closed == [True]
    closed.clear()
    assert len(asyncio.run(run(1))) == 1 and closed == [True]


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_impossible_stream_interval_is_refused(bad):
    from typer.testing import CliRunner

    from lmkit.cli.main import app
    from lmkit.serve import ServerConfig

    with pytest.raises(ValueError, match="stream_interval"):
        ServerConfig(stream_interval=bad)
    if isinstance(bad, int):
        result = CliRunner().invoke(app, ["serve", "api_server", "--stream-interval", str(bad)])
        assert result.exit_code == 2 and "--stream-interval" in result.output, result.output
