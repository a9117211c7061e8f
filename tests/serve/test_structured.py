"""Structured output behind the OpenAI server, through the official `openai` client: response_format
(json_object, json_schema, the client's Pydantic parse), vLLM's structured_outputs / guided_* fields on both
endpoints, streamed and not, and 400s naming the field for constraints that cannot be compiled."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest


jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

CATALOG = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "lead": {"type": "boolean"}},
            "required": ["name", "lead"], "additionalProperties": False}},
    },
    "required": ["title", "year", "genre", "cast"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give one film as JSON with title, year, genre and cast."}]


@pytest.fixture()
def client(smollm2_server):
    import openai

    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.slow
def test_hundred_sampled_answers_validate(client, smollm2_pipe):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": CATALOG, "strict": True}}

    def ask(seed: int):
        return client.chat.completions.create(model="smollm2", messages=ASK, response_format=fmt, n=5,
                                              temperature=1.0, seed=seed, max_tokens=300)

    with ThreadPoolExecutor(3) as pool:  # 15 sequences at once: within the server's admission (16)
        answers = [c for r in pool.map(ask, range(20)) for c in r.choices]
    assert len(answers) == 100
    for c in answers:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CATALOG)
    smollm2_pipe.engine.check_integrity()


def test_parse_with_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Film(BaseModel):
        title: str = Field(max_length=30)
        year: int = Field(ge=1900, le=2030)
        genre: Literal["drama", "comedy"]

    r = client.chat.completions.parse(model="smollm2", messages=ASK, response_format=Film, max_tokens=100,
                                      temperature=0)
    film = r.choices[0].message.parsed
    assert isinstance(film, Film) and r.choices[0].finish_reason == "stop"


def test_json_object_streamed_equals_non_streamed(client):
    kwargs = dict(model="smollm2", messages=ASK, response_format={"type": "json_object"}, max_tokens=60,
                  temperature=0)
    full = client.chat.completions.create(**kwargs)
    text, finish = full.choices[0].message.content, full.choices[0].finish_reason
    assert text.startswith("{")
    if finish == "stop":  # greedy may also run on (an object has no length limit) and end with "length"
        assert isinstance(json.loads(text), dict)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]


def test_vllm_fields_on_both_endpoints(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = client.completions.create(model="smollm2", prompt="Order number:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 7 and r.choices[0].text[2] == "-"
    parts = list(client.completions.create(model="smollm2", prompt="Order number:", max_tokens=20, temperature=0,
                                           stream=True, extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"}))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    r = client.completions.create(model="smollm2", prompt="A film:", max_tokens=200, temperature=0,
                                  extra_body={"guided_json": CATALOG})
    jsonschema.validate(json.loads(r.choices[0].text), CATALOG)
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=20, temperature=0,
                                       extra_body={"guided_grammar": 'start: "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format", "format"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format", "JSON schema"),
    ({"guided_json": False}, "guided_json", "JSON schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "lark"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    # were 500s: a lone surrogate (JSON's "\ud800") in a schema, a choice, a regex; a schema nested too deeply
    ({"guided_json": {"type": "string", "enum": ["a\ud800"]}}, "guided_json", "lone surrogate"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"\udc00": {"type": "string"}}}}}}, "response_format", "lone surrogate"),
    ({"guided_choice": ["ok", "\udbff"]}, "guided_choice[1]", "lone surrogate"),
    ({"guided_regex": "a\ud800"}, "guided_regex", "lone surrogate"),
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json", "nested too deeply"),
])
def test_bad_constraints_are_400s(smollm2_server, extra, param, words):
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 5, **extra}
    r = httpx.post(f"{smollm2_server.url}/v1/chat/completions", content=json.dumps(body).encode(),  # \ud800 as is
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert httpx.get(f"{smollm2_server.url}/health", timeout=10).status_code == 200


def test_a_grammar_that_fails_while_generating_is_a_400_without_internals(smollm2_server):
    """A grammar of 3,000 rule alternatives compiles, and llguidance's parser refuses its first token (a row of
    3,001 items, at most 2,000): a 400 naming the field, with llguidance's first line and not its state dump
    (it was a 500). The same 3,000 strings as guided_choice are one terminal and answer."""
    choices = [f"w{i}x" for i in range(3000)]
    grammar = "start: " + " | ".join(json.dumps(c) for c in choices)
    for stream in (False, True):
        body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, "guided_grammar": grammar, "stream": stream}
        r = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
        if stream:
            assert r.status_code == 200
            error = json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])["error"]
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
        assert error["param"] == "guided_grammar" and "max is 2000" in error["message"], error
        assert "<state>" not in error["message"] and "\n" not in error["message"], error
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, "guided_choice": choices}
    r = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in choices, r.text


def test_logprobs_of_tokens_a_grammar_rules_out_are_minus_9999(smollm2_server):
    """Under a grammar that allows two answers, most of the 20 alternatives have probability zero: the engine
    reports -inf, which JSON cannot hold (the whole answer was a 500, the stream's chunks held -Infinity).
    They are -9999.0, as OpenAI and vLLM write them, whole and streamed, chat and completions."""
    url = smollm2_server.url
    bodies = {"chat/completions": {"messages": ASK, "logprobs": True, "top_logprobs": 20},
              "completions": {"prompt": "Answer yes or no:", "logprobs": 20, "echo": True}}
    for path, extra in bodies.items():
        for stream in (False, True):
            body = {"model": "smollm2", "max_tokens": 4, "guided_choice": ["yes", "no"], "stream": stream, **extra}
            r = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")] if stream else [r.text]
            values: list[float] = []
            for text in texts:  # strict JSON: no -Infinity
                logprobs_of(json.loads(text, parse_constant=lambda c: pytest.fail(f"{path}: {c}")), values)
            assert values and min(values) == -9999.0 and max(values) <= 0.0, (path, stream, values[:40])


def logprobs_of(value, out: list[float]) -> None:
    """Every logprob in an answer: chat's {"logprob": x} and the legacy top_logprobs' {text: x} maps."""
    if isinstance(value, dict):
        for key, v in value.items():
            if key == "logprob" or (key == "token_logprobs" and isinstance(v, list)):
                out += [x for x in (v if isinstance(v, list) else [v]) if x is not None]
            elif key == "top_logprobs" and isinstance(v, list) and v and not any(
                    isinstance(t, dict) and "logprob" in t for t in v):
                out += [x for t in v if t for x in t.values()]
            else:
                logprobs_of(v, out)
    elif isinstance(value, list):
        for v in value:
            logprobs_of(v, out)
