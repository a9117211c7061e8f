"""The tool-call and reasoning parsers on their own: every split of a text into stream pieces gives the same
content, calls and reasoning as the whole text; markup never reaches content; broken calls come back as text."""

from __future__ import annotations

import json

import pytest

from lmkit.serve.reasoning import REASONING_FORMATS
from lmkit.serve.tools.parsers import TOOL_PARSERS
from tests.serve.harness import GEMMA4_SCHEMAS

RUN = {"run": {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                                                "opts": {"type": "object"}}}}
CASES = [  # (parser, text, content, [(name, arguments as JSON value)])
    ("hermes", 'Let me look.<tool_call>\n{"name": "f", "arguments": {"q": "a}\\"<tool_call>", "n": [1, {"b": null}]}}'
               '\n</tool_call>\n<tool_call>\n{"arguments": {"x": 1.5e3}, "name": "g"}\n</tool_call>',
     "Let me look.", [("f", {"q": 'a}"<tool_call>', "n": [1, {"b": None}]}), ("g", {"x": 1500.0})]),
    ("hermes", "a <tool_ b <tool_call>{not json}</tool_call> c", "a <tool_ b <tool_call>{not json}</tool_call> c", []),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>', "", [("f", {})]),
    ("hermes", "plain text, no call", "plain text, no call", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": "x;y"}), ("g", {})]),
    ("llama3_json", '  {"name": "f", "parameters": {"a": true}}', "", [("f", {"a": True})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {"b": 2}}]', "ok ",
     [("f", {"a": "]"}), ("g", {"b": 2})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[ARGS]{}', "", [("f", {"a": [1, 2]}), ("g", {})]),
    ("qwen3_coder", 'Sure.\n<tool_call>\n<function=run>\n<parameter=code>\nif a < b:\n    print("</param")\n'
                    '</parameter>\n<parameter=n>\n3\n</parameter>\n<parameter=opts>\n{"v": [1]}\n</parameter>\n'
                    '</function>\n</tool_call>', "Sure.\n",
     [("run", {"code": 'if a < b:\n    print("</param")', "n": 3, "opts": {"v": [1]}})]),
    ("qwen3_coder", "<tool_call>\n<function=run>\n</function>\n</tool_call>", "", [("run", {})]),
    ("openai", 'A preamble.<|start|>assistant to=functions.run<|channel|>commentary json<|message|>{"code": "x<|"}'
               "<|call|>", "A preamble.", [("run", {"code": "x<|"})]),
    ("openai", "<|start|>assistant to=functions.run<|channel|>commentary json<|message|><|call|>", "", [("run", {})]),
    ("openai", "<|start|>assistant to=functions.run<|channel|>comm",
     "<|start|>assistant to=functions.run<|channel|>comm", []),
    # Gemma 4: its value syntax (bare keys, <|"|> strings holding anything), calls repeated, the results' cue after
    ("gemma4", 'On it.<|tool_call>call:run{code:<|"|>if a < b: print("}<tool_call|>")<|"|>,n:3,opts:{v:[1,<|"|>x'
               '<|"|>,true],w:null}}<tool_call|><|tool_call>call:run{}<tool_call|><|tool_response>', "On it.",
     [("run", {"code": 'if a < b: print("}<tool_call|>")', "n": 3, "opts": {"v": [1, "x", True], "w": None}}),
      ("run", {})]),
    ("gemma4", "<|tool_call>call:run{code:<|\"|>unclosed}<tool_call|> and more",
     "<|tool_call>call:run{code:<|\"|>unclosed}<tool_call|> and more", []),
    ("gemma4", "<|tool_call>call:run{n:1", "<|tool_call>call:run{n:1", []),
    ("gemma4", "no call {here: 1} <|tool", "no call {here: 1} <|tool", []),
    # text after a call keeps its own whitespace, wherever the stream is cut; only the whitespace right after the
    # call (and Gemma 4's results cue there) is layout
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n  a  b\t c \n', "a  b\t c \n", [("f", {})]),
    ("gemma4", "<|tool_call>call:run{}<tool_call|>\n<|tool_response> x  <|tool_response>", "x  <|tool_response>",
     [("run", {})]),
    ("qwen3_coder", "<tool_call>\n<function=run>\n<parameter=code>\na</parameter>\n<parameter=n>\n\n2\n\n</parameter>\n"
                    "</function>\n</tool_call>  then  text", "then  text", [("run", {"code": "a", "n": 2})]),
    ("llama3_json", "<|python_tag|><|python_tag|>; {}", "<|python_tag|>; {}", []),  # the tag is read once
    ("qwen3_coder", "<tool_call>\n<function=abc", "<tool_call>\n<function=abc", []),  # no call: text as written
    ("qwen3_coder", "a <tool_call>\n<tool_call>\n<function=run>\n</function>\n</tool_call>", "a <tool_call>\n",
     [("run", {})]),
    # generic: one JSON object, a call or a response; anything else is content as written
    ("generic", ' {"tool_calls": [{"name": "f", "arguments": {"q": "a}\\"]", "n": [1]}}, '
                '{"arguments": {}, "name": "g"}]} ', "", [("f", {"q": 'a}"]', "n": [1]}), ("g", {})]),
    ("generic", '{"tool_calls": [{"name": "f"}]}\n  more  text', "more  text", [("f", {})]),
    ("generic", '{"response": "Hi \\"you\\"\\n\\u00e9\\ud83d\\ude00\\ud800x\\\\u \\/ <tool_call>"}',
     'Hi "you"\né\U0001F600\ufffdx\\u / <tool_call>', []),
    ("generic", '{ "response" : "" }', "", []),
    ("generic", '{"response": "cut sh', "cut sh", []),
    ("generic", '{"response": "cut in an escape \\ud83d\\ude', "cut in an escape ", []),
    ("generic", "plain text {not json}", "plain text {not json}", []),
    ("generic", '  {"other": 1}', '  {"other": 1}', []),
    ("generic", '{"tool_calls": 5}', '{"tool_calls": 5}', []),
    ("generic", '{"response": 5}', '{"response": 5}', []),
    ("generic", '{"tool_calls": [{"arguments": {}}]}', '{"tool_calls": [{"arguments": {}}]}', []),
    ("generic", '{"tool_calls": [{"na', '{"tool_calls": [{"na', []),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}, oops]}', " oops]}", [("f", {})]),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}, {"x": 1}]}', ' {"x": 1}]}', [("f", {})]),
    ("generic", '{"tool_ca', '{"tool_ca', []),
    ("generic", "", "", []),
]


