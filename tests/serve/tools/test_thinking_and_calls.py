"""Tool calls interleaved with thinking, as Qwen3 (``hermes`` JSON calls) and Qwen3.5 (``qwen3_coder`` XML calls)
write them, through the chain the server runs (serve/stream.py Choice: the reasoning parser, then the tool
parser): a call written inside the thinking is reasoning, never a call; text between calls is content; several
calls keep their order; and the streamed deltas, however the text is cut (at every single boundary, character by
character, in random chunks), reassemble to the parse of the whole text."""

from __future__ import annotations

import json
import random

import pytest

from lmkit.messages import Response
from lmkit.serve.reasoning import REASONING_FORMATS
from lmkit.serve.stream import Choice, OutputFormat
from lmkit.serve.tools.parsers import TOOL_PARSERS

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "search": {"type": "object", "properties": {"q": {"type": "string"}}}}

QWEN3 = "<|im_start|>assistant\n"  # Qwen3: the model opens <think> itself
THINKING = "<|im_start|>assistant\n<think>\n"  # Qwen3-2507 thinking, Qwen3.5: the prompt opens it
NOT_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false

_WEATHER_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
_SEARCH_XML = "<tool_call>\n<function=search>\n<parameter=q>\nnot now\n</parameter>\n</function>\n</tool_call>"

GOLDEN = {  # name: (prompt, parser, answer, reasoning, content, [(name, arguments)])
    "qwen3-call-inside-thinking": (
        QWEN3, "hermes",
        f"<think>\nThe user wants the weather. A call looks like {_WEATHER_ROME} so I do that.\n</think>\n\n"
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        f"The user wants the weather. A call looks like {_WEATHER_ROME} so I do that.\n", "Let me look.\n",
        [("get_weather", {"city": "Paris", "days": 2})]),
    "qwen3-text-between-calls": (
        THINKING, "hermes",
        'Two lookups.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "And  then,\tthe  news:\n"
        '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" </tool_call> <think> in it"}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>\n\nDone  now.',
        "Two lookups.", "And  then,\tthe  news:\nDone  now.",
        [("get_weather", {"city": "Paris"}), ("search", {"q": 'a "quoted" </tool_call> <think> in it'}),
         ("search", {"q": "x"})]),
    "qwen3-thinking-cut-short-in-a-call": (
        QWEN3, "hermes", '<think>\nI will call <tool_call>\n{"name": "search", "arguments": {"q": "cu',
        'I will call <tool_call>\n{"name": "search", "arguments": {"q": "cu', "", []),
    "qwen3.5-call-inside-thinking": (
        THINKING, "qwen3_coder",
        f"Format: {_SEARCH_XML} is how.\n</think>\n\nSearching.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "Then:  more\ttext\n<tool_call>\n<function=search>\n<parameter=q>\nline one\n  line two \"q\" <b></param\n"
        "</parameter>\n</function>\n</tool_call>",
        f"Format: {_SEARCH_XML} is how.\n", "Searching.\n\nThen:  more\ttext\n",
        [("get_weather", {"city": "São Paulo", "days": 3}), ("search", {"q": 'line one\n  line two "q" <b></param'})]),
    "qwen3.5-not-thinking": (
        NOT_THINKING, "qwen3_coder",
        "<tool_call>\n<function=search>\n<parameter=q>\nx</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        "", "", [("search", {"q": "x"}), ("get_weather", {"city": "Oslo"})]),
    "qwen3.5-thinking-then-text-only": (
        THINKING, "qwen3_coder", "No tool needed <tool_call> here.\n</think>\n\nIt is <b>sunny</b>. <tool_",
        "No tool needed <tool_call> here.\n", "It is <b>sunny</b>. <tool_", []),
}


def split(prompt: str, parser: str, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, [(name, arguments text)], finish_reason) of ``text`` streamed in pieces cut at ``cuts``,
    as the server's Choice turns engine deltas into events."""
    fmt = REASONING_FORMATS["qwen3"]
    reasoning_parser, tool_parser = OutputFormat(fmt, fmt.starts_inside(prompt), TOOL_PARSERS[parser], TOOLS).parsers()
    choice = Choice(0, reasoning_parser=reasoning_parser, tool_parser=tool_parser)
    bounds = [0, *cuts, len(text)]
    reasoning, content, calls, finish = "", "", {}, None
    for k in range(len(bounds) - 1):
        last = k == len(bounds) - 2
        event = choice.event(Response(text[bounds[k]:bounds[k + 1]], [], 0, k + 1), "stop" if last else None)
        reasoning, content = reasoning + event.reasoning, content + event.text
        for d in event.tool_calls:
            if d.name is not None:  # a call opens once, in order, with its id
                assert d.index == len(calls) and d.id, d
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
        finish = event.finish_reason or finish
    calls = [tuple(calls[i]) for i in sorted(calls)]
    assert [(c.name, c.arguments) for c in choice.tool_calls] == calls  # the whole answer's calls
    return reasoning, content, calls, finish


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_streams_split_alike_at_every_cut(name):
    prompt, parser, text, reasoning, content, calls = GOLDEN[name]
    whole = split(prompt, parser, text, [])
    assert whole[:2] == (reasoning, content)
    assert [(n, json.loads(a)) for n, a in whole[2]] == calls
    assert whole[3] == ("tool_calls" if calls else "stop")
    for cut in range(1, len(text)):
        assert split(prompt, parser, text, [cut]) == whole, (cut, text[:cut][-20:])
    assert split(prompt, parser, text, list(range(1, len(text)))) == whole
    rng = random.Random(name)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3)))
        assert split(prompt, parser, text, cuts) == whole, cuts


