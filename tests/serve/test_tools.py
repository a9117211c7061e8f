"""Tool calling through the api_server with the official openai client, on tiny random models that speak the real
families' formats (their own chat templates): required and named calls are enforced by a grammar (the call
parses, its arguments validate against the function's parameters), auto calls are parsed, streamed deltas
reassemble to the whole answer, tool results render back through the template, and bad tool requests are 400s."""

from __future__ import annotations

import json

import pytest

from tests.serve.harness import GEMMA4_SCHEMAS, TOOL_FAMILIES, client_of, reassemble

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 2}},
          "required": ["query", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}


def ask(family: str, extra_body: dict | None = None, **kw) -> dict:
    """A chat request offering TOOLS. Qwen3 is asked not to think: its grammar would wait for a </think> that a
    random model does not write (thinking models: tests/serve/test_reasoning.py). gpt-oss cannot be: its grammar lets
    it reason in the analysis channel first, which a random model ends with <|end|> after ~260 tokens on average (one
    token of its ~265), but the tail is long: an unseeded request reasoned past 3,000 once in a full-suite run."""
    extra = dict(extra_body or {})
    if family == "qwen3":
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    limit = 3000 if family == "gpt_oss" else 300
    return {"model": family, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "max_tokens": limit, "temperature": 1.0, "extra_body": extra, **kw}


def check_calls(message, names=("get_weather", "search")):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not message.content


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_required_calls_parse_and_validate(servers, family):
    client = client_of(servers, family)
    for seed in range(6):
        body = ask(family, tool_choice="required", seed=seed, parallel_tool_calls=False)
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls", r
        check_calls(r.choices[0].message)
        assert len(r.choices[0].message.tool_calls) == 1
        # the same sampling streamed: the deltas reassemble to the whole answer
        content, calls, finish, _ = reassemble(client.chat.completions.create(**body, stream=True))
        assert finish == "tool_calls" and not content
        whole = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == whole


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_parallel_calls(servers, family):
    """With parallel_tool_calls (the default) a required answer may hold several calls, each valid; streamed
    they arrive with their own index and id."""
    client = client_of(servers, family)
    counts = []
    for seed in range(8):
        body = ask(family, tool_choice="required", seed=100 + seed, max_tokens=3000 if family == "gpt_oss" else 1500)
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        if r.choices[0].finish_reason == "length":  # cut short: the calls before the last are complete
            message.tool_calls = message.tool_calls[:-1]
            if not message.tool_calls:
                continue
        else:
            assert r.choices[0].finish_reason == "tool_calls"
            content, calls, _, _ = reassemble(client.chat.completions.create(**body, stream=True))
            assert [(c["name"], c["arguments"]) for c in calls] == \
                [(c.function.name, c.function.arguments) for c in message.tool_calls]
            assert len({c["id"] for c in calls}) == len(calls)
        check_calls(message)
        counts.append(len(message.tool_calls))
    if family in ("llama3.1", "gpt_oss"):  # their templates render one call per message: the grammar allows one
        assert counts and max(counts) == 1, counts
    elif family != "qwen3_coder" or counts:
        assert max(counts) > 1, counts


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_named_call_and_one_call_only(servers, family):
    client = client_of(servers, family)
    for seed in range(3):
        r = client.chat.completions.create(**ask(family, seed=seed, parallel_tool_calls=False,
                                                 tool_choice={"type": "function", "function": {"name": "search"}}))
        message = r.choices[0].message
        check_calls(message, names=("search",))
        assert len(message.tool_calls) == 1


# What a model of each family writes for one call of search(query="cats", tags=["a"]): forced through the
# request's own grammar while tool_choice is auto, so that the parser, not a grammar, finds the call.
_ARGS = '{"query": "cats", "tags": ["a"]}'
FORCED = {  # (special marker token or None, the text after it)
    "qwen2.5": (None, '<tool_call>\n{"name": "search", "arguments": ' + _ARGS + '}\n</tool_call>'),
    "llama3.1": ("<|python_tag|>", '{"name": "search", "parameters": ' + _ARGS + '}'),
    "mistral": ("[TOOL_CALLS]", '[{"name": "search", "arguments": ' + _ARGS + '}]'),
    "qwen3_coder": (None, '<tool_call>\n<function=search>\n<parameter=query>\ncats\n</parameter>\n'
                          '<parameter=tags>\n["a"]\n</parameter>\n</function>\n</tool_call>'),
}
FORCED["qwen3"] = FORCED["qwen2.5"]
FORCED["gpt_oss"] = (None, "<|channel|>commentary to=functions.search <|constrain|>json<|message|>" + _ARGS)
FORCED["gemma4"] = ("<|tool_call>", 'call:search{query:<|"|>cats<|"|>,tags:[<|"|>a<|"|>]}<tool_call|>')