def run(parser_cls, text: str, cuts: list[int]):
    parser = parser_cls(RUN)
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for k, piece in enumerate(pieces):
        c, deltas = parser.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in calls and d.id
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], parser


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_every_split_parses_alike(name, text, content, calls):
    whole_content, whole_calls, parser = run(TOOL_PARSERS[name], text, [])
    assert whole_content == content
    assert [(n, json.loads(a)) for n, a in whole_calls] == calls
    assert [(c.name, c.arguments) for c in parser.calls] == whole_calls
    for step in (1, 2, 3, 5, 8):
        assert run(TOOL_PARSERS[name], text, list(range(step, len(text), step)))[:2] == (whole_content, whole_calls)


SOUP = {  # each format's markers and fragments of its calls, to be put together in any order
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "run", "arguments": {"code": "a"}}', '{"name": "run"',
               ', "arguments": ', '{"n": 1}', "{", "}", '"'],
    "llama3_json": ["<|python_tag|>", '{"name": "run", "parameters": {"code": "a"}}', "; ", "{", "}"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[", "]", '{"name": "run", "arguments": {}}', ", ", "run", '{"n": 1}'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=run>", "</function>", "<parameter=code>",
                    "<parameter=n>", "</parameter>", "1", "<", ">"],
    "gemma4": ["<|tool_call>", "<tool_call|>", "call:run", "{", "}", '<|"|>', "code:", ",", "<|tool_response>"],
    "generic": ['{"tool_calls": [', '{"response": "', '{"name": "run", "arguments": {"n": 1}}', ", ", "]", "}",
                '"', "\\", "u00e9"],
}


