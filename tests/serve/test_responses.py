"""POST /v1/responses (OpenAI's Responses API) through the official openai client and the OpenAI Agents SDK, on
tiny random models: answers equal the chat completions of the same chats, streamed events (checked against the
openai package's types) reassemble to the whole Response, structured output, a tool round trip, reasoning items,
previous_response_id with a bounded store, and bad requests as 400s naming the field."""

from __future__ import annotations

import json
import socket
import time
from typing import Annotated, get_args

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.factories import FAMILIES, make_family_model
from tests.serve.harness import FAMILY_ENGINE, ServerThread, generating, wait_idle

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER,
          "strict": True}]
ENDLESS = {"ignore_eos": True}  # a random model's answers run to max_output_tokens


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def family_servers(tmp_path_factory):
    """qwen2.5 (hermes tool calls) and deepseek_r1 (answers start in <think>) served under their names."""
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app

    made = {}
    try:
        for name in ("qwen2.5", "deepseek_r1"):
            folder = make_family_model(tmp_path_factory.mktemp(name), FAMILIES[name])
            engine = AsyncEngine(folder, EngineConfig(**FAMILY_ENGINE))
            made[name] = (engine, ServerThread(create_app(engine, ServerConfig(model_name=name))))
        yield {name: server for name, (_, server) in made.items()}
    finally:
        for engine, server in made.values():
            server.stop()
            engine.close()


@pytest.fixture(scope="module")
def store_server(tiny_engine):
    """The tiny model as `tiny`, keeping responses (1 MiB)."""
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", responses_store_max_bytes=2**20)))
    yield server
    server.stop()


def without_ids(output) -> list[dict]:
    """Output items as dicts, their (random) ids left out."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in output]


def chat_of(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def check_event(event: dict) -> None:
    """Validates a stream event against the openai package's type of its kind."""
    from openai.types.responses import ResponseStreamEvent

    types = {get_args(cls.model_fields["type"].annotation)[0]: cls
             for cls in get_args(get_args(ResponseStreamEvent)[0])}
    types[event["type"]].model_validate(event)


def raw_events(url: str, body: dict) -> list[dict]:
    """The SSE events of a streamed /v1/responses, each checked against the openai package's event types."""
    events, kind = [], None
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == kind, (kind, event)
                check_event(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_output_items_of_an_answer_that_thinks_writes_and_calls():
    """Events of reasoning, text and two calls become one item each, in order, every stream event of the openai
    package's types, the done events holding what the deltas joined."""
    from lmkit.serve.responses import OutputItems
    from lmkit.serve.stream import ChoiceEvent
    from lmkit.serve.tools.base import ToolCallDelta

    output = OutputItems()
    answer = [ChoiceEvent(0, token_ids=[1]), ChoiceEvent(0, reasoning="plan ", token_ids=[2]),
              ChoiceEvent(0, reasoning="more", token_ids=[3]), ChoiceEvent(0, token_ids=[4]),
              ChoiceEvent(0, text="Hi", token_ids=[5]),
              ChoiceEvent(0, tool_calls=[ToolCallDelta(0, '{"a"', "call_1", "f")], token_ids=[6]),
              ChoiceEvent(0, tool_calls=[ToolCallDelta(0, ": 1}"), ToolCallDelta(1, "{}", "call_2", "g")],
                          token_ids=[7])]
    events = [e for event in answer for e in output.feed(event)] + output.finish(is_incomplete=False)
    for number, event in enumerate(events):
        check_event({**event, "sequence_number": number})
    assert [(i["type"], i["status"]) for i in output.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed")]
    reasoning, message, f, g = output.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan more"}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "Hi" and message["role"] == "assistant"
    assert (f["call_id"], f["name"], f["arguments"], g["call_id"], g["arguments"]) == (
        "call_1", "f", '{"a": 1}', "call_2", "{}")
    assert output.num_reasoning_tokens == 4  # the tokens before the answer: <think>, the thinking, </think>
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [i["id"] for i in output.items] and done == output.items
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    # an answer cut short: its open item is incomplete; an empty answer is one empty message
    output = OutputItems()
    output.feed(ChoiceEvent(0, text="cut", token_ids=[1]))
    output.finish(is_incomplete=True)
    assert [(i["type"], i["status"]) for i in output.items] == [("message", "incomplete")]
    output = OutputItems()
    output.finish(is_incomplete=False)
    assert [(i["type"], i["content"][0]["text"]) for i in output.items] == [("message", "")]


def test_items_become_chat_messages():
    from lmkit.serve.responses_protocol import ResponsesRequest

    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
             {"role": "assistant", "content": "done"}, {"type": "function_call", "call_id": "c3", "name": "f",
                                                        "arguments": "{}"}]
    request = ResponsesRequest.model_validate({"model": "m", "input": items, "instructions": "sys"})
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}} for c, n in
             (("c1", "f"), ("c2", "g"))]
    assert request.input_messages() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "t", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "done", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert request.chat_body(request.input_messages())["messages"][0] == {"role": "system", "content": "sys"}


