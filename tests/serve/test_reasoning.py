"""Reasoning through the api_server: thinking goes to reasoning_content (and reasoning), never content, split
alike streamed and whole; chat_template_kwargs reach the template; a structured output starts after the thinking."""

from __future__ import annotations

import json

from tests.serve.harness import client_of, reassemble


def assert_split_alike(client, body: dict, reasoning: str, content: str) -> None:
    """The chat completion of ``body`` (an answer forced to stop) splits into ``reasoning`` and ``content``, whole
    and streamed."""
    r = client.chat.completions.create(**body)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content, r.choices[0].finish_reason) == (reasoning, content, "stop")
    got_content, _, finish, got_reasoning = reassemble(client.chat.completions.create(**body, stream=True))
    assert (got_reasoning, got_content, finish) == (reasoning, content, "stop")


def test_thinking_is_reasoning_streamed_and_whole(servers):  # noqa: F811
    """DeepSeek-R1's prompt ends inside <think>: a random answer is reasoning until a </think>, if any."""
    client = client_of(servers, "deepseek_r1")
    tokenizer = servers["deepseek_r1"].engine.tokenizer
    messages = [{"role": "user", "content": "2+2?"}]
    prompt_ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    for seed in range(4):
        body = dict(model="deepseek_r1", messages=messages, max_tokens=40, temperature=1.0, seed=seed)
        r = client.chat.completions.create(**body)
        m = r.choices[0].message
        # the oracle: the same sampling as a text completion of the rendered prompt, split by hand
        text = client.completions.create(model="deepseek_r1", prompt=prompt_ids, max_tokens=40, temperature=1.0,
                                         seed=seed).choices[0].text
        reasoning = m.model_extra["reasoning_content"]
        assert m.model_extra["reasoning"] == reasoning
        if "</think>" in text:
            head, tail = text.split("</think>", 1)
            assert reasoning == head.lstrip("\n") and (m.content or "") == tail.lstrip("\n")
        else:
            assert reasoning == text.lstrip("\n") and not m.content
        content, calls, finish, streamed_reasoning = reassemble(client.chat.completions.create(**body, stream=True))
        assert (content, streamed_reasoning, finish) == (m.content or "", reasoning or "", r.choices[0].finish_reason)


FORCED = "<think>\nfirst a plan\n</think>\n\nthe answer"


def test_reasoning_split_of_a_forced_answer_and_enable_thinking(servers):  # noqa: F811
    """Qwen3 with enable_thinking false: the template closes the thinking in the prompt (so a grammar starts at
    once), and an answer that opens <think> anyway is still split."""
    client = client_of(servers, "qwen3")
    messages = [{"role": "user", "content": "hi"}]
    thinking = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=1)
    off = dict(model="qwen3", messages=messages, max_tokens=60,
               extra_body={"chat_template_kwargs": {"enable_thinking": False},
                           "structured_outputs": {"regex": FORCED.replace("\n", "\\n")}})
    r = client.chat.completions.create(**off)
    # the template got enable_thinking: its prompt ends with an empty, closed thinking block
    closed = servers["qwen3"].engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert r.usage.prompt_tokens == thinking.usage.prompt_tokens + len(closed)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == ("first a plan\n", "the answer")
    content, _, finish, reasoning = reassemble(client.chat.completions.create(**off, stream=True))
    assert (reasoning, content, finish) == ("first a plan\n", "the answer", "stop")


