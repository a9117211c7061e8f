"""OpenTelemetry tracing (--otlp-traces-endpoint): a real server exports over OTLP/HTTP to a receiver in this test
(opentelemetry-proto decodes the bodies); one SERVER span per generation or embedding request, under the caller's
traceparent, with vLLM's attributes and the prepare / prefill / decode phases in order, streamed or not; a refused
request carries its status; other routes are not traced; off by default, and then no SDK is loaded."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.serve.harness import TINY_ENGINE, ServerThread

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason='tracing needs pip install -e ".[otel]"')


class OTLPReceiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every POST /v1/traces body decoded into span dicts."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        self.spans: list[dict] = []
        self.content_types: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces", self.path
                spans = [dict(_span(s), service=_attributes(r.resource.attributes)["service.name"])
                         for r in ExportTraceServiceRequest.FromString(body).resource_spans
                         for scope in r.scope_spans for s in scope.spans]
                with receiver.lock:
                    receiver.spans += spans
                    receiver.content_types.add(self.headers["Content-Type"])
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def _span(s) -> dict:
    return {"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
            "parent_span_id": s.parent_span_id.hex(), "kind": s.kind, "start": s.start_time_unix_nano,
            "end": s.end_time_unix_nano, "attributes": _attributes(s.attributes), "status": s.status.code}


SERVER, INTERNAL = 2, 1  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2


@pytest.fixture(scope="module")
def traced(tiny_engine):
    """(server, its app, the receiver): the tiny model served as `tiny`, tracing to the receiver."""
    from lmkit.serve import ServerConfig, create_app

    receiver = OTLPReceiver()
    app = create_app(tiny_engine, ServerConfig(model_name="tiny", otlp_traces_endpoint=receiver.url))
    server = ServerThread(app)
    yield server, app, receiver
    server.stop()
    receiver.server.shutdown()


_sent = iter(range(1, 10**6))


def traceparent() -> tuple[str, str, str]:
    """(header, trace id, parent span id): a W3C traceparent of a sampled caller span, new each call."""
    n = next(_sent)
    trace_id, span_id = f"{0xABC0000 + n:032x}", f"{0xDEF000 + n:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def spans_of(app, receiver, trace_id: str, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The ``count`` spans of a trace, once exported (FastAPI ends a span just after the answer's last byte)."""
    deadline = time.monotonic() + timeout_s
    while True:
        app.app.state.tracing.force_flush()
        spans = receiver.trace(trace_id)
        if len(spans) >= count or time.monotonic() > deadline:
            assert len(spans) == count, spans
            return spans
        time.sleep(0.02)


def request_span(spans: list[dict]) -> tuple[dict, dict[str, dict]]:
    """(the SERVER span, its children by name)."""
    [server] = [s for s in spans if s["kind"] == SERVER]
    children = {s["name"]: s for s in spans if s["parent_span_id"] == server["span_id"]}
    assert len(children) == len(spans) - 1, spans
    return server, children


