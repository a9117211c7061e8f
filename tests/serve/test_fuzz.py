"""schemathesis fuzzes every route of the api_server and of the proxy in front of it, each with and without API
keys (valid and invalid bodies, a bounded number of cases per operation): no answer may be a 5xx, every error
is an OpenAI error body, and the engine leaks nothing."""

from __future__ import annotations

import urllib.parse

import pytest

from tests.helpers import assert_blocks_free
from tests.serve.harness import ADMIN_KEY, ServerThread, free_port

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

CASES_PER_OPERATION = 20
KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def targets(api_server, tiny_engine):
    """name -> (server, headers every fuzz case sends): the api_server and a proxy in front of it, each open and
    with keys (the proxy always with an admin key, which the keyed runs also send to its /nodes routes)."""
    from lmkit.serve import GateConfig, ProxyConfig, ServerConfig, create_app, create_proxy_app

    keyed_server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny",
                                                                     gate=GateConfig(api_keys=(KEY,)))))
    proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(api_server.url,), admin_key=ADMIN_KEY,
                                                      health_interval_s=0.5)))
    keyed_proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(api_server.url,), admin_key=ADMIN_KEY,
                                                            gate=GateConfig(api_keys=(KEY,)), health_interval_s=0.5)))
    yield {
        "api_server": (api_server, {}),
        "api_server+keys": (keyed_server, {"Authorization": f"Bearer {KEY}"}),
        "proxy": (proxy, {}),
        "proxy+keys": (keyed_proxy, {"Authorization": f"Bearer {KEY}"}),
    }
    for server in (keyed_server, proxy, keyed_proxy):
        server.stop()


def _keep_on_loopback(case, closed_port: int) -> None:
    """A node URL the proxy would accept is pointed at a closed loopback port: fuzzing sends nothing off this
    machine (an invalid URL is left as it is, to fuzz the validation)."""
    from lmkit.serve.proxy import normalize_node_url

    if case.path != "/nodes/add" or not isinstance(case.body, dict) or not isinstance(case.body.get("url"), str):
        return
    try:
        normalize_node_url(case.body["url"])
    except ValueError:
        return
    if urllib.parse.urlsplit(case.body["url"]).hostname not in ("127.0.0.1", "localhost"):
        case.body["url"] = f"http://127.0.0.1:{closed_port}"


def _operations(server, node, headers):
    """(operation, base URL) of every route of ``server``; for a proxy also the node's /v1 routes, sent through
    the proxy (it relays their bodies as bytes, so its own schema has none to fuzz)."""
    schemas = [(schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=headers), lambda path: True)]
    if node is not None:
        node_schema = schemathesis.openapi.from_url(f"{node.url}/openapi.json")
        schemas.append((node_schema, lambda path: path.startswith("/v1/")))
    for schema, wanted in schemas:
        for result in schema.get_all_operations():
            operation = result.ok()
            if wanted(operation.path):
                yield operation


@pytest.mark.slow
@pytest.mark.parametrize("target", ["api_server", "api_server+keys", "proxy", "proxy+keys"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_openapi_no_server_errors(targets, api_server, tiny_engine, target, mode):
    server, headers = targets[target]
    closed_port = free_port()
    failures = []
    statuses = []
    for operation in _operations(server, api_server if target.startswith("proxy") else None, headers):
        # the proxy's admin routes take the admin key; everything else the API key (if any)
        op_headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if operation.path.startswith("/nodes/") else headers

        @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 64)  # keep generation short
                if mode == GenerationMode.POSITIVE and "model" in case.body:
                    case.body["model"] = "tiny"  # valid bodies reach the engine, not the unknown-model 404
            _keep_on_loopback(case, closed_port)
            response = case.call(base_url=server.url, headers=op_headers, timeout=60)
            statuses.append(response.status_code)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
            elif response.status_code >= 400:
                error = response.json().get("error")
                assert error and error["message"], (case.path, case.body, response.text)

        try:
            check()
        except Unsatisfiable:  # nothing invalid to send to a route without parameters or a body schema
            assert mode == GenerationMode.NEGATIVE and not len(operation.body) and not operation.query, operation
    assert statuses and not failures, failures[:5]
    if mode == GenerationMode.POSITIVE:  # some generations ran, through the proxy too
        assert statuses.count(200) > 10, sorted(statuses)
    assert_blocks_free(tiny_engine.engine, timeout_s=30)