@pytest.mark.parametrize("name", sorted(SOUP))
def test_any_text_of_markers_splits_alike(name):
    """Any text made of a format's markers and call fragments, with whitespace and other text between: however
    it is cut, the content and calls streamed are those of the whole text (and nothing raises)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    text = st.lists(st.sampled_from(SOUP[name] + [" ", "\n", "x"]), max_size=12).map("".join)

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(text, st.data())
    def check(whole, data):
        cuts = data.draw(st.lists(st.integers(1, max(1, len(whole) - 1)), max_size=6).map(sorted))
        expected = run(TOOL_PARSERS[name], whole, [])[:2]
        assert run(TOOL_PARSERS[name], whole, [c for c in dict.fromkeys(cuts) if c < len(whole)])[:2] == expected

    check()


def test_mistral_ids_are_nine_alphanumerics():
    parser = TOOL_PARSERS["mistral"]({})
    parser.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]', final=True)
    assert len(parser.calls[0].id) == 9 and parser.calls[0].id.isalnum()


REASONING = [  # (format, prompt, answer, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nplan\n</think>\n\nanswer", "plan\n", "answer"),
    ("qwen3", "<|im_start|>assistant\n", "  <thinking is not a tag", "", "  <thinking is not a tag"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "answer <think>x</think>", "",
     "answer <think>x</think>"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "plan</think>answer", "plan", "answer"),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut short </th", "cut short </th", ""),
    ("deepseek_r1", "x", "plan</think>\n\nanswer", "plan", "answer"),
    ("deepseek_r1", "x", "<think>\nplan</think>answer", "plan", "answer"),
    ("deepseek_r1", "x", "\n\nplan", "plan", ""),
    # harmony (gpt-oss): the prompt ends with <|start|>assistant; analysis is reasoning, final and preambles content
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>plan a<b<|end|><|start|>assistant"
     "<|channel|>final<|message|>answer <|end of it<|return|>", "plan a<b", "answer <|end of it"),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>final<|message|>just this", "", "just this"),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>cut sho", "cut sho", ""),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>commentary<|message|>Looking it up.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "", "Looking it up.Done."),
    ("openai_gptoss", "<|start|>assistant", "no harmony header at all", "", "no harmony header at all"),
    # Gemma 4: thinking on, the answer opens the thought channel; off, the prompt ends with an empty one
    ("gemma4", "<|turn>model\n", "<|channel>thought\nplan a<b\n<channel|>the answer", "plan a<b\n", "the answer"),
    ("gemma4", "<|turn>model\n<|channel>thought\n<channel|>", "just <|channel>this", "", "just <|channel>this"),
    ("gemma4", "<|turn>model\n", "<|channel>thought\ncut sh", "cut sh", ""),
    # a call (recipient after or before the channel) goes on to the content in the tool parser's canonical form
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>need f<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>', "need f",
     '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'),
    ("openai_gptoss", "<|start|>assistant", ' to=functions.g<|channel|>commentary json<|message|>{"b": "<|"}',
     "", '<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{"b": "<|"}<|call|>'),
]


@pytest.mark.parametrize("fmt,prompt,answer,reasoning,content", REASONING)
def test_reasoning_splits_alike_streamed_and_whole(fmt, prompt, answer, reasoning, content):
    f = REASONING_FORMATS[fmt]
    assert f.parser(prompt).feed(answer, final=True) == (reasoning, content)
    for step in (1, 2, 3):
        p, r, c = f.parser(prompt), "", ""
        pieces = [answer[i:i + step] for i in range(0, len(answer), step)]
        for k, piece in enumerate(pieces):
            a, b = p.feed(piece, final=k == len(pieces) - 1)
            r, c = r + a, c + b
        assert (r, c) == (reasoning, content)


def test_harmony_reasoning_then_tool_parser_streamed_and_whole():
    """gpt-oss's answer through both parsers as the server chains them (reasoning first, its content to the tool
    parser): reasoning, a preamble, then one call, alike for every split."""
    answer = ("<|channel|>analysis<|message|>User wants code run.<|end|><|start|>assistant<|channel|>commentary"
              "<|message|>Running it.<|end|><|start|>assistant<|channel|>commentary to=functions.run <|constrain|>json"
              '<|message|>{"code": "print(1)", "n": 2}<|call|>')
    for step in (1, 2, 3, 7, len(answer)):
        harmony, tools = REASONING_FORMATS["openai_gptoss"].parser("<|start|>assistant"), TOOL_PARSERS["openai"](RUN)
        reasoning, content, args = "", "", ""
        pieces = [answer[i:i + step] for i in range(0, len(answer), step)]
        for k, piece in enumerate(pieces):
            r, c = harmony.feed(piece, final=k == len(pieces) - 1)
            c, deltas = tools.feed(c, final=k == len(pieces) - 1)
            reasoning, content, args = reasoning + r, content + c, args + "".join(d.arguments for d in deltas)
        assert (reasoning, content) == ("User wants code run.", "Running it.")
        assert [c.name for c in tools.calls] == ["run"] and json.loads(args) == {"code": "print(1)", "n": 2}


MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


def _harmony_split(text: str, cuts: list[int]) -> tuple[str, str]:
    parser = REASONING_FORMATS["openai_gptoss"].parser("<|start|>assistant")
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = [parser.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def test_harmony_messages_split_alike_at_any_cut():
    """Any sequence of analysis / final / commentary messages, their bodies any text without whole markers (parts of
    them included): reasoning is the analysis bodies, content the others', however the text is cut into pieces."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    body = st.lists(st.sampled_from(list("ab <|>\n") + ["<|en", "d|>", "<|ca", "ll", "<|start", "|>"]), max_size=12) \
        .map("".join).filter(lambda t: not any(m in t for m in MARKERS))
    message = st.tuples(st.sampled_from(["analysis", "final", "commentary"]), body,
                        st.sampled_from(["<|end|>", "<|return|>"]))

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.lists(message, min_size=1, max_size=4), st.data())
    def check(messages, data):
        text = "<|start|>assistant".join(f"<|channel|>{ch}<|message|>{b}{end}" for ch, b, end in messages)
        reasoning = "".join(b for ch, b, _ in messages if ch == "analysis")
        content = "".join(b for ch, b, _ in messages if ch != "analysis")
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=6))))
        assert _harmony_split(text, []) == (reasoning, content)
        assert _harmony_split(text, [c for c in cuts if c < len(text)]) == (reasoning, content)

    check()