def check_phases(server: dict, children: dict[str, dict]) -> None:
    """prepare, queue, prefill, decode tile the request's span in order, and the latencies agree with them."""
    assert set(children) == {"prepare", "queue", "prefill", "decode"}
    prepare, queue, prefill, decode = (children[name] for name in ("prepare", "queue", "prefill", "decode"))
    assert all(c["kind"] == INTERNAL for c in children.values())
    assert server["start"] == prepare["start"] <= prepare["end"] == queue["start"] <= queue["end"]
    assert queue["end"] == prefill["start"] <= prefill["end"] == decode["start"] <= decode["end"] <= server["end"]
    a = server["attributes"]
    assert 0 < a["lmkit.latency.time_in_prepare"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    for name, phase in (("lmkit.latency.time_in_prepare", prepare), ("gen_ai.latency.time_in_queue", queue),
                        ("gen_ai.latency.time_in_model_prefill", prefill)):
        assert a[name] == pytest.approx((phase["end"] - phase["start"]) / 1e9, abs=1e-6), name
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(
        a["lmkit.latency.time_in_prepare"] + a["gen_ai.latency.time_in_queue"]
        + a["gen_ai.latency.time_in_model_prefill"], abs=1e-6)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx((decode["end"] - decode["start"]) / 1e9, abs=1e-6)
    assert a["gen_ai.latency.e2e"] <= (server["end"] - server["start"]) / 1e9


def test_a_chat_completion_is_one_span_under_the_callers_trace(traced):
    server, app, receiver = traced
    header, trace_id, parent_id = traceparent()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.5,
            "top_p": 0.9, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"traceparent": header}, timeout=30)
    assert r.status_code == 200, r.text
    span, children = request_span(spans_of(app, receiver, trace_id, 5))
    assert span["parent_span_id"] == parent_id and span["name"] == "POST /v1/chat/completions"
    assert span["service"] == "lmkit" and span["status"] != STATUS_ERROR
    a = span["attributes"]
    usage = r.json()["usage"]
    assert {k: a[k] for k in ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
                              "gen_ai.request.id", "gen_ai.request.max_tokens", "gen_ai.request.temperature",
                              "gen_ai.request.top_p", "gen_ai.request.n", "gen_ai.usage.prompt_tokens",
                              "gen_ai.usage.completion_tokens", "gen_ai.usage.num_sequences",
                              "gen_ai.response.finish_reasons", "lmkit.request.stream", "http.response.status_code",
                              "http.route")} == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny", "gen_ai.response.model": "tiny",
        "gen_ai.request.id": r.json()["id"], "gen_ai.request.max_tokens": 5, "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9, "gen_ai.request.n": 1, "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": 5, "gen_ai.usage.num_sequences": 1,
        "gen_ai.response.finish_reasons": ["length"], "lmkit.request.stream": False,
        "http.response.status_code": 200, "http.route": "/v1/chat/completions"}
    check_phases(span, children)


def test_a_streamed_completion_with_n_2_is_traced_to_its_last_event(traced):
    server, app, receiver = traced
    header, trace_id, parent_id = traceparent()
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 7, "n": 2, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"traceparent": header},
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    span, children = request_span(spans_of(app, receiver, trace_id, 5))
    assert span["parent_span_id"] == parent_id and span["name"] == "POST /v1/completions"
    a = span["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["lmkit.request.stream"] is True
    assert a["gen_ai.request.id"] == first["id"] and a["gen_ai.request.n"] == 2
    assert a["gen_ai.usage.completion_tokens"] == 14 and a["gen_ai.usage.num_sequences"] == 2
    assert a["gen_ai.response.finish_reasons"] == ["length", "length"]
    check_phases(span, children)


def test_a_response_is_traced_as_a_chat(traced):
    server, app, receiver = traced
    header, trace_id, parent_id = traceparent()
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers={"traceparent": header}, timeout=30)
    assert r.status_code == 200, r.text
    span, children = request_span(spans_of(app, receiver, trace_id, 5))
    assert span["parent_span_id"] == parent_id and span["name"] == "POST /v1/responses"
    a = span["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.id"] == r.json()["id"]
    assert a["gen_ai.usage.completion_tokens"] == r.json()["usage"]["output_tokens"] == 4
    check_phases(span, children)