def _render_call(parser: str, name: str, arguments: dict) -> str:
    if parser == "hermes":
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_any_interleaving_splits_alike():
    """An optional thinking block (which may write a call), then text and calls in any order, their texts made of
    marker fragments, whitespace runs and quotes: the calls outside the thinking are the calls, the thinking is the
    reasoning, the texts (the line break after a call is layout) the content, for any cuts."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    pieces = ["a", "Z", " ", "  ", "\n", "\t", "<", ">", "/", '"', "{", "}", "é", "<tool_", "<tool_call",
              "</tool_call", "<function=", "</parameter", "</think", "<think"]
    words = st.lists(st.sampled_from(pieces), max_size=8).map("".join)
    text = st.tuples(st.sampled_from("abc"), words, st.sampled_from("xyz")).map("".join).filter(
        lambda t: "</think>" not in t and "<tool_call>" not in t)
    value = words.filter(lambda t: "</parameter>" not in t)
    call = st.tuples(st.sampled_from(sorted(TOOLS)), value)
    item = st.one_of(st.tuples(st.just("text"), text), st.tuples(st.just("call"), call))

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.sampled_from(["hermes", "qwen3_coder"]), st.one_of(st.none(), text), st.booleans(),
                      st.lists(item, min_size=1, max_size=5), st.data())
    def check(parser, thought, call_in_thought, items, data):
        rendered, content, calls = [], [], []
        for i, (kind, x) in enumerate(items):
            if kind == "text":
                content.append(x + ("\n" if i < len(items) - 1 else ""))
                rendered.append(x)
            else:
                arguments = {"q" if x[0] == "search" else "city": x[1]}
                calls.append((x[0], arguments))
                rendered.append(_render_call(parser, x[0], arguments))
        answer = "\n".join(rendered)
        reasoning = ""
        if thought is not None:
            inner = thought + (" " + _render_call(parser, "search", {"q": "inside"}) if call_in_thought else "")
            answer, reasoning = f"<think>\n{inner}\n</think>\n\n{answer}", inner + "\n"
        whole = split(QWEN3, parser, answer, [])
        assert whole[:2] == (reasoning, "".join(content))
        assert [(n, json.loads(a)) for n, a in whole[2]] == calls
        cuts = data.draw(st.lists(st.integers(1, max(1, len(answer) - 1)), max_size=8).map(sorted))
        assert split(QWEN3, parser, answer, [c for c in dict.fromkeys(cuts) if c < len(answer)]) == whole

    check()
