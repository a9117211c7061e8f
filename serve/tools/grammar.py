"""Grammars that make a model call tools (``tool_choice: "required"`` or a named function): the call is written
in its family's format, names one of the allowed functions, and its arguments validate against that function's
``parameters`` (llguidance's ``%json``); the generic format's answers, a call or a response, with any tool_choice;
and gpt-oss's structured answers in its harmony channels. Lark text for
lmkit.structured.StructuredOutput(grammar=...).
"""

from __future__ import annotations

import json
from typing import Callable

from lmkit.serve.reasoning import CHANNEL, CONSTRAIN, END, MESSAGE, START
from lmkit.serve.tools.generic import CALLS_KEY, RESPONSE_KEY
from lmkit.serve.tools.parsers import (GEMMA4_QUOTE, Gemma4ToolParser, GenericToolParser, HermesParser,
                                       Llama3JsonParser, MistralParser, OpenAIToolParser, Qwen3CoderParser,
                                       ToolParser)
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
                      special_token_id: Callable[[str], int | None], required: bool = True,
                      answer_schema: str | None = None) -> str:
    """Lark for one or more calls (``parallel``, where the family's template can render them back) of ``tools``
    (name -> parameters schema) in ``parser``'s format; not ``required`` (``tool_choice: "auto"``, for a format
    that ``constrains_auto``): a call or an answer, the answer JSON of ``answer_schema`` (a JSON schema's text)
    when given. ``special_token_id(text)`` is the id of a special token (Mistral's markers), None when the
    vocabulary lacks it."""
    names = list(tools)
    parallel = parallel and parser.supports_parallel
    if issubclass(parser, GenericToolParser):
        return generic_grammar(tools, parallel, required, answer_schema)
    if parser is Qwen3CoderParser:
        return _qwen3_coder_grammar(tools, parallel)
    if parser is OpenAIToolParser:
        return _harmony_grammar(tools, special_token_id)
    if parser is Gemma4ToolParser:
        return _Gemma4Grammar(special_token_id).calls(tools, parallel)
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


def generic_grammar(tools: dict[str, dict], parallel: bool, required: bool, answer_schema: str | None = None) -> str:
    """The generic format (generic.py): ``{"tool_calls": [call, ...]}`` (one call unless ``parallel``), each call
    ``{"name": ..., "arguments": ...}`` of one of ``tools`` (name -> parameters schema); unless ``required``,
    ``{"response": ...}`` instead, a string or a value of ``answer_schema`` (a JSON schema's text). Laid out as
    JSON_LAYOUT lays JSON out."""
    objects = "call_object: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "".join(
        f"call_{i}: {_json_rule(_call_object(name, schema, 'arguments'))}\n"
        for i, (name, schema) in enumerate(tools.items()))
    more = f" ({_lark_string(', ')} call_object)*" if parallel else ""
    calls = f'calls: {_lark_string("{" + json.dumps(CALLS_KEY) + ": [")} call_object{more} {_lark_string("]}")}\n'
    if required:
        return f"start: calls\n{calls}{objects}"
    value = answer_schema if answer_schema is not None else '{"type": "string"}'
    response = f'response: {_lark_string("{" + json.dumps(RESPONSE_KEY) + ": ")} %json {value} {_lark_string("}")}\n'
    return f"start: calls | response\n{calls}{response}{objects}"


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