def test_a_request_behind_a_full_batch_spends_its_wait_in_the_queue_phase(slow_llama):
    """max_batch_size 1 and a long completion running: the next request's queue phase holds its wait for the
    batch slot (the engine's scheduled_at), not its prefill."""
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app

    engine = AsyncEngine(slow_llama, EngineConfig(**{**TINY_ENGINE, "max_batch_size": 1}))
    receiver = OTLPReceiver()
    app = create_app(engine, ServerConfig(model_name="tiny", otlp_traces_endpoint=receiver.url,
                                          max_waiting_seqs=1))
    server = ServerThread(app)
    try:
        long = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the long one is running
            header, trace_id, _ = traceparent()
            body = {"model": "tiny", "prompt": "y", "max_tokens": 2, "ignore_eos": True}
            second = httpx.post(f"{server.url}/v1/completions", json=body, headers={"traceparent": header},
                                timeout=60)
            assert second.status_code == 200, second.text
        span, children = request_span(spans_of(app, receiver, trace_id, 5))
        check_phases(span, children)
        a = span["attributes"]
        assert a["gen_ai.latency.time_in_queue"] > 5 * a["gen_ai.latency.time_in_model_prefill"], a
    finally:
        server.stop()
        receiver.server.shutdown()
        engine.close()


def test_without_traceparent_a_request_starts_a_trace_and_embeddings_are_traced(traced):
    server, app, receiver = traced
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny", "input": ["one", "two three"]}, timeout=30)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while not (found := [s for s in list(receiver.spans) if s["name"] == "POST /v1/embeddings"]):
        assert time.monotonic() < deadline, receiver.spans
        app.app.state.tracing.force_flush()
        time.sleep(0.02)
    [span] = found
    assert span["parent_span_id"] == "" and receiver.trace(span["trace_id"]) == [span]  # a root, no phases
    a = span["attributes"]
    assert a["gen_ai.operation.name"] == "embeddings" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["lmkit.request.num_prompts"] == 2


def test_a_refused_request_is_traced_with_its_status_and_other_routes_are_not(traced):
    server, app, receiver = traced
    header, trace_id, _ = traceparent()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 2},
                   headers={"traceparent": header}, timeout=30)
    assert r.status_code == 404
    [span] = spans_of(app, receiver, trace_id, 1)  # never reached the engine: no phases, no usage
    assert span["attributes"]["http.response.status_code"] == 404 and "gen_ai.usage.prompt_tokens" not in span[
        "attributes"]
    for path in ("/health", "/metrics", "/v1/models"):
        header, trace_id, _ = traceparent()
        assert httpx.get(f"{server.url}{path}", headers={"traceparent": header}).status_code == 200
        app.app.state.tracing.force_flush()
        assert receiver.trace(trace_id) == [], path
    assert receiver.content_types == {"application/x-protobuf"}


def test_tracing_is_off_by_default_and_loads_no_sdk(tiny_llama):
    """A fresh interpreter (this one has loaded the SDK): the api_server and an app of the default config load no
    OpenTelemetry SDK, exporter, nor serve/tracing.py (FastAPI itself imports the OpenTelemetry API)."""
    from lmkit.serve import ServerConfig

    assert ServerConfig().otlp_traces_endpoint is None
    code = f"""
import sys
from lmkit import AsyncEngine, EngineConfig
from lmkit.serve.api_server import ServerConfig, create_app
engine = AsyncEngine({str(tiny_llama[0])!r}, EngineConfig(**{TINY_ENGINE!r}))
create_app(engine, ServerConfig())
engine.close()
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                     "lmkit.serve.tracing"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_option_and_the_endpoint(monkeypatch):
    from typer.testing import CliRunner

    from lmkit.serve import ServerConfig, api_server, cli
    from lmkit.serve.tracing import traces_url

    seen = {}
    monkeypatch.setattr(api_server, "run_api_server", lambda model, engine, server, **kw: seen.update(server=server))
    result = CliRunner().invoke(cli.app, ["api_server", "--otlp-traces-endpoint", "http://collector:4318"])
    assert result.exit_code == 0, result.output
    assert seen["server"].otlp_traces_endpoint == "http://collector:4318"
    assert traces_url("http://collector:4318") == traces_url("http://collector:4318/") == \
        "http://collector:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="OTLP/HTTP URL"):
        ServerConfig(otlp_traces_endpoint="grpc://collector:4317")
