"""What a caller passes per request (GenerationConfig) and gets back (Response)."""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from lmkit.structured import StructuredOutput

_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class GenerationConfigError(ValueError):
    """A GenerationConfig field the engine cannot accept. ``field`` names it; str(e) is "<field> <reason>"."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _to_float32(x) -> float | None:
    """``x`` rounded to the nearest float32, as the engine will hold it; None when ``x`` is not a real number or
    its float32 is not finite (1e308 overflows to inf)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        y = struct.unpack("f", struct.pack("f", float(x)))[0]
    except OverflowError:
        return None
    return y if math.isfinite(y) else None


@dataclass
class GenerationConfig:
    """Sampling and stopping parameters of one request. Validated on construction."""

    max_new_tokens: int = 512
    """Tokens to generate at most (the session length may cut it shorter); 0 computes only the prompt (to score
    it with prompt_logprobs), ending with finish_reason "length"."""
    min_new_tokens: int = 0
    """Tokens to generate before eos and stop ids may end the request."""
    do_sample: bool = False
    """False: greedy decoding, whatever the sampling fields say. True: sample with them."""
    temperature: float = 1.0
    """Softmax temperature when sampling (> 0; 0 means greedy)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off, 1: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1)."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already seen by this (> 0; 1 is off)."""
    random_seed: int | None = None
    """Seed of this request's generator: the same seed gives the same sample."""
    presence_penalty: float = 0.0
    """Subtract this from the logits of tokens already generated, in [-2, 2] (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token already generated, in [-2, 2] (OpenAI semantics)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (besides the model's eos ids); not part of the output."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the request when they appear in the text (across token boundaries)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string at the end of the text."""
    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks."""
    logprobs: int | None = None
    """Return each output token's logprob and this many most likely alternatives (0-20)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (after the first) and this many most likely alternatives (0-20),
    from the model's raw logits; computed during prefill (the request takes no prefix-cache hits)."""
    ignore_eos: bool = False
    """Keep generating past the model's eos ids."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    output_logits: bool = False
    """Return the logits of every position computed (prompt and output) in Response.logits."""
    structured_output: StructuredOutput | None = None
    """Constrain the completion to a JSON schema, regex, choice list or grammar (lmkit.structured); it ends
    with "stop" once the constraint is complete."""
    structured_output_after_token: int | None = None
    """The constraint starts after this token id is generated (a reasoning model's end of thinking)."""
    prediction: str | list[int] | None = None
    """The output expected, mostly (OpenAI's Predicted Outputs: the file a code edit rewrites, the text a rewrite
    keeps): when the engine speculates, its tokens are proposed as drafts and verified, so the parts the output
    repeats cost a fraction of a step each; the output itself never depends on it. Text, or token ids."""
    speculative: bool | None = None
    """Whether the engine may verify draft tokens for this request when it speculates (EngineConfig.speculative):
    None (the default) and True: yes; False: never. The output is the same either way: greedy and seeded sampled
    output token for token (the kernels are batch-invariant, AMX tiles included, so a verified row's logits are
    those of its one-token step to the bit, and each draw is seeded by its position), unseeded sampled output in
    distribution."""

    def __post_init__(self) -> None:
        """Checks every field against what the engine accepts (its SamplingParams holds int32 counts, float32
        values and a uint64 seed); raises GenerationConfigError naming the first field that does not fit."""
        def check(ok: bool, name: str, reason: str) -> None:
            if not ok:
                raise GenerationConfigError(name, reason)

        def check_float(name: str, in_range: Callable[[float], bool], rule: str) -> None:
            value = getattr(self, name)
            as_float32 = _to_float32(value)
            check(as_float32 is not None, name, "must be a finite number the engine's float32 holds (magnitude at "
                                                f"most {_FLOAT32_MAX:.4g}), got {value!r}")
            rounded = f" (as a float32: {as_float32!r})" if in_range(float(value)) else ""
            check(in_range(as_float32), name, f"must be {rule}, got {value!r}{rounded}")

        check(_is_int(self.max_new_tokens) and 0 <= self.max_new_tokens <= _INT32_MAX, "max_new_tokens",
              f"must be an integer in [0, {_INT32_MAX}] (0: only the prompt is computed), got "
              f"{self.max_new_tokens!r}")
        check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens",
              f"must be an integer >= 0, got {self.min_new_tokens!r}")
        check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
              f"must not exceed the tokens to generate at most ({self.max_new_tokens}), got {self.min_new_tokens}")
        check_float("temperature", lambda x: x >= 0, ">= 0 (0 means greedy)")
        check(_is_int(self.top_k) and 0 <= self.top_k <= _INT32_MAX, "top_k",
              f"must be an integer in [0, {_INT32_MAX}] (0 is off), got {self.top_k!r}")
        check_float("top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        check_float("min_p", lambda x: 0 <= x < 1, "in [0, 1)")
        check_float("repetition_penalty", lambda x: x > 0, "> 0 (1 is off)")
        check(self.random_seed is None or (_is_int(self.random_seed) and 0 <= self.random_seed < 2**64),
              "random_seed", f"must be an integer in [0, 2**64), got {self.random_seed!r}")
        check_float("presence_penalty", lambda x: -2 <= x <= 2, "in [-2, 2]")
        check_float("frequency_penalty", lambda x: -2 <= x <= 2, "in [-2, 2]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(isinstance(self.stop, (list, tuple)), "stop", f"must be a string or a list of strings, got {self.stop!r}")
        for i, s in enumerate(self.stop):
            check(isinstance(s, str) and s != "", "stop", f"must be non-empty strings, got {s!r} at index {i}")
        self.stop = list(self.stop)
        check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
              f"must be a list of token ids, got {self.stop_token_ids!r}")
        for i, t in enumerate(self.stop_token_ids):
            check(_is_int(t) and 0 <= t <= _INT32_MAX, "stop_token_ids",
                  f"must be token ids in [0, {_INT32_MAX}], got {t!r} at index {i}")
        self.stop_token_ids = list(self.stop_token_ids)
        check(_is_int(self.n) and 1 <= self.n <= _INT32_MAX, "n", f"must be an integer in [1, {_INT32_MAX}], "
                                                                  f"got {self.n!r}")
        check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
              "structured_output", f"must be a lmkit.StructuredOutput, got {type(self.structured_output).__name__}")
        check(self.structured_output_after_token is None or (_is_int(self.structured_output_after_token)
                                                             and 0 <= self.structured_output_after_token <= _INT32_MAX),
              "structured_output_after_token", f"must be a token id, got {self.structured_output_after_token!r}")
        check(self.prediction is None or isinstance(self.prediction, str) or
              (isinstance(self.prediction, (list, tuple)) and all(_is_int(t) and 0 <= t <= _INT32_MAX
                                                                  for t in self.prediction)),
              "prediction", f"must be a string or a list of token ids, got {type(self.prediction).__name__}")
        if isinstance(self.prediction, tuple):
            self.prediction = list(self.prediction)
        check(self.speculative is None or isinstance(self.speculative, bool), "speculative",
              f"must be true, false or None (auto), got {self.speculative!r}")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
              f"must be an integer in [0, 20], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")

    def check_limits(self, vocab_size: int, max_batch_size: int) -> None:
        """Raises GenerationConfigError when this config asks for more than a model of ``vocab_size`` token ids
        and an engine of ``max_batch_size`` sequences can give (stop_token_ids, n)."""
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise GenerationConfigError("stop_token_ids", f"must be token ids of this model's vocabulary "
                                                              f"[0, {vocab_size}), got {t} at index {i}")
        after = self.structured_output_after_token
        if after is not None and after >= vocab_size:
            raise GenerationConfigError("structured_output_after_token", f"must be a token id of this model's "
                                                                         f"vocabulary [0, {vocab_size}), got {after}")
        if isinstance(self.prediction, list):
            bad = next((i for i, t in enumerate(self.prediction) if t >= vocab_size), None)
            if bad is not None:
                raise GenerationConfigError("prediction", f"must be token ids of this model's vocabulary "
                                                          f"[0, {vocab_size}), got {self.prediction[bad]} at index {bad}")
        if self.n > max_batch_size:
            raise GenerationConfigError("n", f"must not exceed the engine's max_batch_size ({max_batch_size}): all "
                                             f"n completions of a prompt run in one batch, got {self.n}")

    def to_sampling_params(self):
        """The lmkit._engine.SamplingParams for this config."""
        from lmkit._ext import _engine

        p = _engine.SamplingParams()
        # the engine's one encoding of greedy is temperature 0 (do_sample=False and top_k=1 become it here)
        p.temperature = self.temperature if self.do_sample and self.top_k != 1 else 0.0
        p.top_k = self.top_k
        p.top_p = self.top_p
        p.min_p = self.min_p
        p.repetition_penalty = self.repetition_penalty
        p.presence_penalty = self.presence_penalty
        p.frequency_penalty = self.frequency_penalty
        p.n = self.n
        p.logprobs = -1 if self.logprobs is None else self.logprobs
        p.prompt_logprobs = -1 if self.prompt_logprobs is None else self.prompt_logprobs
        p.has_seed = self.random_seed is not None
        p.seed = self.random_seed or 0
        p.max_new_tokens = self.max_new_tokens
        p.min_new_tokens = self.min_new_tokens
        p.stop_token_ids = list(self.stop_token_ids)
        p.ignore_eos = self.ignore_eos
        p.output_logits = self.output_logits
        p.speculate = self.speculative is not False
        if isinstance(self.prediction, list):
            p.prediction = self.prediction
        if self.structured_output_after_token is not None:
            p.grammar_after_token = self.structured_output_after_token
        return p


