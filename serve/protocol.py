"""The OpenAI request bodies as pydantic models (strict types, unknown fields refused as OpenAI refuses
them), plus the fields lmkit adds (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, ...).

Here are the rules of the HTTP shape: types, OpenAI's ranges, list lengths, and that every string is valid
Unicode (JSON can escape a lone surrogate, "\\ud800", which no tokenizer or UTF-8 encoder accepts). What the
engine can do with a value (int32 and float32 ranges, non-empty stop strings, ...) is GenerationConfig's rule,
checked when the server builds one. Both are 400s naming the parameter, before anything is tokenized.
Unions are tagged (a string or a list; a prompt list by its first item), so a long list is validated once,
not once per branch, and an error names the branch the value was meant for.
Fields OpenAI defines that lmkit does not implement are accepted only with values that change nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from lmkit.serve.errors import bad_request
from lmkit.structured import StructuredOutput, StructuredOutputError
from lmkit.tokenizer import check_valid_unicode

MAX_STOP_STRINGS = 16
"""Stop strings per request: each is searched for after every token."""
MAX_STOP_CHARS = 1024
"""Characters per stop string (its search table is built when the request starts)."""
MAX_STOP_TOKEN_IDS = 1024
"""stop_token_ids per request: each is compared with every token."""
MAX_PROMPTS = 2048
"""Prompts in one text completion request."""
MAX_MESSAGE_PARTS = 8192
"""Messages plus their content parts in one chat request (validating each costs the event loop ~2 us)."""


Text = Annotated[str, AfterValidator(check_valid_unicode)]
"""A string that is valid Unicode (no lone surrogates)."""


def _short_stop(text: str) -> str:
    if len(text) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, this one {len(text)}")
    return text


StopText = Annotated[Text, AfterValidator(_short_stop)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _text_or_texts(value) -> str:
    return "Text" if isinstance(value, str) else "Texts"


def _first_item_kind(value) -> str:
    """The tag of a prompt: by the value's type, then its first item's."""
    if isinstance(value, str):
        return "Text"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, int) and not isinstance(first, bool):
        return "TokenIds"
    if isinstance(first, list):
        return "TokenIdLists"
    return "Texts"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    """Send one more chunk before [DONE] with the usage of the whole request (and "usage": null before)."""
    continuous_usage_stats: bool = False
    """vLLM's extension: put the running usage on every chunk."""


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: Text
    arguments: Text
    """The arguments as a JSON text (OpenAI's shape)."""


