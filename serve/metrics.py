"""Prometheus metrics of one api_server (``GET /metrics``), in a registry of its own so that several
servers can live in one process (tests).

- counted by the server: HTTP responses by route and status, finished completions by finish reason,
  prompt/generated tokens, TTFT / TPOT / end-to-end histograms (seconds, measured from the request's
  arrival, so tokenization and queueing count);
- read from the engine at scrape time: running / waiting requests, KV blocks and usage, prefix-cache
  hit rate, preemptions;
- read from the admission at scrape time: sequences (prompts x n) admitted and the limit;
- the gauges of the Gateway API Inference Extension's model-server protocol, under the names its endpoint
  picker reads by default (vLLM's, labelled ``model_name``), so that an InferencePool routes to lmkit pods on
  queue length and KV-cache use with no engine-specific configuration (``GATEWAY_METRICS``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmkit.engine import Engine
from lmkit.serve.admission import Admission

KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
                         "/tokenize", "/detokenize", "/health", "/ready", "/metrics"})
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Gauges and counters read from Engine.metrics() when Prometheus scrapes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        m = self.engine.metrics()
        gauges = [
            ("lmkit_num_requests_running", "Requests running in the engine", m.num_running),
            ("lmkit_num_requests_waiting", "Requests waiting for KV blocks or a batch slot", m.num_waiting),
            ("lmkit_kv_cache_usage_ratio", "Fraction of KV blocks held by running requests", m.kv_usage),
            ("lmkit_kv_blocks_total", "KV blocks in the pool", m.num_total_blocks),
            ("lmkit_kv_blocks_free", "KV blocks free", m.num_free_blocks),
            ("lmkit_kv_blocks_cached", "KV blocks kept by the prefix cache", m.num_cached_blocks),
            ("lmkit_prefix_cache_hit_rate", "Fraction of looked-up prompt tokens found in the prefix cache",
             m.prefix_hit_rate),
            ("lmkit_kv_store_hit_rate", "Fraction of looked-up prompt tokens read back from the KV disk store "
             "(part of lmkit_prefix_cache_hit_rate; 0 without --kv-cache-dir)", m.store_hit_rate),
            ("lmkit_kv_store_bytes", "Bytes of the KV disk store's directory, as its writer last measured it",
             m.num_store_bytes),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("lmkit_engine_steps", "Engine steps run", m.num_steps),
            ("lmkit_engine_preemptions", "Requests preempted (recomputed later)", m.num_preemptions),
            ("lmkit_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
             m.num_prefix_query_tokens),
            ("lmkit_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache", m.num_prefix_hit_tokens),
            ("lmkit_kv_window_freed_blocks", "KV blocks released early, behind every layer's sliding window",
             m.num_window_freed_blocks),
            ("lmkit_weight_bytes_read", "Weight bytes the engine steps read (a mixture of experts: the experts "
             "its routing ran)", m.num_weight_bytes_read),
            ("lmkit_kv_store_lookups", "Admissions whose prefix went on past the KV pool and asked the disk store",
             m.num_store_lookups),
            ("lmkit_kv_store_missed_lookups", "Disk store lookups that found nothing", m.num_store_missed_lookups),
            ("lmkit_kv_store_hits_tokens", "Prompt tokens read back from the KV disk store", m.num_store_hit_tokens),
            ("lmkit_kv_store_read_blocks", "KV blocks read back from the disk store", m.num_store_read_blocks),
            ("lmkit_kv_store_read_bytes", "Bytes read from the KV disk store", m.num_store_read_bytes),
            ("lmkit_kv_store_written_blocks", "KV blocks written to the disk store", m.num_store_written_blocks),
            ("lmkit_kv_store_written_bytes", "Bytes written to the KV disk store", m.num_store_written_bytes),
            ("lmkit_kv_store_dropped_blocks", "Evicted KV blocks not written (writer queue full, or writing paused)",
             m.num_store_dropped_blocks),
            ("lmkit_kv_store_ignored_files", "Corrupt, truncated or foreign disk store files ignored (and removed)",
             m.num_store_ignored_files),
            ("lmkit_kv_store_write_errors", "Disk store writes that failed (full disk, permissions)",
             m.num_store_write_errors),
            ("lmkit_kv_store_evicted_files", "Disk store files removed to stay within its size cap",
             m.num_store_evicted_files),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        drafts = [
            ("lmkit_spec_draft_tokens", "Speculative draft tokens verified, per proposer", m.num_draft_tokens),
            ("lmkit_spec_accepted_tokens", "Speculative draft tokens accepted (kept in the output), per proposer",
             m.num_accepted_draft_tokens),
            ("lmkit_spec_verifications", "Request steps that verified drafts, per proposer", m.num_verifications),
        ]
        for name, doc, per_source in drafts:
            family = CounterMetricFamily(name, doc, labels=["proposer"])
            for source, value in per_source.items():
                family.add_metric([source], value)
            yield family


GATEWAY_METRICS = {
    "queued": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "kv_usage_before_v1_3": "vllm:gpu_cache_usage_perc",
    "cache_info": "vllm:cache_config_info",
}
"""The model-server protocol's gauges (gateway-api-inference-extension, proposal 003) and the names lmkit
exports them under: those the endpoint picker reads for its default engine type. KV usage is a fraction
(0..1) despite the names; releases before v1.3 read ``gpu_cache_usage_perc``. No LoRA line: lmkit serves no
adapters. lmkit's own names (lmkit_num_requests_waiting, ...) carry the same values."""


