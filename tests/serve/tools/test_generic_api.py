"""The generic tool-call format through the api_server with the bundled SmolLM2, whose chat template teaches no
tool-call format: required and named calls validate against the tool's parameters, auto answers with either
calls or content, streamed answers equal whole ones, a tool round trip renders, and a JSON structured output
of the request's own is the answer when the model calls no tool."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.harness import reassemble

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def client(smollm2_server):
    import openai

    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(**kw) -> dict:
    return {"model": "smollm2", "messages": ASK, "tools": TOOLS, "max_tokens": 60, **kw}


def assert_streamed_as_whole(client, body: dict, r) -> None:
    content, calls, finish, _ = reassemble(client.chat.completions.create(**body, stream=True))
    message = r.choices[0].message
    assert (content, finish) == (message.content or "", r.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls and not message.content, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_required_and_named_calls_validate(client):
    for choice, temperature, names in [("required", 0.0, tuple(SCHEMAS)),
                                       ({"type": "function", "function": {"name": "search"}}, 1.0, ("search",))]:
        body = ask(tool_choice=choice, parallel_tool_calls=False, temperature=temperature, seed=7)
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls", r
        check_calls(r.choices[0].message, names)
        assert len(r.choices[0].message.tool_calls) == 1
        assert_streamed_as_whole(client, body, r)


@pytest.mark.slow
def test_auto_answers_with_calls_or_content(client):
    kinds = set()
    for temperature, seed in [(0.0, 0), (1.0, 1)]:
        body = ask(tool_choice="auto", temperature=temperature, seed=seed, parallel_tool_calls=False)
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, r
            check_calls(message)
        else:  # the response's text, without the object around it
            assert message.content and not message.content.startswith("{"), message
            assert r.choices[0].finish_reason in ("stop", "length")
        kinds.add(bool(message.tool_calls))
        assert_streamed_as_whole(client, body, r)
    assert False in kinds  # SmolLM2 answers this greedily in text


@pytest.mark.slow
def test_tool_round_trip_renders(client):
    first = client.chat.completions.create(**ask(tool_choice="required", parallel_tool_calls=False, temperature=0))
    (call,) = first.choices[0].message.tool_calls
    result = '{"temperature": 21, "sky": "clear"}'
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(**ask(messages=messages, max_tokens=8, temperature=0))
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt
    assert second.usage.prompt_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens // 2 + 10
    # with tool_choice none the tools are not offered, but the history still renders (as plain messages)
    quiet = client.chat.completions.create(**ask(messages=messages, max_tokens=4, tool_choice="none"))
    assert quiet.choices[0].finish_reason in ("stop", "length") and not quiet.choices[0].message.tool_calls
    assert first.usage.completion_tokens < quiet.usage.prompt_tokens < second.usage.prompt_tokens


def test_a_json_structured_output_is_the_answer_beside_the_tools(client, smollm2_server):
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}}, "required": ["answer"],
              "additionalProperties": False}
    body = ask(tool_choice="auto", temperature=0, max_tokens=40,
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}},
               messages=[{"role": "user", "content": "Say hello."}])
    r = client.chat.completions.create(**body)
    message = r.choices[0].message
    if message.tool_calls:
        check_calls(message)
    else:
        jsonschema.validate(json.loads(message.content), answer)
    assert_streamed_as_whole(client, body, r)
    # a regex cannot be the answer of a JSON object: refused, naming it
    r = httpx.post(f"{smollm2_server.url}/v1/chat/completions", timeout=60,
                   json=ask(max_tokens=4, structured_outputs={"regex": "[a-z]+"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