class _Gemma4Grammar:
    """Gemma 4's calls, ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, in its value syntax (bare keys,
    strings between <|"|> marks, bare numbers): an object's properties in the schema's order, the optional ones
    may be left out; a string's enum and length enforced, a number's or boolean's schema by %json; arrays by their
    items' schema and item counts; a value of no known type any Gemma value."""

    def __init__(self, special_token_id: Callable[[str], int | None]):
        self.quote = _token_rule(GEMMA4_QUOTE, special_token_id)
        self.quote_special = special_token_id(GEMMA4_QUOTE) is not None
        self.start = _token_rule(Gemma4ToolParser.start, special_token_id)
        self.end = _token_rule(Gemma4ToolParser.end, special_token_id)
        self.rules: list[str] = []

    def calls(self, tools: dict[str, dict], parallel: bool) -> str:
        functions = []
        for i, (name, schema) in enumerate(tools.items()):
            functions.append(f"f_{i}")
            self.rules.append(f"f_{i}: {_lark_string(Gemma4ToolParser.prefix + name)} {self._object(schema, f'f{i}')}")
        call = f"call: {self.start} ({' | '.join(functions)}) {self.end}"
        self.rules.append('gvalue: gstring | /-?[0-9][0-9.eE+-]*/ | "true" | "false" | "null" | '
                          '"{" (gkey ":" gvalue ("," gkey ":" gvalue)*)? "}" | "[" (gvalue ("," gvalue)*)? "]"')
        self.rules.append("gkey: /[A-Za-z_][A-Za-z0-9_.-]*/")
        self.rules.append(f"gstring: {self._string('gtext', None, None)}")
        return "\n".join([f"start: call{'+' if parallel else ''}", call, *self.rules]) + "\n"

    def _string(self, rule: str, low: int | None, high: int | None) -> str:
        """A string value: its text (rule ``rule``) between quote marks."""
        repeat = f"{{{low or 0},{int(high)}}}" if high is not None else ("*" if not low else f"{{{low},}}")
        if self.quote_special:  # text cannot hold the special token: it ends where the mark comes
            self.rules.append(f"{rule}: /(.|\\n){repeat}/")
            return f"{self.quote} {rule} {self.quote}"
        self.rules.append(f"{rule}[lazy]: /(.|\\n){repeat}<\\|\"\\|>/")
        return f"{self.quote} {rule}"

    def _value(self, schema, name: str) -> str:
        schema = schema if isinstance(schema, dict) else {}
        kind = schema.get("type")
        if kind == "string" and isinstance(schema.get("enum"), list):
            return f"{self.quote} ({' | '.join(_lark_string(str(v)) for v in schema['enum'])}) {self.quote}"
        if kind == "string":
            return self._string(f"t_{name}", schema.get("minLength"), schema.get("maxLength"))
        if kind in ("integer", "number", "boolean", "null"):
            return _json_rule(schema)
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            return self._object(schema, name)
        if kind == "array":
            item = f"i_{name}"
            self.rules.append(f"{item}: {self._value(schema.get('items'), name + '_i')}")
            low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
            high = None if high is None else max(int(high), low)
            if high == 0:
                return '"[" "]"'
            # item ("," item) x (low - 1), then up to high - low more, each optional after the one before
            required = " ".join([item] + [f'"," {item}'] * (max(low, 1) - 1))
            extra = max(high - max(low, 1), 0) if high is not None else None
            more = f'("," {item})*' if extra is None else \
                "".join(f'("," {item} ' for _ in range(extra)) + ")?" * extra
            items = f"{required} {more}".strip()
            return f'"[" {items if low > 0 else f"({items})?"} "]"'
        return "gvalue"

    def _object(self, schema: dict, name: str) -> str:
        """``{key:value,...}``: each property in order, the optional ones may be left out (chains of rules, so that
        a comma stands only between two present properties); no properties: any Gemma object."""
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
        if properties is None:
            return '"{" (gkey ":" gvalue ("," gkey ":" gvalue)*)? "}"'
        required = set(schema.get("required") or [])
        keys = list(properties)
        for k, key in enumerate(keys):
            self.rules.append(f"p_{name}_{k}: {_lark_string(key + ':')} {self._value(properties[key], f'{name}_{k}')}")

        def rest(k: int) -> str:
            if k == len(keys):
                return ""
            item = f'"," p_{name}_{k}'
            head = item if keys[k] in required else f"({item})?"
            return f"{head} {rest(k + 1)}".strip()

        def first(k: int) -> str | None:
            if k == len(keys):
                return None
            present = f"p_{name}_{k} {rest(k + 1)}".strip()
            if keys[k] in required:
                return present
            other = first(k + 1)
            return f"({present})?" if other is None else f"({present} | {other})"

        body = first(0)
        return f'"{{" {body} "}}"' if body else '"{" "}"'
