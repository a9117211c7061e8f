"""schemathesis fuzzes the api_server's OpenAPI schema (valid and invalid bodies, a bounded number of cases per
operation): no answer may be a 5xx, every error is an OpenAI error body, and the engine leaks nothing."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

CASES_PER_OPERATION = 25


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_openapi_no_server_errors(api_server, mode):
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    failures = []
    num_cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            nonlocal num_cases
            num_cases += 1
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 64)  # keep generation short
            response = case.call(base_url=api_server.url, timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
            elif response.status_code >= 400:
                error = response.json().get("error")
                assert error and error["message"], (case.body, response.text)

        try:
            check()
        except Unsatisfiable:  # nothing invalid to send to a route without parameters
            assert mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET"
    assert num_cases > 0
    assert not failures, failures[:5]