class ToolCallMessage(BaseModel):
    """A tool call of an earlier assistant message, sent back by the client."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_data(self) -> dict:
        """As chat templates read it: the arguments as an object where they are a JSON object (Llama's and
        Mistral's templates serialize them again), else the text as sent."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    # Clients send back what they received (refusal, audio: null, ...): extra fields are ignored here.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Union[Annotated[Text, Tag("Text")], Annotated[list[TextPart], Tag("Texts")]],
                       Discriminator(_text_or_texts)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_data(self) -> dict:
        """The message as chat templates read it (keys with no value left out)."""
        data = {"role": self.role, "content": self.text(),  # "" for a call without text: templates read it
                "name": self.name, "tool_call_id": self.tool_call_id,
                "reasoning_content": self.reasoning_content or self.reasoning,
                "tool_calls": [c.template_data() for c in self.tool_calls] if self.tool_calls else None}
        return {k: v for k, v in data.items() if v is not None}

    @property
    def num_chars(self) -> int:
        """Characters of the message's text that any template renders."""
        return len(self.text()) + len(self.name or "")


FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments object; none: a function without arguments."""
    strict: bool | None = None
    """Accepted: with tool_choice required or a named function, the arguments always validate."""

    @property
    def parameters_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text
    schema_: dict | bool | None = Field(default=None, alias="schema")
    """The JSON schema (OpenAI: optional; no schema means any JSON value)."""
    strict: bool | None = None
    """Accepted: the schema is always enforced."""
    description: Text | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object "
                              "({'name': ..., 'schema': {...}})", "response_format")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (extra_body): one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict | bool | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``, the answer expected
    (mostly): its tokens become speculative drafts; the answer never depends on it."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["content"]
    content: Union[Text, Annotated[list[TextPart], Field(min_length=1, max_length=MAX_MESSAGE_PARTS)]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: Annotated[Union[Annotated[StopText, Tag("Text")],
                          Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS), Tag("Texts")]],
                    Discriminator(_text_or_texts)] | None = None
    seed: Annotated[int, Field(ge=-2**63, lt=2**64)] | None = None
    """A 64-bit integer; negative seeds count from 2**64 (two's complement)."""
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # lmkit (vLLM-compatible) extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """vLLM's: the logprob of every prompt token and this many alternatives, as ``prompt_logprobs`` of the
    answer (not streamed)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prediction: Prediction | None = None
    speculative: bool | None = None
    """lmkit's: false decodes this request one token a step even when the server speculates (GenerationConfig)."""
    # structured output, vLLM's names (the chat endpoint also takes OpenAI's response_format)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is returned with whole answers only; leave out stream (or, on "
                              "/v1/completions, stream with echo and logprobs)", "prompt_logprobs")
        return self

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The request's constraint and the parameter that gave it; a 400 naming that parameter when the
        constraint is malformed, or the second one when the request gives more than one."""
        def schema(value):  # a JSON schema of `true` (or none given) admits any JSON value
            return {} if value is None or value is True else value

        given: list[tuple[str, dict]] = []  # (parameter, StructuredOutput fields)
        so = self.structured_outputs
        if so is not None:
            fields = {"json": None if so.json_ is None else schema(so.json_), "regex": so.regex,
                      "choice": so.choice, "grammar": so.grammar}
            given.append(("structured_outputs", {**{k: v for k, v in fields.items() if v is not None},
                                                 "json_object": bool(so.json_object)}))
        for name, field_name in (("guided_json", "json"), ("guided_regex", "regex"),
                                 ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, {field_name: schema(value) if field_name == "json" else value}))
        rf = getattr(self, "response_format", None)
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            given.append(("response_format", {"json": schema(rf.json_schema.schema_)}))
        if len(given) > 1:
            raise bad_request(f"give one structured output constraint, got {', '.join(n for n, _ in given)}",
                              given[1][0])
        if not given:
            return None
        name, fields = given[0]
        try:
            return StructuredOutput(**fields), name
        except StructuredOutputError as e:
            raise bad_request(str(e), name) from None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions"""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] | None = None
    """none: no tool is offered; auto (the default with tools): the model may call them; required: it calls
    one or more; a named function: it calls that one. required and named calls are enforced by a grammar."""
    parallel_tool_calls: bool = True
    """False: at most one call (enforced with required or a named function)."""
    chat_template_kwargs: dict | None = None
    """Extra variables of the chat template (e.g. ``{"enable_thinking": false}``)."""
    # OpenAI fields accepted with their neutral values only
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _few_enough_parts(cls, data):
        """Refuses a chat of too many messages and parts before pydantic builds an object for each of them."""
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and len(messages) <= MAX_MESSAGE_PARTS:
            num_parts = len(messages) + sum(len(m["content"]) for m in messages
                                            if isinstance(m, dict) and isinstance(m.get("content"), list))
        else:
            num_parts = len(messages) if isinstance(messages, list) else 0
        if num_parts > MAX_MESSAGE_PARTS:
            raise bad_request(f"messages has {num_parts} messages and content parts in all; at most "
                              f"{MAX_MESSAGE_PARTS} are allowed", "messages")
        return data

    @model_validator(mode="after")
    def _chat_consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise bad_request(f"tools has more than one function named {', '.join(twice)}", "tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise bad_request(f"tool_choice names the function '{self.tool_choice.function.name}', which is "
                                  f"not in tools ({', '.join(names) or 'none given'})", "tool_choice")
        elif self.tool_choice == "required" and not names:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise bad_request(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))} (the request's own "
                              "fields give them)", "chat_template_kwargs")
        return self

    @property
    def tool_choice_mode(self) -> str:
        """none | auto | required | named"""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def called_tools(self) -> dict[str, dict]:
        """The functions a required or named tool_choice lets the model call: name -> parameters schema."""
        tools = {t.function.name: t.function.parameters_schema for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice):
            return {self.tool_choice.function.name: tools[self.tool_choice.function.name]}
        return tools

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


Prompt = Annotated[Union[Annotated[Text, Tag("Text")],
                         Annotated[list[Text], Field(max_length=MAX_PROMPTS), Tag("Texts")],
                         Annotated[list[int], Tag("TokenIds")],
                         Annotated[list[list[int]], Field(max_length=MAX_PROMPTS), Tag("TokenIdLists")]],
                   Discriminator(_first_item_kind)]


def prompt_items(value, param: str) -> list[Union[str, list[int]]]:
    """The strings or token-id lists of a Prompt ``value``, each non-empty (a 400 naming ``param`` otherwise)."""
    if isinstance(value, str):
        items: list = [value]
    elif value and isinstance(value[0], int):  # the union's tag: every item is an int
        items = [value]
    else:
        items = list(value)
    if not items:
        raise bad_request(f"{param} is empty: give a string, a list of strings or token ids", param)
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request(f"{param} {i} is empty", param)
    return items


class CompletionRequest(SamplingFields):
    """POST /v1/completions"""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    """OpenAI's default for text completions; 0 (with echo or prompt_logprobs) only scores the prompt."""
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: Text | None = None

    @model_validator(mode="after")
    def _completion_consistent(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise bad_request("max_tokens 0 computes only the prompt: use it with echo or prompt_logprobs, or ask "
                              "for at least 1 token", "max_tokens")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The alternatives per prompt token the engine computes (echo's logprobs, prompt_logprobs), or None."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of this request: a batch of strings or token-id lists, each non-empty."""
        return prompt_items(self.prompt, "prompt")
