"""Grammars that make a model call tools (``tool_choice: "required"`` or a named function): the call is written
in its family's format, names one of the allowed functions, and its arguments validate against that function's
``parameters`` (llguidance's ``%json``); and gpt-oss's structured answers in its harmony channels. Lark text for
lmkit.structured.StructuredOutput(grammar=...).
"""

from __future__ import annotations

import json
from typing import Callable

from lmkit.serve.reasoning import CHANNEL, CONSTRAIN, END, MESSAGE, START
from lmkit.serve.tools.parsers import (HermesParser, Llama3JsonParser, MistralParser, OpenAIToolParser,
                                       Qwen3CoderParser, ToolParser)
from lmkit.structured import JSON_LAYOUT, StructuredOutput


_NL = "\n"  # (a name: f-string expressions cannot hold a backslash)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _call_object(name: str, parameters: dict, arguments_key: str) -> dict:
    """The JSON schema of ``{"name": name, arguments_key: {...}}`` in that key order."""
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def tool_call_grammar(parser: type[ToolParser], tools: dict[str, dict], parallel: bool,
                      special_token_id: Callable[[str], int | None]) -> str:
    """Lark for one or more calls (``parallel``, where the family's template can render them back) of ``tools``
    (name -> parameters schema) in ``parser``'s format.
    ``special_token_id(text)`` is the id of a special token (Mistral's markers), None when the vocabulary lacks it."""
    names = list(tools)
    parallel = parallel and parser.supports_parallel
    if parser is Qwen3CoderParser:
        return _qwen3_coder_grammar(tools, parallel)
    if parser is OpenAIToolParser:
        return _harmony_grammar(tools, special_token_id)
    key = "parameters" if parser is Llama3JsonParser else "arguments"
    objects = "call_object: " + " | ".join(f"call_{i}" for i in range(len(names))) + "\n" + "".join(
        f"call_{i}: {_json_rule(_call_object(name, tools[name], key))}\n" for i, name in enumerate(names))
    if parser is HermesParser:
        call = f'call: {_lark_string(HermesParser.start + _NL)} call_object {_lark_string(_NL + HermesParser.end)}'
        return f'start: call{" (" + _lark_string(_NL) + " call)*" if parallel else ""}\n{call}\n{objects}'
    if parser is Llama3JsonParser:
        return f'start: call_object{" (" + _lark_string("; ") + " call_object)*" if parallel else ""}\n{objects}'
    if parser is MistralParser:
        marker = _token_rule(MistralParser.marker, special_token_id)
        args = special_token_id(MistralParser.args_marker)
        if args is not None:  # name[ARGS]{...} (tokenizers with an [ARGS] control token)
            alternatives = " | ".join(
                f"{_lark_string(name)} <[{args}]> {_json_rule(tools[name])}" for name in names)
            return f"start: call{'+' if parallel else ''}\ncall: {marker} ({alternatives})\n"
        more = f' ({_lark_string(", ")} call_object)*' if parallel else ""
        return f'start: {marker} "[" call_object{more} "]"\n{objects}'
    raise ValueError(f"no grammar for the {parser.name} tool call format")


def _harmony_markers(special_token_id: Callable[[str], int | None]) -> dict[str, str]:
    """harmony's markers (special tokens) as Lark rules, by their text."""
    return {m: _token_rule(m, special_token_id) for m in (CHANNEL, MESSAGE, END, START, CONSTRAIN)}


def _harmony(answer_rule: str, t: dict[str, str]) -> str:
    """gpt-oss's answer as Lark: an optional analysis message (its reasoning, any text up to <|end|>), then one
    message, ``answer_rule`` (the rule ``answer``: what follows its <|channel|>); ``t``: _harmony_markers."""
    return (f"start: analysis? {t[CHANNEL]} answer\n"
            f'analysis: {t[CHANNEL]} "analysis" {t[MESSAGE]} thinking {t[END]} {t[START]} "assistant"\n'
            f"thinking: /(.|\\n)*/\n{answer_rule}")


def _harmony_grammar(tools: dict[str, dict], special_token_id: Callable[[str], int | None]) -> str:
    """gpt-oss's call: after any analysis, one call's message ``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{...}`` (the answer ends there; the template renders one call per message)."""
    t = _harmony_markers(special_token_id)
    calls = " | ".join(f'{_lark_string(f"commentary to=functions.{name} ")} {t[CONSTRAIN]} "json" {t[MESSAGE]} '
                       f"{_json_rule(schema)}" for name, schema in tools.items())
    return _harmony(f"answer: {calls}\n", t)


def harmony_answer_grammar(output: StructuredOutput, special_token_id: Callable[[str], int | None]) -> str:
    """gpt-oss's answer to a structured output (a JSON schema or object, a regex, a choice): after any analysis, the
    final channel's message in that form, as the model was trained to answer. (A grammar of the user's own is not
    wrapped: it applies from the answer's first token, harmony markers and all.)"""
    kind, text = output.source()
    if kind == "json_schema":
        form, extra = f"%json {text}", ""
    elif kind == "regex":
        form, extra = "/" + text.replace("/", "\\/") + "/", ""
    else:  # a choice: its one terminal, renamed
        assert output.choice is not None, "only choices come as Lark here"
        form, extra = "FORM", "FORM: " + text.split("CHOICE: ", 1)[1] + "\n"
    t = _harmony_markers(special_token_id)
    return _harmony(f'answer: "final" {t[MESSAGE]} {form}\n{extra}', t)


def _token_rule(text: str, special_token_id: Callable[[str], int | None]) -> str:
    token = special_token_id(text)
    return f"<[{token}]>" if token is not None else _lark_string(text)


def _qwen3_coder_grammar(tools: dict[str, dict], parallel: bool) -> str:
    """XML calls: each of a function's parameters in order, optional ones may be left out; a string parameter
    is text up to the closing tag (its enum or length enforced; a pattern or format is not), any other a JSON
    value of its schema."""
    rules, functions = [], []
    closing = _lark_string("\n</parameter>")
    for i, (name, schema) in enumerate(tools.items()):
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, prop) in enumerate(properties.items()):
            prop = prop if isinstance(prop, dict) else {}
            head = _lark_string(f"<parameter={key}>\n")
            if prop.get("type") == "string" and isinstance(prop.get("enum"), list):
                value = "(" + " | ".join(_lark_string(str(v)) for v in prop["enum"]) + f") {closing}"
            elif prop.get("type", "string") == "string":  # raw text up to the closing tag, within its length
                low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
                repeat = f"{{{low},{int(high)}}}" if high is not None else ("*" if low == 0 else f"{{{low},}}")
                rules.append(f"text_{i}_{j}[lazy]: /(.|\\n){repeat}\\n<\\/parameter>/")
                value = f"text_{i}_{j}"
            else:
                value = f"{_json_rule(prop)} {closing}"
            rules.append(f"p_{i}_{j}: {head} {value} {_lark_string(_NL)}")
            parts.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
        functions.append(f"f_{i}")
        rules.append(f"f_{i}: {_lark_string(f'<function={name}>' + _NL)} {' '.join(parts)} "
                     f"{_lark_string('</function>' + _NL)}")
    call = (f'call: {_lark_string("<tool_call>" + _NL)} ({" | ".join(functions)}) '
            f'{_lark_string("</tool_call>")}')
    start = f'start: call{" (" + _lark_string(_NL) + " call)*" if parallel else ""}'
    return "\n".join([start, call, *rules]) + "\n"
