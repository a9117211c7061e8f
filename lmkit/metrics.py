"""Engine metrics readable from Python: the C++ counters plus recent per-request latencies."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


class LatencyRecorder:
    """Recent time-to-first-token and inter-token latencies (bounded windows), thread-safe."""

    def __init__(self, window: int = 4096):
        self._lock = threading.Lock()
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.inter_token_s: deque[float] = deque(maxlen=window * 8)
        self.num_recorded = 0

    def record(self, timing) -> None:
        """Adds one finished completion's timing (lmkit.outputs.Timing)."""
        with self._lock:
            if timing.ttft_s is not None:
                self.ttft_s.append(timing.ttft_s)
            self.inter_token_s.extend(timing.inter_token_s)
            self.num_recorded += 1

    def snapshot(self) -> tuple[list[float], list[float]]:
        with self._lock:
            return list(self.ttft_s), list(self.inter_token_s)


@dataclass
class EngineMetrics:
    """A snapshot: request counts, KV usage, prefix cache, tokens, latencies."""

    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    num_active_blocks: int
    num_cached_blocks: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_finished_requests: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_window_freed_blocks: int
    """KV blocks released early: behind every layer's sliding window."""
    num_weight_bytes_read: int
    """Weights the steps' forwards read, summed (a mixture of experts counts the experts each step ran)."""
    num_total_state_slots: int
    """Recurrent-state slots (a model with recurrent layers; 0 otherwise): running sequences' and snapshots'."""
    num_free_state_slots: int
    num_state_snapshots: int
    """Slots holding a prefix's state for prefix hits (evicted first when a sequence needs a slot)."""
    has_kv_store: bool = False
    """Whether the engine has a disk store (EngineConfig.kv_cache_dir); the num_store_* counters are 0 otherwise."""
    num_store_lookups: int = 0
    """Admissions whose prefix chain went on past the pool and asked the disk store."""
    num_store_missed_lookups: int = 0
    """Of those, the ones that found nothing there."""
    num_store_hit_tokens: int = 0
    """Prompt tokens whose K/V were read back from the disk store (counted in num_prefix_hit_tokens too)."""
    num_store_read_blocks: int = 0
    num_store_read_bytes: int = 0
    num_store_written_blocks: int = 0
    """Block files written (a block already on disk is not written again)."""
    num_store_written_bytes: int = 0
    num_store_dropped_blocks: int = 0
    """Evicted blocks not written: the writer's queue was full, or writing was paused after an error."""
    num_store_ignored_files: int = 0
    """Corrupt, truncated or foreign files found in the store (never served; removed)."""
    num_store_write_errors: int = 0
    """Writes that failed (a full disk, permissions): each pauses writing for a while."""
    num_store_evicted_files: int = 0
    """Files removed to keep the directory within kv_cache_disk_gib."""
    num_store_bytes: int = 0
    """The store directory's size as its writer last measured it (every model's files)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """Speculative decoding, per proposer (DRAFT_SOURCES): draft tokens verified."""
    num_accepted_draft_tokens: dict[str, int] = field(default_factory=dict)
    """Of those, accepted (kept in the output)."""
    num_verifications: dict[str, int] = field(default_factory=dict)
    """Steps of a request that verified drafts of that proposer."""
    ttft_s: list[float] = field(default_factory=list, repr=False)
    inter_token_s: list[float] = field(default_factory=list, repr=False)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by running requests."""
        return self.num_active_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    @property
    def store_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens read back from the disk store (a part of prefix_hit_rate)."""
        return self.num_store_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def mean_accepted_length(self, source: str) -> float:
        """Draft tokens accepted per verification of a proposer (0 before its first)."""
        n = self.num_verifications.get(source, 0)
        return self.num_accepted_draft_tokens.get(source, 0) / n if n else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens over every proposer (0 before any)."""
        n = sum(self.num_draft_tokens.values())
        return sum(self.num_accepted_draft_tokens.values()) / n if n else 0.0

    @classmethod
    def from_engine(cls, m, latency: LatencyRecorder) -> "EngineMetrics":
        ttft, itl = latency.snapshot()
        per_source = ("num_draft_tokens", "num_accepted_draft_tokens", "num_verifications")
        names = [f for f in cls.__dataclass_fields__ if f not in ("ttft_s", "inter_token_s") + per_source]
        sources = {n: dict(zip(DRAFT_SOURCES, getattr(m, n))) for n in per_source}
        return cls(**{n: getattr(m, n) for n in names}, **sources, ttft_s=ttft, inter_token_s=itl)


DRAFT_SOURCES = ("prediction", "ngram", "suffix", "mtp", "draft")
"""The engine's draft proposers, in its order (engine/speculative.h, DraftSource): the request's predicted output,
n-gram lookup in the request's own tokens, and in the store of recently finished answers (suffix), the model's
multi-token-prediction head (mtp) and a draft model (draft)."""
