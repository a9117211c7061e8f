"""The generic tool-call format (serve/tools/generic.py) on its own: chosen for templates that teach no format,
the prompt it writes (tools in a system message, earlier calls and results as plain messages), the grammar of its
answers for each tool_choice, and its parser, streamed and whole, on any answer."""

from __future__ import annotations

import json

import pytest

from lmkit.chat_template import render_chat_template
from lmkit.serve.tools.generic import INSTRUCTIONS, GenericToolParser, generic_messages
from lmkit.serve.tools.grammar import tool_call_grammar
from lmkit.serve.tools.parsers import TOOL_PARSERS, detect_tool_parser, tool_parser_class
from tests.factories import TEMPLATES

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
             "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
HISTORY = [  # as ChatMessage.template_data gives it
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


def test_templates_without_a_known_format_get_generic():
    assert detect_tool_parser(CHATML) is GenericToolParser and detect_tool_parser(None) is GenericToolParser
    assert tool_parser_class("generic") is GenericToolParser and TOOL_PARSERS["generic"].constrains_auto
    for family, name in [("qwen2.5", "hermes"), ("qwen3_coder", "qwen3_coder"), ("llama3.1", "llama3_json")]:
        assert detect_tool_parser((TEMPLATES / f"{family}.jinja").read_text()).name == name


def _render(template: str):
    return lambda messages, tools: render_chat_template(template, messages, True, {}, tools)


def test_prompt_has_the_tools_and_the_history_as_plain_messages():
    given = json.loads(json.dumps(HISTORY))
    text = GenericToolParser.render_prompt(_render(CHATML), HISTORY, TOOLS)
    assert HISTORY == given  # not changed
    tools = "\n".join([json.dumps({"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}),
                       json.dumps({"name": "now", "parameters": {"type": "object", "properties": {}}})])
    calls = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                            {"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    results = {"tool_results": [{"name": "get_weather", "content": {"temp": 21}},
                                {"name": "get_weather", "content": "sunny"}]}
    assert text == (f"<|im_start|>system\n{INSTRUCTIONS.replace('{tools}', tools)}<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
                    f"<|im_start|>assistant\n{json.dumps(calls)}<|im_end|>\n"
                    f"<|im_start|>user\n{json.dumps(results)}<|im_end|>\n"
                    "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    # the chat's own system message gets the instructions after its text; without tools the history alone
    with_system = generic_messages([{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS)
    assert with_system[0] == {"role": "system", "content": f"Be brief.\n\n{INSTRUCTIONS.replace('{tools}', tools)}"}
    assert [m["role"] for m in generic_messages(HISTORY, None)] == ["user", "assistant", "user", "user"]
    # an assistant's text stays, its calls after it
    (said,) = generic_messages([{"role": "assistant", "content": "On it.", "tool_calls": HISTORY[1]["tool_calls"]}],
                               None)
    assert said == {"role": "assistant", "content": f"On it.\n{json.dumps(calls)}"}


def test_a_template_without_a_system_role_gets_the_instructions_in_the_first_message():
    text = GenericToolParser.render_prompt(_render(NO_SYSTEM), HISTORY[:1], TOOLS)
    assert text.startswith("[user] You can call tools") and text.endswith("\n\nWeather in Paris and Oslo?\n")
    with pytest.raises(ValueError, match="no system role"):  # the chat's own system message: its error stands
        GenericToolParser.render_prompt(_render(NO_SYSTEM), [{"role": "system", "content": "x"}, *HISTORY[:1]], TOOLS)


def _matcher_of_bytes():
    """accepts(lark, text): whether a grammar takes exactly ``text`` (a byte-level vocabulary, </s> as EOS)."""
    llguidance = pytest.importorskip("llguidance")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    vocab = llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256)

    def accepts(lark: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocab, lark)
        assert not matcher.is_error(), matcher.get_error()
        ids = tok.encode(text).ids
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    return accepts


def test_grammar_of_each_tool_choice():
    accepts = _matcher_of_bytes()
    tools = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}
    one = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    two = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]}'
    texts = {"one": one, "two": two, "response": '{"response": "It is \\"sunny\\"."}',
             "bad arguments": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris!"}}]}',
             "unknown tool": '{"tool_calls": [{"name": "f", "arguments": {}}]}', "no call": '{"tool_calls": []}',
             "text": "It is sunny."}
    cases = [  # (tools, parallel, required) -> what is accepted
        ((tools, True, False), {"one", "two", "response"}), ((tools, False, False), {"one", "response"}),
        ((tools, True, True), {"one", "two"}), ((tools, False, True), {"one"}),
        (({"now": tools["now"]}, True, True), set())]  # a named function: only its calls
    for (allowed, parallel, required), want in cases:
        lark = tool_call_grammar(GenericToolParser, allowed, parallel, lambda _: None, required=required)
        assert {name for name, text in texts.items() if accepts(lark, text)} == want, (parallel, required)
    assert accepts(tool_call_grammar(GenericToolParser, {"now": tools["now"]}, False, lambda _: None),
                   '{"tool_calls": [{"name": "now", "arguments": {}}]}')
    # a structured output of the request's own: the response is a value of its schema
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                         "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}})
    lark = tool_call_grammar(GenericToolParser, tools, True, lambda _: None, required=False, answer_schema=schema)
    assert accepts(lark, '{"response": {"n":3}}') and accepts(lark, one)
    assert not accepts(lark, '{"response": "three"}') and not accepts(lark, '{"response": {"n":"3"}}')


def _parse(text: str, cuts: list[int], parser_class=GenericToolParser) -> tuple[str, list[tuple[str, str]]]:
    parser = parser_class({})
    bounds, content, calls = [0, *cuts, len(text)], "", {}
    for k in range(len(bounds) - 1):
        c, deltas = parser.feed(text[bounds[k]:bounds[k + 1]], final=k == len(bounds) - 2)
        content += c
        for d in deltas:
            if d.name is not None:
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_any_answer_parses_alike_streamed_and_whole():
    """A call object (any arguments), a response object (any text, written with json.dumps's escapes or
    without), or other text: calls and content as written, for any cuts."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    strings = st.text(st.characters(codec="utf-8") | st.sampled_from(['"', "\\", "\n", "\U0001F600", "{", "}"]),
                      max_size=12)
    values = st.recursive(st.none() | st.booleans() | st.integers() | strings,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
                          max_leaves=6)
    calls = st.lists(st.tuples(st.sampled_from(["f", "g"]), st.dictionaries(strings, values, max_size=3)),
                     min_size=1, max_size=3)
    spaced = st.sampled_from([(", ", ": "), (",", ":")])

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.one_of(st.tuples(st.just("calls"), calls), st.tuples(st.just("response"), strings),
                                st.tuples(st.just("text"), strings)), spaced, st.booleans(), st.data())
    def check(answer, separators, ascii_only, data):
        kind, value = answer
        dumps = dict(separators=separators, ensure_ascii=ascii_only)
        if kind == "calls":
            text = json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in value]}, **dumps)
            want = ("", [(n, json.dumps(a, **dumps)) for n, a in value])
        elif kind == "response":
            text, want = json.dumps({"response": value}, **dumps), (value, [])
        else:
            text, want = value, (value, [])
        assert _parse(text, []) == want
        cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8).map(sorted))
        assert _parse(text, [c for c in dict.fromkeys(cuts) if c < len(text)]) == want

    check()


@pytest.mark.parametrize("text,content", [
    ('{"response": {"a": [1, "}"], "b": null}}', '{"a": [1, "}"], "b": null}'), ('{"response": 12}', "12"),
    ('{"response":"x\\"y"} ', '"x\\"y"'), ('{"response": [true, false] }\nafter', "[true, false]after"),
    ('{"response": {"cut": ', '{"cut": '), ('{"tool_calls": [{"name": "f", "arguments": {}}]}', "")])
def test_json_answers_are_the_text_of_the_response_value(text, content):
    parser_class = GenericToolParser.with_json_answers()
    whole = _parse(text, [], parser_class)
    assert whole[0] == content and bool(whole[1]) == text.startswith('{"tool_calls"')
    for cut in range(1, len(text)):
        assert _parse(text, [cut], parser_class) == whole
    assert _parse(text, list(range(1, len(text))), parser_class) == whole
