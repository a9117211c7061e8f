"""What a caller passes per request (GenerationConfig) and gets back (Response)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass
class GenerationConfig:
    """Sampling and stopping parameters of one request. Validated on construction."""

    max_new_tokens: int = 512
    """Tokens to generate at most (the session length may cut it shorter)."""
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
    ignore_eos: bool = False
    """Keep generating past the model's eos ids."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    output_logits: bool = False
    """Return the logits of every position computed (prompt and output) in Response.logits."""

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
              f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens,
              f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}")
        check(math.isfinite(self.temperature) and self.temperature >= 0,
              f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(math.isfinite(self.min_p) and 0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p!r}")
        check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}")
        check(self.random_seed is None or (isinstance(self.random_seed, int) and 0 <= self.random_seed < 2**64),
              f"random_seed must be an integer in [0, 2**64), got {self.random_seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(all(isinstance(x, str) and x for x in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(-2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def to_sampling_params(self):
        """The lmkit._engine.SamplingParams for this config."""
        from lmkit import _engine

        p = _engine.SamplingParams()
        p.temperature = self.temperature if self.do_sample else 0.0
        p.top_k = self.top_k
        p.top_p = self.top_p
        p.min_p = self.min_p
        p.repetition_penalty = self.repetition_penalty
        p.presence_penalty = self.presence_penalty
        p.frequency_penalty = self.frequency_penalty
        p.n = self.n
        p.logprobs = -1 if self.logprobs is None else self.logprobs
        p.has_seed = self.random_seed is not None
        p.seed = self.random_seed or 0
        p.max_new_tokens = self.max_new_tokens
        p.min_new_tokens = self.min_new_tokens
        p.stop_token_ids = list(self.stop_token_ids)
        p.ignore_eos = self.ignore_eos
        p.output_logits = self.output_logits
        return p


FinishReason = Literal["stop", "length", "error", "cancelled"]


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
    logits: np.ndarray | None = None
    """[positions, vocab] logits when GenerationConfig.output_logits was set."""
    logprobs: list[dict[int, float]] | None = None
    """Per output token: {token id: logprob} of the chosen token and the top alternatives
    (GenerationConfig.logprobs); logprobs are the log-softmax of the penalised logits, before temperature."""
