"""Prompt logprobs through the server: /v1/completions with echo + logprobs (OpenAI's legacy format, the prompt's
tokens first with a null for the first one), max_tokens 0 with echo, vLLM's prompt_logprobs on completions and
chat; values against HF transformers' fp32 log_softmax of the same tokens; streamed == whole; bad input a 400."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from tests.helpers import assert_blocks_free, random_prompts
from tests.serve.harness import HealthPoller


def hf_rows(tiny_llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(tiny_llama[1](torch.tensor([ids])).logits[0].double(), dim=-1).numpy()


def check_echo(choice: dict, prompt: list[int], rows: np.ndarray, num_new: int) -> None:
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + num_new
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    for p in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][p] - rows[p - 1, prompt[p]]) <= 1e-4, p
        assert abs(max(lp["top_logprobs"][p].values()) - rows[p - 1].max()) <= 1e-4, p
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_match_hf(client, tiny_llama, tiny_engine):
    batch = random_prompts(1, (9, 33))
    r = client.completions.create(model="tiny", prompt=batch, max_tokens=1, logprobs=1, echo=True, temperature=0,
                                  seed=1234)
    for choice in r.choices:
        prompt = batch[choice.index]
        check_echo(choice.model_dump(), prompt, hf_rows(tiny_llama, prompt), 1)
        # lm-eval's reading: the continuation's logprobs and whether it is the greedy one
        last = choice.logprobs
        assert last.token_logprobs[-1] == max(last.top_logprobs[-1].values())  # temperature 0 took the best
    assert r.usage.prompt_tokens == sum(len(p) for p in batch) and r.usage.completion_tokens == 2
    assert_blocks_free(tiny_engine.engine)


def test_max_tokens_zero_echo_scores_only_the_prompt(api_server, tiny_llama, tiny_engine):
    prompt = random_prompts(2, (9, 33))[1]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3}
    r = httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    check_echo(choice, prompt, hf_rows(tiny_llama, prompt), 0)
    assert all(1 <= len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1:])  # texts may collide
    assert_blocks_free(tiny_engine.engine)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_echo_equals_whole(api_server, n):
    body = {"model": "tiny", "prompt": random_prompts(3, (9, 33)), "max_tokens": 5, "echo": True, "logprobs": 2, "n": n,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=60).json()
    texts: dict[int, str] = {}
    logprobs: dict[int, dict] = {}
    with httpx.stream("POST", f"{api_server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["logprobs"]:
                    acc = logprobs.setdefault(c["index"], {k: [] for k in c["logprobs"]})
                    for k, v in c["logprobs"].items():
                        acc[k] += v
    assert len(whole["choices"]) == 2 * n
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        got, want = logprobs[c["index"]], c["logprobs"]
        assert got["tokens"] == want["tokens"], (got["tokens"], want["tokens"])
        assert got["text_offset"] == want["text_offset"], (got["text_offset"], want["text_offset"])
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        # two runs: the steps may batch differently, so the values agree to float rounding
        assert np.allclose(got["token_logprobs"][1:], want["token_logprobs"][1:], atol=1e-5)
        assert [None if t is None else sorted(t) for t in got["top_logprobs"]] == \
               [None if t is None else sorted(t) for t in want["top_logprobs"]]


def test_vllm_prompt_logprobs_on_completions_and_chat(api_server, tiny_llama, tiny_engine):
    prompt = random_prompts(4, (9, 33))[0]
    r = httpx.post(f"{api_server.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None
    rows = hf_rows(tiny_llama, prompt)
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        entry = plp[p]
        assert list(entry)[0] == str(prompt[p])  # the prompt's token first
        assert abs(entry[str(prompt[p])]["logprob"] - rows[p - 1, prompt[p]]) <= 1e-4
        best = np.argsort(-rows[p - 1], kind="stable")[:2]
        for rank, t in enumerate(best, start=1):
            assert entry[str(t)]["rank"] == rank and abs(entry[str(t)]["logprob"] - rows[p - 1, t]) <= 1e-4
        assert len(entry) == (2 if prompt[p] in best else 3)

    chat = httpx.post(f"{api_server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    plp = chat.json()["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])
    assert len(plp) == chat.json()["usage"]["prompt_tokens"]
    assert_blocks_free(tiny_engine.engine)


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "ab", "echo": True, "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "ab", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "ab", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1}, "prompt_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_prompt_logprob_requests_name_the_field(api_server, path, body, param):
    r = httpx.post(f"{api_server.url}/v1/{path}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_prompt_scores_past_the_bound_are_a_400_and_copies_share_one_body(api_server, tiny_engine, monkeypatch):
    """Echo's logprobs and prompt_logprobs are rendered into each of a prompt's n completions: past
    MAX_RENDERED_PROMPT_SCORES that is a 400 naming n (the numbers in the message), before any engine work; at the
    bound it answers, every completion carrying the same scores."""
    from lmkit.serve import openai_serving

    prompt = random_prompts(5, (9, 33))[1]  # 33 tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 2, "prompt_logprobs": 1,
            "n": 4}
    scores = 33 * 4 * (3 + 2)
    monkeypatch.setattr(openai_serving, "MAX_RENDERED_PROMPT_SCORES", scores - 1)
    steps = tiny_engine.engine.metrics().num_steps
    r = httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and f"{scores:,} prompt-token scores" in error["message"], error
    assert "33 prompt tokens x n=4 completions x 3 + 2 per token" in error["message"], error
    assert tiny_engine.engine.metrics().num_steps == steps
    monkeypatch.setattr(openai_serving, "MAX_RENDERED_PROMPT_SCORES", scores)
    r = httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4 and all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    assert all(c["logprobs"]["token_logprobs"][:33] == choices[0]["logprobs"]["token_logprobs"][:33] for c in choices)
    assert_blocks_free(tiny_engine.engine)


def test_a_large_scored_answer_is_streamed_in_pieces_beside_a_fast_health(api_server, tiny_engine):
    """511 prompt tokens echoed with 20 alternatives and scored with 20 (prompt_logprobs) into 24 completions:
    ~515,000 scores, 21 MB of JSON. Encoded whole it held the GIL in one json.dumps (/health's slowest probe
    0.47-0.53 s on Zen 5); in pieces it streams (no Content-Length) while /health stays fast (38 ms), and the
    copies are equal."""

    prompt = np.random.default_rng(6).integers(0, 256, size=511).tolist()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20, "prompt_logprobs": 20,
            "n": 24}
    with HealthPoller(api_server.url) as health:
        r = httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and "content-length" not in r.headers, (r.status_code, r.headers)
    assert len(r.content) > 10_000_000
    choices = r.json()["choices"]
    assert len(choices) == 24 and len(choices[0]["prompt_logprobs"]) == 511
    first = choices[0]
    for c in choices[1:]:
        assert c["prompt_logprobs"] == first["prompt_logprobs"]
        assert c["logprobs"]["top_logprobs"][:511] == first["logprobs"]["top_logprobs"][:511]
    health.check("a 21 MB scored answer", limit_s=0.4)
    assert_blocks_free(tiny_engine.engine)
