"""The body of POST /v1/responses (OpenAI's Responses API) as strict pydantic models, and its translation into the
chat request the server already answers.

The translation: ``instructions`` is a system message; ``input`` (a string: one user message; or a list of items)
is the chat that follows, where a message item is a chat message, ``function_call`` items are the tool calls of an
assistant message (with the ``reasoning`` item and the assistant text before them), and ``function_call_output``
items are tool messages. Function tools, ``tool_choice``, ``text.format`` (``response_format``) and the sampling
fields keep their meaning; with a required or named tool choice the answer is calls only (held to them by a
grammar), so ``text.format``, which shapes text, has nothing to shape (the Agents SDK sends both for an agent with
an output type).

Refused with a 400 naming the field, since each would change the answer and this server does not do it: built-in
tools and their calls (web search, file search, computers, MCP, ...), item references, non-text content (images,
files, audio), ``background``, ``conversation``, ``prompt`` templates, ``truncation: auto``, logprobs
(``include`` values, ``top_logprobs`` above 0) and a verbosity other than the default. Accepted with no effect:
``reasoning`` (the model thinks as its template says), ``service_tier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``safety_identifier``, ``max_tool_calls`` (it bounds built-in tools),
``stream_options``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from lmkit.serve.errors import bad_request
from lmkit.serve.protocol import FUNCTION_NAME, MAX_MESSAGE_PARTS, Penalty, Text, _text_or_texts

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
"""The input items this server reads."""
TEXT_PARTS = ("input_text", "output_text", "refusal")
"""The content parts this server reads (a text model)."""
SUPPORTED_INCLUDE: tuple[str, ...] = ()
"""``include`` values served (none: logprobs and encrypted reasoning are not)."""
MAX_METADATA_KEYS = 16


def _item_type(value) -> str | None:
    """An input item's type: its ``type``, or "message" for OpenAI's easy input message (a role, no type)."""
    if not isinstance(value, dict):
        return None
    return value.get("type") or ("message" if "role" in value else None)


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
              "reasoning": "Reasoning"}


def _item_tag(value) -> str | None:
    """The union tag of an input item (capitalized: errors name the field, not the branch)."""
    if isinstance(value, BaseModel):
        return _ITEM_TAGS.get(getattr(value, "type", None))
    return _ITEM_TAGS.get(_item_type(value))


class TextContent(BaseModel):
    # Clients send back what they received (annotations, logprobs, ...): extra fields are ignored in items.
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["input_text", "output_text"]
    text: Text


class RefusalContent(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["refusal"]
    refusal: Text

    @property
    def text(self) -> str:
        return self.refusal


ContentPart = Annotated[Union[TextContent, RefusalContent], Discriminator("type")]
Content = Annotated[Union[Annotated[Text, Tag("Text")], Annotated[list[ContentPart], Tag("Texts")]],
                    Discriminator(_text_or_texts)]


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function_call_output"]
    call_id: Text
    output: Annotated[Union[Annotated[Text, Tag("Text")], Annotated[list[TextContent], Tag("Texts")]],
                      Discriminator(_text_or_texts)]


class ReasoningPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None

    @property
    def text(self) -> str:
        """The thinking: its content, else its summary."""
        return "".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[Union[Annotated[MessageItem, Tag("Message")], Annotated[FunctionCallItem, Tag("FunctionCall")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
                            Annotated[ReasoningItem, Tag("Reasoning")]],
                      Discriminator(_item_tag)]


def chat_messages(items: list) -> list[dict]:
    """The chat messages (ChatMessage's shape) of Responses input items, in order: an assistant turn gathers the
    reasoning, text and function calls that follow one another into one message (reasoning_content, content,
    tool_calls); a function call output is a tool message."""
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message being gathered

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for item in items:
        if isinstance(item, MessageItem) and item.role != "assistant":
            close()
            messages.append({"role": item.role, "content": _text(item.content)})
            continue
        if isinstance(item, FunctionCallOutputItem):
            close()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            continue
        # an assistant turn: reasoning, then text, then calls; what comes out of that order starts another turn
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                close()
            turn = turn or {"role": "assistant", "content": ""}
            if item.text:  # an item of encrypted content only has none
                turn["reasoning_content"] = turn.get("reasoning_content", "") + item.text
        elif isinstance(item, MessageItem):
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                close()
            turn = turn or {"role": "assistant", "content": ""}
            turn["content"] = _text(item.content)
        else:
            turn = turn or {"role": "assistant", "content": ""}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    close()
    return messages


class FunctionTool(BaseModel):
    """A function tool, in the Responses API's flat shape."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None
    """Accepted: with tool_choice required or a named function, the arguments always validate."""

    def chat(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: Text


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["json_schema"]
    name: Text
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class PlainFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object"]


def _format_kind(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "Schema" if kind == "json_schema" else "Plain"


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: Annotated[Union[Annotated[JsonSchemaFormat, Tag("Schema")], Annotated[PlainFormat, Tag("Plain")]],
                      Discriminator(_format_kind)] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def response_format(self) -> dict | None:
        """The chat request's response_format (None: plain text)."""
        f = self.format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": f.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_obfuscation: bool = True
    """Accepted: the events carry no obfuscation padding."""


# the request fields lmkit adds (vLLM's names), passed to the chat request as they are
EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
              "min_tokens", "chat_template_kwargs")


class ResponsesRequest(BaseModel):
    """POST /v1/responses"""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text
    input: Annotated[Union[Annotated[Text, Tag("Text")], Annotated[list[InputItem], Tag("Texts")]],
                     Discriminator(_text_or_texts)] | None = None
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    store: bool | None = None
    """Keep the response for previous_response_id (default true; only where the server keeps responses)."""
    previous_response_id: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[Text] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Union[Text, dict] | None = None
    prompt: dict | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # OpenAI fields accepted with no effect here
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    safety_identifier: Text | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    # lmkit (vLLM-compatible) extensions
    seed: Annotated[int, Field(ge=-2**63, lt=2**64)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_kinds(cls, data):
        """Refuses, naming the field, the input items, content parts, tools and tool choices of kinds this server
        does not serve, and an input of too many items and parts, before pydantic builds an object for each."""
        if not isinstance(data, dict):
            return data
        items = data.get("input")
        if isinstance(items, list):
            num_parts = len(items)
            if num_parts > MAX_MESSAGE_PARTS:
                raise bad_request(f"input has {num_parts} items; at most {MAX_MESSAGE_PARTS} are allowed", "input")
            for i, item in enumerate(items):
                kind = _item_type(item)
                if kind is not None and kind not in ITEM_TYPES:
                    raise bad_request(f"input[{i}] is a '{kind}' item, which this server does not read: it runs no "
                                      f"built-in tools and keeps no items to reference; send {', '.join(ITEM_TYPES)} "
                                      "items", f"input[{i}].type")
                parts = item.get("content") if kind == "message" else None
                if isinstance(parts, list):
                    num_parts += len(parts)
                    for j, part in enumerate(parts):
                        part_type = part.get("type") if isinstance(part, dict) else None
                        if part_type is not None and part_type not in TEXT_PARTS:
                            raise bad_request(f"input[{i}].content[{j}] is '{part_type}' content: this model reads "
                                              f"text only ({', '.join(TEXT_PARTS)})", f"input[{i}].content[{j}].type")
            if num_parts > MAX_MESSAGE_PARTS:
                raise bad_request(f"input has {num_parts} items and content parts in all; at most "
                                  f"{MAX_MESSAGE_PARTS} are allowed", "input")
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                raise bad_request(f"tools[{i}] is a '{kind}' tool: this server runs no built-in tools; give "
                                  "function tools ({'type': 'function', 'name': ..., 'parameters': {...}})",
                                  f"tools[{i}].type")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            raise bad_request(f"tool_choice of type '{choice.get('type')}' is not supported by this server: give "
                              "none, auto, required or {'type': 'function', 'name': ...}", "tool_choice")
        return data

    @model_validator(mode="after")
    def _served(self):
        """Refuses the settings that would change the answer in a way this server does not follow."""
        refused = [("background", self.background, "runs every response in the request (no background runs)"),
                   ("conversation", self.conversation is not None, "keeps no conversations (previous_response_id "
                                                                    "chains responses where the server keeps them)"),
                   ("prompt", self.prompt is not None, "has no stored prompt templates"),
                   ("truncation", self.truncation == "auto", "does not truncate the input (a too long input is a "
                                                             "400)"),
                   ("text.verbosity", self.text is not None and self.text.verbosity not in (None, "medium"),
                    "has no verbosity setting"),
                   ("top_logprobs", bool(self.top_logprobs), "returns no logprobs on /v1/responses")]
        for param, is_set, why in refused:
            if is_set:
                raise bad_request(f"{param} is not supported: this server {why}", param)
        unserved = [v for v in self.include or [] if v not in SUPPORTED_INCLUDE]
        if unserved:
            raise bad_request(f"include value '{unserved[0]}' is not supported by this server (it returns no logprobs, "
                              "encrypted reasoning or built-in tool results)", "include")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise bad_request(f"metadata has {len(self.metadata)} keys; at most {MAX_METADATA_KEYS} are allowed",
                              "metadata")
        if self.input is None and self.previous_response_id is None:
            raise bad_request("Missing required parameter: 'input'.", "input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise bad_request("input is empty: give a string or at least one item", "input")
        return self

    @property
    def n(self) -> int:
        """Completions of the request (one: the Responses API has no n)."""
        return 1

    def input_messages(self) -> list[dict]:
        """The chat messages of ``input`` (without the instructions)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return chat_messages(self.input)

    def chat_body(self, messages: list[dict]) -> dict:
        """The body of the chat request that answers this one, given its whole chat (history and input)."""
        body: dict = {"model": self.model, "messages": messages}
        if self.instructions is not None:
            body["messages"] = [{"role": "system", "content": self.instructions}, *messages]
        fields = {"max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
                  **{name: getattr(self, name) for name in EXTENSIONS}}
        body.update({k: v for k, v in fields.items() if v is not None})
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        forced = bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, FunctionChoice))
        if self.text is not None and self.text.response_format() is not None and not forced:
            body["response_format"] = self.text.response_format()
        return body

    def settings(self) -> dict:
        """The fields of the Response object that repeat this request's settings."""
        tool_choice = self.tool_choice or "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "max_tool_calls": self.max_tool_calls, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning.model_dump() if self.reasoning else {"effort": None, "summary": None},
                "service_tier": "default",
                "text": {"format": {"type": "text"}, **(self.text.model_dump(by_alias=True, exclude_none=True)
                                                        if self.text else {})},
                "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "top_logprobs": 0, "truncation": "disabled", "user": self.user, "metadata": self.metadata or {}}


PARAM_OF_CHAT = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                 "response_format": "text.format"}
"""The Responses field of a chat request's field, where the names differ (errors name the field sent)."""


def responses_param(chat_param: str | None) -> str | None:
    """The Responses API's name of a chat request's parameter: tools[i].function.x is tools[i].x, any part of
    messages is input (whose items the instructions and a previous response's items come before)."""
    if chat_param is None:
        return None
    head = re.match(r"[A-Za-z_]*", chat_param).group(0)
    if head == "messages":
        return "input"
    if head == "tools":
        return chat_param.replace(".function.", ".", 1)
    return PARAM_OF_CHAT.get(head, head) + chat_param[len(head):]
