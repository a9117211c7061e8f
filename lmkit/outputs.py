"""Turns the engine's per-step outputs of one completion into Responses: incremental text that never
splits a multi-byte character, stop strings found across token boundaries (held back until they can
no longer match), logprobs as dicts, and per-token timing."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from lmkit.messages import GenerationConfig, Response
from lmkit.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Timing:
    """Engine-clock timestamps of one completion (seconds, lmkit._engine.now())."""

    submitted_at: float
    scheduled_at: float | None = None
    """When the engine planned the completion's first step: the end of its wait in the engine's queue."""
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@lru_cache(maxsize=256)
def _prefix_function(s: str) -> tuple[int, ...]:
    """KMP's table: entry i is the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopMatcher:
    """The stop strings of one completion, searched in its text as it grows, in time linear in the text (one
    KMP automaton per stop string; searching the held-back end again after every token cost the square of
    the longest stop string, on the event loop)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._tables = [_prefix_function(s) for s in stops]
        self._matched = [0] * len(stops)  # per stop: the longest end of the text so far that begins it

    def feed(self, piece: str, offset: int) -> tuple[int, str] | None:
        """Reads ``piece``, the text from ``offset`` on. Returns (start, stop string) of the match ending in it
        that starts first (the earlier stop string on a tie), or None."""
        best = None
        for j, s in enumerate(self.stops):
            table, k = self._tables[j], self._matched[j]
            for pos, ch in enumerate(piece):
                while k and ch != s[k]:
                    k = table[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):  # this stop's first match in the piece: its earliest start
                    start = offset + pos + 1 - k
                    if best is None or start < best[0]:
                        best = (start, s)
                    k = table[k - 1]
                    break
            self._matched[j] = k
        return best

    @property
    def num_held_chars(self) -> int:
        """Length of the longest end of the text that could still grow into a stop string."""
        return max(self._matched, default=0)


class CompletionState:
    """One completion's text, stop-string search and counters. Feed it RequestOutputs in order."""

    def __init__(self, tokenizer: Tokenizer, gen: GenerationConfig, prompt_ids: list[int], index: int,
                 sample_index: int, submitted_at: float):
        self.gen = gen
        self.index = index
        self.sample_index = sample_index
        self.prompt_ids = prompt_ids
        self.input_token_len = len(prompt_ids)
        # the first Response of the completion that scores the prompt opens its prompt_logprobs with token 0's None
        self._opens_prompt_logprobs = gen.prompt_logprobs is not None and sample_index == 0
        self.detok = IncrementalDetokenizer(tokenizer, gen.skip_special_tokens)
        self.text = ""          # decoded so far
        self.emitted_len = 0    # characters of text already handed out
        self.num_tokens = 0
        self.finished = False
        self.stopped_by_string = False
        self.timing = Timing(submitted_at)
        self._stops = StopMatcher(gen.stop)

    def process(self, out) -> Response | None:
        """The Response delta for one engine output (None when there is nothing to report yet).
        Sets self.finished; self.stopped_by_string tells the caller to cancel the engine request."""
        if self.finished:
            return None
        if self.timing.scheduled_at is None and out.scheduled_at > 0:
            self.timing.scheduled_at = out.scheduled_at
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
            piece = self.detok.add([t])
            self.text += piece
            if self.gen.stop:
                match = self._stops.feed(piece, len(self.text) - len(piece))
                if match is not None:
                    end = match[0] + (len(match[1]) if self.gen.include_stop_str_in_output else 0)
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
        safe = len(self.text) if self.finished else len(self.text) - self._stops.num_held_chars
        delta = self.text[self.emitted_len:safe] if safe > self.emitted_len else ""
        self.emitted_len = max(self.emitted_len, safe)
        prompt_logprobs = _prompt_logprobs(out, self.prompt_ids)
        if self._opens_prompt_logprobs:
            prompt_logprobs = [None] + (prompt_logprobs or [])
            self._opens_prompt_logprobs = False
        if not token_ids and not delta and not self.finished and out.logits is None and prompt_logprobs is None:
            return None
        return Response(
            text=delta, token_ids=token_ids, input_token_len=self.input_token_len,
            generate_token_len=self.num_tokens, finish_reason=finish_reason, index=self.index,
            sample_index=self.sample_index, error=(out.error or None) if out.finished else None,
            error_kind=(out.error_kind or None) if out.finished else None,
            logits=out.logits, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )


def _prompt_logprobs(out, prompt: list[int]) -> list[dict[int, float] | None] | None:
    """The prompt logprobs an engine output carries, as Response.prompt_logprobs entries."""
    values = out.prompt_logprobs
    if not values:
        return None
    first, top = out.first_prompt_logprob_token, out.num_prompt_top
    entries: list[dict[int, float] | None] = []
    ids, lps = out.prompt_top_ids, out.prompt_top_logprobs
    for k, lp in enumerate(values):
        entry = {prompt[first + k]: lp}
        for j in range(top):
            entry.setdefault(ids[k * top + j], lps[k * top + j])
        entries.append(entry)
    return entries