def forced_lark(tokenizer, marker: str | None, text: str) -> str:
    """Lark of exactly ``marker`` then ``text``, each special token in them as its token (Gemma 4's quote marks and
    closing tag are special tokens inside the text)."""
    import re

    specials = [m for m in ('<|"|>', "<tool_call|>") if tokenizer.is_special(m)]
    pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text) if specials else [text]
    rules = [f"<[{tokenizer.single_token_id(marker)}]>"] if marker else []
    rules += [f"<[{tokenizer.single_token_id(p)}]>" if p in specials else json.dumps(p) for p in pieces if p]
    return "start: " + " ".join(rules)


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_auto_parses_a_call_or_returns_text(servers, family):
    import openai

    client = client_of(servers, family)
    tokenizer = servers[family].engine.tokenizer  # ids of the special markers
    lark = forced_lark(tokenizer, *FORCED[family])
    body = ask(family, tool_choice="auto", extra_body={"structured_outputs": {"grammar": lark}})
    r = client.chat.completions.create(**body)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("search", {"query": "cats", "tags": ["a"]})]
    assert not message.content
    content, calls, finish, _ = reassemble(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("search", {"query": "cats", "tags": ["a"]})]
    # text that is no call stays content, whole and streamed (one seed: the same tokens both ways)
    body = ask(family, tool_choice="auto", seed=7,
               extra_body={"structured_outputs": {"regex": "It is sunny \\{ok\\}"}})
    r = client.chat.completions.create(**body)
    message, finish = r.choices[0].message, r.choices[0].finish_reason
    assert not message.tool_calls
    if family == "gpt_oss" and finish == "length":  # a random model reasoned to max_tokens (rare, ask())
        assert not message.content and getattr(message, "reasoning_content", None)
    else:
        assert message.content == "It is sunny {ok}" and finish == "stop"
    assert reassemble(client.chat.completions.create(**body, stream=True)) == \
        (message.content or "", [], finish, getattr(message, "reasoning_content", None) or "")
    with pytest.raises(openai.BadRequestError):  # required and a structured output at once
        client.chat.completions.create(**ask(family, tool_choice="required",
                                             response_format={"type": "json_object"}))


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_tool_results_render_back_through_the_template(servers, family):
    """A second turn with the assistant's call and the tool's result (OpenAI's shapes, as an agent sends them)."""
    client = client_of(servers, family)
    r = client.chat.completions.create(**ask(family, tool_choice="required", seed=1, parallel_tool_calls=False))
    call = r.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=family, messages=messages, tools=TOOLS, max_tokens=8,
                                            extra_body=ask(family)["extra_body"])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and the result are in the prompt: tokens of the call's arguments and of the result at least
    num_call_tokens = r.usage.completion_tokens
    assert second.usage.prompt_tokens >= r.usage.prompt_tokens + num_call_tokens // 2 + len('{"temperature": 21}')


def test_openai_parse_with_a_strict_pydantic_tool(servers):
    import openai
    from pydantic import BaseModel, Field

    class Lookup(BaseModel):
        """Look up a word."""
        word: str = Field(max_length=10)
        limit: int = Field(ge=1, le=5)

    client = client_of(servers, "qwen2.5")
    r = client.chat.completions.parse(model="qwen2.5", messages=[{"role": "user", "content": "define cat"}],
                                      tools=[openai.pydantic_function_tool(Lookup)], max_tokens=200,
                                      tool_choice={"type": "function", "function": {"name": "Lookup"}},
                                      parallel_tool_calls=False, seed=0)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Lookup) and 1 <= parsed.limit <= 5
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "g", "parameters": {"type": 12}}}]},
     "tools[2].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    # a lone surrogate (JSON's "\ud800") in a tool's schema: no UTF-8 encoder takes it (it was a 500)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "enum": ["x\ud800"]}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\udfff", "parameters": {
        "type": "object"}}}]}, "tools"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tool_requests_are_400s_naming_the_field(servers, extra, param):
    import httpx

    url = f"{servers['qwen2.5'].url}/v1/chat/completions"
    body = {"model": "qwen2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(url, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                   timeout=60)  # json.dumps writes a lone surrogate as its \ud800 escape
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    assert httpx.get(f"{servers['qwen2.5'].url}/health", timeout=10).status_code == 200


def test_tools_on_a_server_that_reads_no_tool_calls_name_the_fix(tiny_engine):
    """--tool-call-parser none: tools are refused with the fix named (a model without a known format gets the
    generic one: tests/serve/tools/test_generic_api.py)."""
    import httpx

    from lmkit.serve import ServerConfig, create_app
    from tests.serve.harness import ServerThread

    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", tool_call_parser="none")))
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        # tool_choice none: the tools are not offered, the request runs
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={**body, "tool_choice": "none"})
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_gemma4_required_calls_of_nested_schemas(servers):
    """Gemma 4's grammar writes its own value syntax for every schema shape (optional-only properties, a nested
    object, arrays of objects, untyped values): each required call parses to arguments the schema validates."""
    client = client_of(servers, "gemma4")
    done = []
    for i, schema in enumerate(GEMMA4_SCHEMAS):
        tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}}]
        for seed in range(3):
            r = client.chat.completions.create(model="gemma4", messages=[{"role": "user", "content": "go"}],
                                               tools=tools, tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=400, temperature=1.0, seed=seed)
            if r.choices[0].finish_reason == "length":  # a random model's free text ran long
                continue
            assert r.choices[0].finish_reason == "tool_calls", r
            (call,) = r.choices[0].message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), schema)
            done.append(i)
    assert set(done) == set(range(len(GEMMA4_SCHEMAS))), done
