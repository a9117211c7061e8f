"""The OpenAI request bodies as pydantic models (strict types, unknown fields refused as OpenAI refuses
them), plus the fields lmkit adds (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, ...).

Ranges are checked here, so a bad value is a 400 naming its parameter before anything is tokenized.
Fields OpenAI defines that lmkit does not implement are accepted only with values that change nothing.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmkit.serve.errors import bad_request

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    """Send one more chunk before [DONE] with the usage of the whole request (and "usage": null before)."""
    continuous_usage_stats: bool = False
    """vLLM's extension: put the running usage on every chunk."""


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Clients send back what they received (refusal, tool_calls: null, ...): extra fields are ignored here.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: Union[str, Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)], None] = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # lmkit (vLLM-compatible) extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        return self

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
    # OpenAI fields accepted with their neutral values only
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _chat_consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported by this server", "response_format")
        if self.tools:
            raise bad_request("tools (function calling) are not supported by this server", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported by this server", "tool_choice")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions"""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for text completions
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_consistent(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported by this server (no prompt logprobs)", "echo")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of this request: a batch of strings or token-id lists, each non-empty."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise bad_request("prompt is empty: give a string, a list of strings or token ids", "prompt")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise bad_request(f"prompt {i} is empty", "prompt")
        return items