FinishReason = Literal["stop", "length", "error", "cancelled"]
ErrorKind = Literal["does_not_fit", "grammar", "internal"]


@dataclass
class Response:
    """The result of one prompt (or, from stream_infer, what arrived since the previous one)."""

    text: str
    token_ids: list[int]
    input_token_len: int
    generate_token_len: int
    finish_reason: FinishReason | None = None
    index: int = 0
    """Position of the prompt in the batch passed in."""
    sample_index: int = 0
    """Which of the prompt's n completions (GenerationConfig.n)."""
    error: str | None = None
    """Why the request failed, when finish_reason == "error"."""
    error_kind: ErrorKind | None = None
    """Whose error it is, when finish_reason == "error": "does_not_fit" (the request can never fit the KV pool:
    lower max_new_tokens), "grammar" (the structured output's grammar refused a token) or "internal"."""
    logits: np.ndarray | None = None
    """[positions, vocab] logits when GenerationConfig.output_logits was set."""
    logprobs: list[dict[int, float]] | None = None
    """Per output token: {token id: logprob} of the chosen token and the top alternatives
    (GenerationConfig.logprobs); logprobs are the log-softmax of the penalised logits, before temperature."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Per prompt token (GenerationConfig.prompt_logprobs): None for the first, then {token id: logprob} of the
    prompt's token (first) and the top alternatives, from the raw logits. On the first completion of a prompt
    (sample_index 0) only; in a stream, on the Responses that arrive while the prompt is computed."""