def test_store_keeps_the_most_recently_used_within_its_bytes():
    from lmkit.serve.responses import ResponseStore, StoredResponse

    store = ResponseStore(max_bytes=100)
    for name in "abc":
        assert store.put(name, StoredResponse({}, [], 0, 40))
        store.get("a")  # a stays the most recently used
    assert [k for k in "abc" if store.get(k)] == ["a", "c"] and store.num_bytes == 80
    assert not store.put("big", StoredResponse({}, [], 0, 101)) and store.get("big") is None
    assert store.delete("a") and not store.delete("a") and store.num_bytes == 40
    assert not ResponseStore().is_on and ResponseStore().put("x", StoredResponse({}, [], 0, 1)) is False


def test_text_input_and_instructions_equal_the_chat_completion(client):
    kw = dict(max_tokens=8, extra_body=ENDLESS)
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0, extra_body=ENDLESS)
    chat = chat_of(client, [{"role": "user", "content": "hello"}], **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content and len(r.output) == 1
    message = r.output[0]
    assert (message.type, message.role, message.status, message.content[0].annotations) == (
        "message", "assistant", "incomplete", [])
    # cut at max_output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, 8, chat.usage.prompt_tokens + 8)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    r = client.responses.create(model="tiny", instructions="be brief", input="hello", max_output_tokens=8,
                                temperature=0, extra_body=ENDLESS)
    chat = chat_of(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], **kw)
    assert r.output_text == chat.choices[0].message.content and r.instructions == "be brief"
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_list_input_with_history_equals_the_chat_completion(client):
    items = [{"role": "developer", "content": "answer in French"},
             {"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
              "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and "},
                                                              {"type": "input_text", "text": "more"}]}]
    messages = [{"role": "developer", "content": "answer in French"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and more"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0, extra_body=ENDLESS)
    chat = chat_of(client, messages, max_tokens=6, extra_body=ENDLESS)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_reassemble_to_the_whole_response(client, api_server):
    body = dict(model="tiny", input="tell me", max_output_tokens=12, temperature=1.0, seed=7, **ENDLESS)
    whole = client.responses.create(**{k: v for k, v in body.items() if k not in ("seed", "ignore_eos")},
                                    extra_body={"seed": 7, **ENDLESS})
    events = raw_events(api_server.url, body)
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1]["response"]
    assert final["usage"] == whole.usage.model_dump(exclude_none=True)
    assert [{k: v for k, v in item.items() if k != "id"} for item in final["output"]] == without_ids(whole.output)


class City(BaseModel):
    name: str = Field(max_length=8)
    rank: int = Field(ge=1, le=9)


def test_structured_output_parse_and_stream(client):
    """text.format json_schema (client.responses.parse with a pydantic model); streamed (client.responses.stream,
    which needs response.completed) with the same seed, the same Response."""
    kw = dict(model="tiny", input="a city", max_output_tokens=60, temperature=1.0, text_format=City,
              extra_body={"seed": 3})
    parsed = client.responses.parse(**kw)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_parsed == parsed.output_parsed
    assert without_ids(final.output) == without_ids(parsed.output) and final.usage == parsed.usage
    r = client.responses.create(model="tiny", input="json", max_output_tokens=40, temperature=1.0,
                                text={"format": {"type": "json_object"}}, extra_body={"seed": 1})
    if r.status == "completed":
        json.loads(r.output_text)


def test_function_call_round_trip(family_servers):
    client = openai_client(family_servers["qwen2.5"].url)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    body = dict(model="qwen2.5", input=[question], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                max_output_tokens=200, temperature=1.0, extra_body={"seed": 2})
    r = client.responses.create(**body)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # streamed: the arguments' deltas reassemble to the same call
    with client.responses.stream(**body) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    fields = ("type", "name", "arguments", "status")
    assert deltas == call.arguments
    assert [[getattr(item, k) for k in fields] for item in final.output] == [[getattr(call, k) for k in fields]]
    # the call and its output go back; the answer is a message
    follow = [question, *[item.model_dump(exclude_none=True) for item in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = client.responses.create(model="qwen2.5", input=follow, tools=TOOLS, max_output_tokens=6,
                                     extra_body={"seed": 2})
    assert second.output and second.output[0].type == "message", second.output
    assert second.usage.input_tokens >= r.usage.input_tokens + len(call.arguments) // 4 + len('{"temperature": 21}')


def test_thinking_is_a_reasoning_item(family_servers):
    """DeepSeek-R1's prompt ends inside <think>: the answer's thinking is a reasoning item (its reasoning_text
    content), as the chat completion's reasoning_content of the same sampling, streamed and whole."""
    url = family_servers["deepseek_r1"].url
    client = openai_client(url)
    question = [{"role": "user", "content": "2+2?"}]
    r = client.responses.create(model="deepseek_r1", input=question, max_output_tokens=16, temperature=1.0,
                                extra_body={"seed": 5})
    chat = client.chat.completions.create(model="deepseek_r1", messages=question, max_tokens=16, temperature=1.0,
                                          seed=5)
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert r.output[0].type == "reasoning" and r.output[0].summary == []
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == reasoning
    assert r.output_text == (chat.choices[0].message.content or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events = raw_events(url, dict(model="deepseek_r1", input=question, max_output_tokens=16, temperature=1.0, seed=5))
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
    assert events[-1]["response"]["usage"] == r.usage.model_dump(exclude_none=True)


def test_previous_response_id_continues_a_kept_response(store_server):
    client = openai_client(store_server.url)
    first = client.responses.create(model="tiny", input="hi", instructions="be brief", max_output_tokens=5,
                                    temperature=0, extra_body=ENDLESS)
    assert first.store is True
    second = client.responses.create(model="tiny", input="more", previous_response_id=first.id, max_output_tokens=5,
                                     temperature=0, extra_body=ENDLESS)
    assert second.previous_response_id == first.id
    # the chat it continued: the first input and answer (not its instructions), then the new input
    chat = chat_of(client, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "more"}], max_tokens=5, extra_body=ENDLESS)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # streamed responses are kept too, and chains go on
    with httpx.stream("POST", f"{store_server.url}/v1/responses", timeout=60, json=dict(
            model="tiny", input="again", previous_response_id=second.id, max_output_tokens=3, stream=True)) as s:
        third_id = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")][-1]["response"]["id"]
    third = client.responses.retrieve(third_id)
    assert third.previous_response_id == second.id and third.usage.input_tokens > second.usage.input_tokens
    client.responses.delete(first.id)
    with pytest.raises(Exception) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.status_code == 404
    unkept = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    assert unkept.store is False
    for response_id in (first.id, unkept.id, "resp_unknown"):
        r = httpx.post(f"{store_server.url}/v1/responses", timeout=30,
                       json={"model": "tiny", "input": "y", "previous_response_id": response_id})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_previous_response_id_without_a_store_is_a_400(api_server, client):
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert first.store is False
    r = httpx.post(f"{api_server.url}/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "more", "previous_response_id": first.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "--responses-store-max-bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{api_server.url}/v1/responses/{first.id}", timeout=30).status_code == 404


def test_store_evicts_the_least_recently_used(tiny_engine):
    from lmkit.serve import ServerConfig, create_app

    # room for two of its responses (about 2,050 bytes each: serve/responses.py approx_bytes), not three
    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", responses_store_max_bytes=5000)))
    try:
        client = openai_client(server.url)

        def ask(text: str):
            return client.responses.create(model="tiny", input=text, max_output_tokens=4, temperature=0,
                                           extra_body=ENDLESS).id

        first, second = ask("one"), ask("two")
        client.responses.retrieve(first)  # now the most recently used: the next one evicts `second`
        third = ask("three")
        kept = {rid: httpx.get(f"{server.url}/v1/responses/{rid}", timeout=30).status_code
                for rid in (first, second, third)}
        assert kept == {first: 200, second: 404, third: 200}, kept
        r = httpx.post(f"{server.url}/v1/responses", timeout=30,
                       json={"model": "tiny", "input": "x", "previous_response_id": second})
        assert r.status_code == 400 and "evicted" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_through_the_proxy(api_server, client):
    from lmkit.serve import ProxyConfig, create_proxy_app
    from tests.serve.harness import ADMIN_KEY

    proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(api_server.url,), admin_key=ADMIN_KEY)))
    try:
        body = dict(model="tiny", input="hello", max_output_tokens=6, temperature=0, extra_body=ENDLESS)
        expected = client.responses.create(**body).output_text
        assert openai_client(proxy.url).responses.create(**body).output_text == expected
        events = raw_events(proxy.url, dict(model="tiny", input="hello", max_output_tokens=6, temperature=0,
                                            **ENDLESS))
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected
    finally:
        proxy.stop()


