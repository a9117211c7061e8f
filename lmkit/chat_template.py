"""Chat templates rendered as transformers renders them (its chat template utilities), with jinja2 alone and in
the same sandboxed environment, so that the engine and the servers need neither transformers nor torch for them.
Where a model folder keeps its template: lmkit/tokenizer.py."""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from typing import Any, Mapping


def render_chat_template(template: str | Mapping[str, str], messages: list[dict], add_generation_prompt: bool,
                         special_tokens: Mapping[str, str], tools: list[dict] | None = None,
                         template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The text transformers' ``apply_chat_template(..., tokenize=False)`` renders: keys whose value is None are
    dropped, values are copied as plain JSON data, reasoning is aliased (``reasoning_content``, ``thinking``), the
    named special tokens are template variables, then ``template_kwargs`` (e.g. ``enable_thinking``); ``tools``
    are OpenAI's function definitions (``{"type": "function", "function": {...}}``). Of named templates,
    "default" is used, or "tool_use" where there are tools and one has that name."""
    if not isinstance(template, str):
        if tools and "tool_use" in template:
            template = {"default": template["tool_use"]}
        if "default" not in template:
            raise ValueError(f"the tokenizer has named chat templates ({', '.join(sorted(template))}) but none named "
                             "'default': give a template (chat_template=..., or --chat-template FILE)")
        template = template["default"]
    import jinja2

    chat = [_alias_reasoning(_plain_data({k: v for k, v in m.items() if v is not None})) for m in messages]
    try:
        return _compile_chat_template(template).render(**{
            **_plain_data(dict(special_tokens)), **_plain_data(dict(template_kwargs or {})),
            "messages": chat, "tools": _plain_data(tools) if tools else None, "documents": None,
            "add_generation_prompt": add_generation_prompt})
    except (jinja2.TemplateError, TypeError) as e:  # a syntax error, raise_exception, an input it cannot take
        raise ValueError(f"the chat template cannot render these messages: {e}") from None


def _plain_data(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON types only (what the sandbox lets a template see); other objects
    become a placeholder naming their type, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy scalars) carry methods a template could call: strip them
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # np.bool_ would be a truthy placeholder
        return _plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """Reasoning under any of its names is also given as ``reasoning_content`` and ``thinking`` (gpt-oss)."""
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    return _jinja_environment().from_string(template)


@lru_cache(maxsize=1)
def _jinja_environment():
    """transformers' chat template environment: an immutable sandbox, trim_blocks and lstrip_blocks, loop
    controls, ``{% generation %}`` blocks (rendered as their body), ``raise_exception``, ``strftime_now``, a
    ``tojson`` that keeps non-ASCII and does not escape HTML, and ``dict``/``namespace`` that refuse dunders."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ValueError(f"chat templates need jinja2 >= 3.1.6 (older ones have known sandbox escapes), found "
                         f"{jinja2.__version__}: pip install -U jinja2")

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training masks: its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's Namespace signature, so that namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
