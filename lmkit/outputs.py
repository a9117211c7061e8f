"""Turns the engine's per-step outputs of one completion into Responses: incremental text that never
splits a multi-byte character, stop strings found across token boundaries (held back until they can
no longer match), logprobs as dicts, and per-token timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmkit.messages import GenerationConfig, Response
from lmkit.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Timing:
    """Engine-clock timestamps of one completion (seconds, lmkit._engine.now())."""

    submitted_at: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class CompletionState:
    """One completion's text, stop-string search and counters. Feed it RequestOutputs in order."""

    def __init__(self, tokenizer: Tokenizer, gen: GenerationConfig, input_token_len: int, index: int,
                 sample_index: int, submitted_at: float):
        self.gen = gen
        self.index = index
        self.sample_index = sample_index
        self.input_token_len = input_token_len
        self.detok = IncrementalDetokenizer(tokenizer, gen.skip_special_tokens)
        self.text = ""          # decoded so far
        self.emitted_len = 0    # characters of text already handed out
        self.num_tokens = 0
        self.finished = False
        self.stopped_by_string = False
        self.timing = Timing(submitted_at)
        self._max_stop = max((len(s) for s in gen.stop), default=0)

    def _find_stop(self) -> int | None:
        """Index in self.text where the first stop string starts, searching only text that can hold a new one."""
        start = max(0, self.emitted_len - self._max_stop)
        best = None
        for s in self.gen.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        return best[0] + (len(best[1]) if self.gen.include_stop_str_in_output else 0)

    def _holdback(self) -> int:
        """Length of the longest end of self.text that could still grow into a stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.gen.stop):
                return k
        return 0

    def process(self, out) -> Response | None:
        """The Response delta for one engine output (None when there is nothing to report yet).
        Sets self.finished; self.stopped_by_string tells the caller to cancel the engine request."""
        if self.finished:
            return None
        token_ids: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if out.num_top or out.logprobs else None
        end = None
        for k, t in enumerate(out.token_ids):
            token_ids.append(t)
            if logprobs is not None:
                entry = {t: out.logprobs[k]}
                top = out.num_top
                for j in range(top):
                    entry.setdefault(out.top_ids[k * top + j], out.top_logprobs[k * top + j])
                logprobs.append(entry)
            self.text += self.detok.add([t])
            if self.gen.stop:
                end = self._find_stop()
                if end is not None:
                    self.stopped_by_string = True
                    break
        if out.token_ids:
            self.timing.token_times.append(out.emitted_at)
            if self.timing.first_token_at is None:
                self.timing.first_token_at = out.emitted_at
        self.num_tokens += len(token_ids)
        if self.stopped_by_string:
            self.text = self.text[:end]
            self.finished = True
            finish_reason = "stop"
        elif out.finished:
            self.text += self.detok.add([], final=True)
            self.finished = True
            finish_reason = out.finish_reason or None
        else:
            finish_reason = None
        safe = len(self.text) if self.finished else len(self.text) - (self._holdback() if self.gen.stop else 0)
        delta = self.text[self.emitted_len:safe] if safe > self.emitted_len else ""
        self.emitted_len = max(self.emitted_len, safe)
        if not token_ids and not delta and not self.finished and out.logits is None:
            return None
        return Response(
            text=delta, token_ids=token_ids, input_token_len=self.input_token_len,
            generate_token_len=self.num_tokens, finish_reason=finish_reason, index=self.index,
            sample_index=self.sample_index, error=(out.error or None) if out.finished else None,
            logits=out.logits, logprobs=logprobs,
        )