def test_structured_output_starts_after_the_thinking(servers):  # noqa: F811
    """With thinking on, the schema applies after </think>: the engine is given that token."""
    import asyncio

    from lmkit.serve.openai_serving import OpenAIServing
    from lmkit.serve.protocol import ChatCompletionRequest
    from lmkit.serve.reasoning import REASONING_FORMATS
    from lmkit.serve.tools.parsers import HermesParser

    engine = servers["qwen3"].engine
    serving = OpenAIServing(engine, "qwen3", tool_parser=HermesParser, reasoning=REASONING_FORMATS["qwen3"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ChatCompletionRequest(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    prepared = asyncio.run(serving.prepare(req))
    assert [prepared.gen.structured_output_after_token] == engine.tokenizer.encode("</think>", add_special_tokens=False)
    off = ChatCompletionRequest(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                                chat_template_kwargs={"enable_thinking": False},
                                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert asyncio.run(serving.prepare(off)).gen.structured_output_after_token is None
    # end to end: whatever the random model thinks, once it writes </think> the rest is the schema's JSON
    client = client_of(servers, "qwen3")
    for seed in range(3):
        r = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=30, seed=seed, temperature=1.0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema}})
        m = r.choices[0].message
        if r.choices[0].finish_reason == "stop":  # the grammar completed after a </think>
            answer = ((m.model_extra["reasoning_content"] or "") + "</think>" + (m.content or "")).split("</think>")[-1]
            assert isinstance(json.loads(answer)["a"], int)


def test_harmony_channels_of_a_forced_answer(servers):  # noqa: F811
    """gpt-oss: an answer in harmony's analysis and final channels (its markers special tokens, forced by a grammar)
    is split into reasoning and content, streamed and whole; the markers never reach either, and the text
    completion of the same prompt shows them only when asked (skip_special_tokens false)."""
    client = client_of(servers, "gpt_oss")
    tokenizer = servers["gpt_oss"].engine.tokenizer
    ch, msg, end, start = (f"<[{tokenizer.single_token_id(m)}]>"
                           for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    lark = (f'start: {ch} "analysis" {msg} "first a plan" {end} {start} "assistant" {ch} "final" {msg} '
            f'"the answer"')
    body = dict(model="gpt_oss", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                extra_body={"structured_outputs": {"grammar": lark}})
    assert_split_alike(client, body, "first a plan", "the answer")
    prompt = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|start|>assistant")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    plain = client.completions.create(model="gpt_oss", prompt=ids, max_tokens=60,
                                      extra_body={"structured_outputs": {"grammar": lark}}).choices[0].text
    raw = client.completions.create(model="gpt_oss", prompt=ids, max_tokens=60,
                                    extra_body={"structured_outputs": {"grammar": lark},
                                                "skip_special_tokens": False}).choices[0].text
    assert plain == "analysisfirst a planassistantfinalthe answer"
    assert raw == "<|channel|>analysis<|message|>first a plan<|end|><|start|>assistant<|channel|>final<|message|>" \
                  "the answer"


def test_harmony_structured_answer_is_the_final_channel(servers):  # noqa: F811
    """gpt-oss with a JSON schema, a regex or a choice: the engine's grammar lets it reason in the analysis channel
    first and puts the form on the final channel's message, so content is the form and reasoning the analysis,
    streamed and whole."""
    client = client_of(servers, "gpt_oss")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    forms = [dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
             dict(extra_body={"structured_outputs": {"regex": "[a-c]{3}/[0-9]"}}),
             dict(extra_body={"structured_outputs": {"choice": ["yes", "no"]}})]
    checks = [lambda c: 0 <= json.loads(c)["n"] <= 9, lambda c: len(c) == 5 and c[3] == "/",
              lambda c: c in ("yes", "no")]
    reasoned = 0
    for form, check in zip(forms, checks):
        for seed in range(3):
            body = dict(model="gpt_oss", messages=[{"role": "user", "content": "a number?"}], max_tokens=3000,
                        temperature=1.0, seed=seed, **form)
            r = client.chat.completions.create(**body)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "stop" and check(m.content), r
            reasoning = m.model_extra.get("reasoning_content") or ""
            assert "<|" not in reasoning and "<|" not in m.content
            reasoned += bool(reasoning)
            content, _, finish, streamed = reassemble(client.chat.completions.create(**body, stream=True))
            assert (content, streamed, finish) == (m.content, reasoning, "stop")
    assert reasoned > 0  # some answers reasoned first (a random model takes the analysis channel about half the time)


def test_gemma4_thought_channel_of_a_forced_answer(servers):  # noqa: F811
    """Gemma 4: with enable_thinking the system turn says <|think|> and a schema applies after <channel|>; off (the
    template's default) the prompt ends with an empty channel and a grammar starts at once. An answer's thought
    channel (its markers special tokens; forced by a grammar, with thinking off, where the grammar starts at once)
    is reasoning, the rest content, streamed and whole."""
    import asyncio

    from lmkit.serve.openai_serving import OpenAIServing
    from lmkit.serve.protocol import ChatCompletionRequest
    from lmkit.serve.reasoning import REASONING_FORMATS
    from lmkit.serve.tools.parsers import Gemma4ToolParser

    client = client_of(servers, "gemma4")
    tokenizer = servers["gemma4"].engine.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    on = tokenizer.render_chat(messages, template_kwargs={"enable_thinking": True})
    assert "<|think|>" in on and on.endswith("<|turn>model\n")
    assert tokenizer.render_chat(messages).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    channel, end = (f"<[{tokenizer.single_token_id(m)}]>" for m in ("<|channel>", "<channel|>"))
    lark = f'start: {channel} "thought\\nfirst a plan\\n" {end} "the answer"'
    body = dict(model="gemma4", messages=messages, max_tokens=60, extra_body={"structured_outputs": {"grammar": lark}})
    assert_split_alike(client, body, "first a plan\n", "the answer")
    engine = servers["gemma4"].engine
    serving = OpenAIServing(engine, "gemma4", tool_parser=Gemma4ToolParser, reasoning=REASONING_FORMATS["gemma4"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    thinking = ChatCompletionRequest(model="gemma4", messages=messages, response_format=fmt,
                                     chat_template_kwargs={"enable_thinking": True})
    assert asyncio.run(serving.prepare(thinking)).gen.structured_output_after_token == \
        tokenizer.single_token_id("<channel|>")
    plain = ChatCompletionRequest(model="gemma4", messages=messages, response_format=fmt)
    assert asyncio.run(serving.prepare(plain)).gen.structured_output_after_token is None