def test_harmony_parser_takes_any_text():
    """Text that is no harmony at all (any characters, markers anywhere) never raises, and streamed equals whole."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    text = st.lists(st.sampled_from([*MARKERS, "analysis", "final", " to=functions.f", "x", "<|", "\n"]), max_size=16)

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(text, st.data())
    def check(parts, data):
        whole = "".join(parts)
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(whole) - 1)), max_size=5))))
        assert _harmony_split(whole, [c for c in cuts if c < len(whole)]) == _harmony_split(whole, [])

    check()


@pytest.mark.parametrize("special", [True, False], ids=["special-quotes", "text-quotes"])
def test_gemma4_call_grammars_compile(special):
    """Gemma 4's call grammar (its value syntax) is valid Lark for llguidance for every schema shape, with its
    markers as special tokens or as text."""
    import llguidance

    from lmkit.serve.tools.grammar import tool_call_grammar

    ids = {'<|"|>': 7, "<|tool_call>": 8, "<tool_call|>": 9}
    tools = {f"f{i}": schema for i, schema in enumerate(GEMMA4_SCHEMAS)}
    lark = tool_call_grammar(TOOL_PARSERS["gemma4"], tools, True, lambda t: ids.get(t) if special else None)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", lark)) == ""
    assert ("<[7]>" in lark) == special
