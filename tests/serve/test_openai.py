"""The api_server through the official `openai` client: chat and text completions, streamed and not, n > 1,
logprobs, usage, stop strings, and outputs equal to the engine's own (greedy)."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from lmkit import GenerationConfig


def engine_text(tiny_llama_pipe, prompt, max_new_tokens) -> str:
    return tiny_llama_pipe(prompt, GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)).text


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "lmkit"


def test_chat_completion_matches_engine(client, tiny_llama_pipe):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == engine_text(tiny_llama_pipe, messages, 12)
    prompt_len = len(tiny_llama_pipe.encode(messages))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 12, prompt_len + 12)


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "tell me"}], max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_and_not(client, tiny_llama_pipe):
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.choices[0].text == engine_text(tiny_llama_pipe, "abc", 10)
    assert full.usage.completion_tokens == 10
    parts = list(client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model="tiny", prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completion_batch_of_prompts_and_n(client, tiny_llama_pipe):
    r = client.completions.create(model="tiny", prompt=["ab", "xyz"], n=2, max_tokens=6, temperature=0.8,
                                  seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == len(tiny_llama_pipe.encode("ab")) + len(tiny_llama_pipe.encode("xyz")) and r.usage.completion_tokens == 24
    again = client.completions.create(model="tiny", prompt=["ab", "xyz"], n=2, max_tokens=6,
                                      temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # a seed gives the same sample


def test_chat_n_streamed(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3,
                                            max_tokens=5, temperature=1.0, stream=True,
                                            extra_body={"ignore_eos": True})
    texts, finishes = {}, {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token and math.isclose(item.top_logprobs[0].logprob, item.logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True})
    tokens = [i.token for c in streamed for ch in c.choices if ch.logprobs for i in ch.logprobs.content]
    assert tokens == [i.token for i in content]


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_stop_string_and_echo(client):
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    assert stop
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.index(stop)]
    echo = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("abc")


def test_raw_sse_format(api_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{api_server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_health_and_metrics(api_server, client):
    assert httpx.get(f"{api_server.url}/health").status_code == 200
    client.completions.create(model="tiny", prompt="ab", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(f"{api_server.url}/metrics").text
    for name in ("lmkit_requests_total", "lmkit_time_to_first_token_seconds_bucket",
                 "lmkit_time_per_output_token_seconds_bucket", "lmkit_num_requests_running",
                 "lmkit_num_requests_waiting", "lmkit_kv_cache_usage_ratio", "lmkit_prefix_cache_hit_rate",
                 "lmkit_generation_tokens_total", 'lmkit_http_responses_total{path="/v1/completions",status="200"}'):
        assert name in text, name
    read = [line for line in text.splitlines() if line.startswith("lmkit_weight_bytes_read_total ")]
    assert len(read) == 1 and float(read[0].split()[1]) > 0, read  # the steps so far read some weights


def test_gateway_metrics_follow_the_engine(slow_engine):
    """The model-server protocol's gauges, under the names the inference gateway's endpoint picker reads,
    parsed as Prometheus text, carry the engine's own values while a stream runs and after."""
    from prometheus_client.parser import text_string_to_metric_families

    from lmkit.serve import ServerConfig, create_app
    from tests.serve.harness import ServerThread

    server = ServerThread(create_app(slow_engine, ServerConfig(model_name="slow")))

    def scrape() -> dict[str, list]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    try:
        body = {"model": "slow", "prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines), next(lines)  # tokens are flowing
            families = scrape()
            engine = slow_engine.engine.metrics()
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc"):
            (sample,) = families[name]
            assert sample.labels == {"model_name": "slow"}, sample
        assert families["vllm:num_requests_running"][0].value == 1 == engine.num_running
        assert families["vllm:num_requests_waiting"][0].value == 0
        usage = families["vllm:kv_cache_usage_perc"][0].value
        assert 0 < usage < 1 and usage == families["vllm:gpu_cache_usage_perc"][0].value
        (info,) = families["vllm:cache_config_info"]
        assert info.labels["block_size"] == str(slow_engine.engine.config.cache_block_seq_len)
        assert int(info.labels["num_gpu_blocks"]) == engine.num_total_blocks
        deadline = time.monotonic() + 10  # the stream's engine request is cancelled when its client leaves
        while (idle := scrape())["vllm:num_requests_running"][0].value != 0:
            assert time.monotonic() < deadline, idle
            time.sleep(0.05)
        assert idle["vllm:kv_cache_usage_perc"][0].value == 0
    finally:
        server.stop()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_fields_accepted(client, temperature):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "q"}], max_completion_tokens=4, temperature=temperature,
        top_p=0.9, seed=1, presence_penalty=0.5, frequency_penalty=0.5, stop=["zzz"], user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2})
    assert r.usage.completion_tokens == 4


def test_request_without_sampling_is_greedy_for_a_model_that_sets_none(client, tiny_llama_pipe):
    """One rule for the server, the CLI and pipeline(): a model whose files ask for no sampling answers greedily
    when a request sets no sampling field, whatever its seed."""
    messages = [{"role": "user", "content": "say something"}]
    answers = {client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
               for seed in (1, 2, 3)}
    assert answers == {engine_text(tiny_llama_pipe, messages, 12)}


def test_request_fields_left_out_take_the_models_generation_config(tmp_path):
    """As vLLM's --generation-config auto: a model whose generation_config.json samples (temperature 0.7,
    top_k 5) and caps answers at 6 tokens gets those for a request that leaves the fields out, exactly what
    the same seed gives through the pipeline; given fields still win."""
    import json

    from lmkit import AsyncEngine, EngineConfig, Pipeline
    from lmkit.serve import ServerConfig, create_app
    from tests.factories import make_tiny_model
    from tests.serve.harness import TINY_ENGINE, ServerThread

    folder = tmp_path / "sampling-model"
    make_tiny_model(folder, "llama", seed=7)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 256, "eos_token_id": 257, "do_sample": True, "temperature": 0.7, "top_k": 5,
         "max_new_tokens": 6}))
    engine = AsyncEngine(folder, EngineConfig(**TINY_ENGINE))
    server = ServerThread(create_app(engine, ServerConfig(model_name="tiny")))
    try:
        messages = [{"role": "user", "content": "hello there"}]
        body = {"model": "tiny", "messages": messages, "seed": 3, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 6, r
        ids = engine.engine.encode(messages)
        expected = engine.engine.default_generation_config(random_seed=3, ignore_eos=True)
        assert (expected.do_sample, expected.temperature, expected.top_k) == (True, 0.7, 5)
        with Pipeline(engine) as pipe:
            assert r["choices"][0]["message"]["content"] == pipe(ids, expected).text
            greedy = pipe(ids, GenerationConfig(max_new_tokens=6, ignore_eos=True)).text
            r0 = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temperature": 0}, timeout=60).json()
            assert r0["choices"][0]["message"]["content"] == greedy
    finally:
        server.stop()
        engine.close()
