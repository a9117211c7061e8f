"""Property-based fuzzing of the fields whose values reach the grammar compiler and the tool-call machinery: any JSON
value (deep, wide, lone surrogates, huge numbers, JSON Schema keywords with values of the wrong kind) as the schema
of ``response_format``, ``guided_json``, ``structured_outputs.json`` or a tool's ``parameters``, and any text
(surrogates included) as a regex, a grammar or the items of a choice. The server must answer 200 or an OpenAI error
body (4xx) whose message names what to fix, never a 5xx nor a library's internals, and leak no KV block.

schemathesis (tests/serve/test_fuzz.py) draws these fields from the OpenAPI schema, where they are free-form
objects and strings, so it rarely reaches the compiler with anything schema-like; the strategies here do."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.factories import FAMILIES, make_family_model
from tests.helpers import assert_blocks_free
from tests.serve.harness import FAMILY_ENGINE, ServerThread

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("llguidance")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow  # ~250 requests (a minute on 2 cores)

EXAMPLES = 50
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00", "\ud83d"])
TEXT = st.one_of(st.text(max_size=40), SURROGATES, st.text(alphabet="()[]{}*+?|\\^$.:-", max_size=30))
KEYWORDS = ["type", "properties", "items", "enum", "const", "pattern", "minimum", "maximum", "minLength", "maxLength",
            "minItems", "maxItems", "required", "additionalProperties", "anyOf", "oneOf", "allOf", "$ref", "$defs",
            "format", "prefixItems", "not", "if", "then", "multipleOf", "uniqueItems", "propertyNames"]
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "nope"])
LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=False, allow_infinity=False), TEXT, TYPES)
JSON_VALUE = st.recursive(
    LEAF,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.one_of(st.sampled_from(KEYWORDS), TEXT), children, max_size=5),
    max_leaves=40)
SCHEMA = st.one_of(
    JSON_VALUE,
    st.fixed_dictionaries({"type": TYPES}, optional={k: JSON_VALUE for k in KEYWORDS[1:12]}),
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(TEXT, st.fixed_dictionaries({"type": TYPES}), max_size=4)},
                          optional={"required": st.lists(TEXT, max_size=3),
                                    "additionalProperties": st.booleans()}))
ASK = [{"role": "user", "content": "Answer."}]
TOOL_FAMILY = "qwen2.5"  # a template with a tool-call format (Hermes), so that tools reach their grammar


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from lmkit import AsyncEngine, EngineConfig
    from lmkit.serve import ServerConfig, create_app

    folder = make_family_model(tmp_path_factory.mktemp(TOOL_FAMILY), FAMILIES[TOOL_FAMILY])
    engine = AsyncEngine(folder, EngineConfig(**FAMILY_ENGINE))
    server = ServerThread(create_app(engine, ServerConfig(model_name="tiny")))
    yield server, engine
    server.stop()
    engine.close()


def post(server, route: str, body: dict) -> httpx.Response:
    """``body`` as JSON text with lone surrogates escaped (\\udXXX), as a client in any language may send them."""
    return httpx.post(f"{server.url}{route}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def check(response: httpx.Response, body: dict) -> None:
    assert response.status_code < 500, (body, response.status_code, response.text[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"], (body, error)
        sent = json.dumps(body)  # hypothesis also draws strings from this file's constants: an echo is no leak
        for internal in ("panicked", "state dump"):
            assert internal not in error["message"] or internal in sent, (body, error)


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": ASK, "max_tokens": 3, "temperature": 0, **fields}


FIELDS = {
    "response_format": lambda v: chat(response_format={"type": "json_schema",
                                                       "json_schema": {"name": "answer", "schema": v}}),
    "guided_json": lambda v: chat(guided_json=v),
    "structured_outputs.json": lambda v: {"model": "tiny", "prompt": "Answer:", "max_tokens": 3,
                                          "structured_outputs": {"json": v}},
    "tools.parameters": lambda v: chat(tools=[{"type": "function", "function": {"name": "f", "parameters": v}}],
                                       tool_choice="required"),
}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_any_schema_gets_an_answer_or_a_400(api_server, tiny_engine, tool_server, field):
    route = "/v1/completions" if field.startswith("structured_outputs") else "/v1/chat/completions"
    server, engine = tool_server if field.startswith("tools") else (api_server, tiny_engine)
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=SCHEMA)
    def one(value):
        body = FIELDS[field](value)
        response = post(server, route, body)
        statuses.append(response.status_code)
        check(response, body)

    one()
    # some values were refused, by name; some compiled and ran
    assert len(statuses) == EXAMPLES and 400 in statuses and 200 in statuses, statuses
    assert_blocks_free(engine.engine, timeout_s=30)


@pytest.mark.parametrize("field", ["guided_regex", "guided_grammar", "guided_choice"])
def test_any_text_as_a_regex_grammar_or_choice_gets_an_answer_or_a_400(api_server, tiny_engine, field):
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=TEXT, more=st.lists(TEXT, max_size=5))
    def one(text, more):
        body = chat(**{field: [text, *more] if field == "guided_choice" else text})
        response = post(api_server, "/v1/chat/completions", body)
        statuses.append(response.status_code)
        check(response, body)

    one()
    assert len(statuses) == EXAMPLES
    assert_blocks_free(tiny_engine.engine, timeout_s=30)