agents = pytest.importorskip("agents")


def test_openai_agents_sdk_runs_a_tool_loop_on_responses(family_servers):
    from openai import AsyncOpenAI

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)], days: Annotated[int, Field(ge=1, le=3)]) -> str:
        """The weather of a city for the next days."""
        seen.append((city, days))
        return f"sunny in {city} for {days} days"

    class Forecast(BaseModel):
        summary: str = Field(max_length=12)

    # the call is forced; then (the SDK resets tool_choice) the answer is held to the output type's schema, so a
    # random model's answer ends (a Responses model that ends at max_output_tokens is an error to the SDK)
    client = AsyncOpenAI(base_url=f"{family_servers['qwen2.5'].url}/v1", api_key="none", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  output_type=Forecast, model=OpenAIResponsesModel(model="qwen2.5", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=1.0,
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1 and len(seen[0][0]) <= 10 and 1 <= seen[0][1] <= 3, seen
    assert isinstance(result.final_output, Forecast)
    assert [r.output[0].type for r in result.raw_responses] == ["function_call", "message"]


BAD = [
    ({"temperature": 0.5, "n": 2}, 400, "n"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, 400, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"role": "user"}]}, 400, "input[0].content"),
    ({"input": 5}, 400, "input"),
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    ({"max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 12}}]}, 400, "tools[0].parameters"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("extra,status,param", BAD)
def test_bad_requests_name_the_field(api_server, extra, status, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{api_server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_client_that_leaves_cancels_its_request(slow_server):
    """Streamed or not, the engine request ends when the client goes away: nothing runs and every block is free."""
    server, engine = slow_server
    before = engine.metrics().num_generated_tokens
    body = {"model": "tiny", "input": "x", "max_output_tokens": 480, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    payload = json.dumps(body).encode()
    started = generating(engine)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 30
        while not started():
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    wait_idle(engine=engine, timeout_s=10)
    m = engine.metrics()
    assert m.num_running == m.num_waiting == 0 and m.num_free_blocks == engine.num_total_blocks, m
    assert m.num_generated_tokens - before < 480, "the requests ran on after their clients left"
