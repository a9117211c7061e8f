"""deploy/grafana: the dashboard is a Grafana dashboard (panels with ids, places on the grid that do not overlap,
Prometheus targets through the data-source variable) whose every PromQL expression (parsed by promql-parser) and
template variable names metrics, and labels, that a real api_server exports at GET /metrics after a real request;
the provisioning examples point at it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.harness import ServerThread, tiny_async_engine

promql = pytest.importorskip("promql_parser", reason='the dashboard test parses PromQL: pip install -e ".[test]"')

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "lmkit-dashboard.json").read_text())
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped sample."""
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")


def graph_panels() -> list[dict]:
    """Every panel but rows, those inside collapsed rows too."""
    panels = []
    for p in DASHBOARD["panels"]:
        panels += p.get("panels", []) if p["type"] == "row" else [p]
    return panels


def parse(expr: str):
    """The PromQL of a Grafana expression: its interval variables replaced by a duration (the others are in label
    values, which stay strings)."""
    return promql.parse(GRAFANA_INTERVALS.sub("5m", expr))


def selectors(expr) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every vector selector, ``{__name__="..."}`` ones too."""
    found = []

    def visit(node):
        if isinstance(node, promql.VectorSelector):
            matchers = node.matchers.matchers
            name = node.name or next(m.value for m in matchers if m.name == "__name__")
            found.append((name, {m.name for m in matchers if m.name != "__name__"}))

    promql.walk(expr, visit)
    return found


def grouping_labels(expr) -> set[str]:
    labels = set()

    def visit(node):
        if isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)

    promql.walk(expr, visit)
    return labels


def quantile_groupings(expr) -> list[set[str] | None]:
    """The ``by`` labels of each histogram_quantile's aggregation (None: it aggregates no other way)."""
    found = []

    def visit(node):
        if isinstance(node, promql.Call) and node.func.name == "histogram_quantile":
            inner = node.args[1]
            by = promql.AggModifierType.By
            found.append(set(inner.modifier.labels) if isinstance(inner, promql.AggregateExpr) and
                         inner.modifier is not None and inner.modifier.type == by else None)

    promql.walk(expr, visit)
    return found


@pytest.fixture(scope="module")
def exported(tiny_llama) -> dict[str, tuple[str, set[str]]]:
    """Sample name -> (its family's type, its labels) of a real api_server's GET /metrics, after one streamed
    request of several tokens (so that the latency histograms have observations)."""
    from lmkit.serve import ServerConfig, create_app

    with tiny_async_engine(tiny_llama[0]) as engine:
        server = ServerThread(create_app(engine, ServerConfig(model_name="tiny")))
        try:
            body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200 and list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
        finally:
            server.stop()
    samples: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            kind, labels = samples.get(s.name, (family.type, set()))
            samples[s.name] = (kind, labels | set(s.labels))
    assert samples["lmkit_time_to_first_token_seconds_count"] and "lmkit_requests_total" in samples
    return samples


def test_the_dashboard_has_grafanas_shape():
    assert isinstance(DASHBOARD["schemaVersion"], int) and DASHBOARD["schemaVersion"] >= 39
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["id"] is None
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
    rows = [p for p in DASHBOARD["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in rows + graph_panels()]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    cells: dict[tuple[int, int], int] = {}
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"{p['title']!r} overlaps panel {cells[cell]}"
            cells[cell] = p["id"]
    panels = graph_panels()
    assert len(panels) >= 12
    for p in panels:
        assert p["type"] in ("timeseries", "stat", "gauge", "heatmap", "bargauge", "table"), p["title"]
        assert p["title"] and p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t.get("datasource", DATASOURCE) == DATASOURCE, p["title"]


def test_the_dashboard_shows_what_users_look_for():
    names = {name for p in graph_panels() for t in p["targets"] for name, _ in selectors(parse(t["expr"]))}
    for histogram in ("lmkit_time_to_first_token_seconds", "lmkit_time_per_output_token_seconds",
                      "lmkit_e2e_request_latency_seconds"):
        assert f"{histogram}_bucket" in names, histogram
    assert names >= {"lmkit_requests_total", "lmkit_http_responses_total", "lmkit_prompt_tokens_total",
                     "lmkit_generation_tokens_total", "lmkit_num_requests_running", "lmkit_num_requests_waiting",
                     "lmkit_kv_cache_usage_ratio", "lmkit_prefix_cache_hits_tokens_total", "lmkit_num_seqs_admitted",
                     "lmkit_spec_accepted_tokens_total", "lmkit_engine_steps_total"}


@pytest.mark.parametrize("panel", graph_panels(), ids=lambda p: p["title"])
def test_every_panel_queries_metrics_the_server_exports(panel, exported):
    for target in panel["targets"]:
        expr = parse(target["expr"])
        used = selectors(expr)
        assert used, target["expr"]
        labels: set[str] = set(TARGET_LABELS)
        for name, matched in used:
            assert name in exported, f"{panel['title']!r} reads {name}, which GET /metrics does not export"
            kind, own = exported[name]
            if name.endswith(("_bucket", "_sum", "_count")) and kind != "counter":
                assert kind == "histogram", f"{name} is a {kind}'s sample, not a histogram's"
            assert matched <= own | TARGET_LABELS, f"{name} has no label {matched - own - TARGET_LABELS}"
            labels |= own
        assert grouping_labels(expr) <= labels, f"{target['expr']} groups by labels its metrics lack"
        for by in quantile_groupings(expr):
            assert by is not None and "le" in by, f"histogram_quantile needs sum by (le): {target['expr']}"


def test_the_template_variables_read_exported_labels(exported):
    for v in DASHBOARD["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, query
        [(name, matched)] = selectors(parse(match[1]))
        _, own = exported[name]
        assert matched <= own | TARGET_LABELS and match[2] in own | TARGET_LABELS, query


def test_the_provisioning_examples():
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "lmkit.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    [source] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())[
        "datasources"]
    assert source["type"] == DATASOURCE["type"] and source["isDefault"] is True