class _GatewayCollector:
    """The gateway's gauges (GATEWAY_METRICS), read from Engine.metrics() when Prometheus scrapes."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        m = self.engine.metrics()
        gauges = [
            ("queued", "Requests waiting to run (model-server protocol TotalQueuedRequests)", m.num_waiting),
            ("running", "Requests running (model-server protocol TotalRunningRequests)", m.num_running),
            ("kv_usage", "KV-cache blocks in use, a fraction 0..1 (model-server protocol KVCacheUtilization)",
             m.kv_usage),
            ("kv_usage_before_v1_3", "The same as vllm:kv_cache_usage_perc, for gateways before v1.3", m.kv_usage),
        ]
        for key, doc, value in gauges:
            family = GaugeMetricFamily(GATEWAY_METRICS[key], doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        info = GaugeMetricFamily(GATEWAY_METRICS["cache_info"], "KV-cache layout: tokens per block and blocks",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self.model_name, str(self.engine.config.cache_block_seq_len), str(m.num_total_blocks)], 1)
        yield info


class _AdmissionCollector:
    """Sequences admitted now and the limit, read when Prometheus scrapes."""

    def __init__(self, admission: Admission):
        self.admission = admission

    def collect(self):
        yield GaugeMetricFamily("lmkit_num_seqs_admitted", "Sequences (prompts x n) of the requests in progress",
                                value=self.admission.num_seqs)
        yield GaugeMetricFamily("lmkit_max_num_seqs_admitted", "Sequences admitted at most; beyond: 429",
                                value=self.admission.max_num_seqs)


class ServerMetrics:
    """The collectors of one server; ``render()`` is the body of GET /metrics."""

    def __init__(self, engine: Engine, admission: Admission | None = None, model_name: str | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.http_responses = Counter("lmkit_http_responses", "HTTP responses by route and status",
                                      ["path", "status"], registry=r)
        self.requests = Counter("lmkit_requests", "Completions finished, by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("lmkit_prompt_tokens", "Prompt tokens of finished completions", registry=r)
        self.generation_tokens = Counter("lmkit_generation_tokens", "Tokens generated by finished completions",
                                         registry=r)
        self.ttft = Histogram("lmkit_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lmkit_time_per_output_token_seconds", "Mean time between output tokens, per completion",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lmkit_e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))
        if model_name is not None:
            r.register(_GatewayCollector(engine, model_name))
        if admission is not None:
            r.register(_AdmissionCollector(admission))

    def on_response(self, path: str, status: int) -> None:
        self.http_responses.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()

    def observe_completion(self, first_token_at: float | None, started_at: float, ended_at: float,
                           num_prompt_tokens: int, num_tokens: int, finish_reason: str) -> None:
        """Records one finished completion (times from time.perf_counter())."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.e2e.observe(ended_at - started_at)
        if first_token_at is not None:
            self.ttft.observe(first_token_at - started_at)
            if num_tokens > 1:
                self.tpot.observe((ended_at - first_token_at) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
