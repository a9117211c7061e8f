"""The chat page at / (serve/web) of the api_server and the proxy. Over plain HTTP: served whole, offline, with its
Content-Security-Policy, open without an API key while the API is not, gone with web_ui=False (--no-web-ui). In a
real headless Chromium (Debian's chromium and chromium-driver, driven by selenium): a streamed answer that grows on
screen and equals the server's own, Stop cancelling the engine's request, an API key asked for after a 401 and
then used, reasoning in a collapsed block, tool calls shown, and model text that never becomes markup."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import assert_blocks_free
from tests.serve.harness import ServerThread, wait_idle

KEY = "page-test-key"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def keyed_config(**kwargs):
    from lmkit.serve import GateConfig, ServerConfig

    return ServerConfig(model_name="tiny", gate=GateConfig(api_keys=(KEY,)), **kwargs)


@pytest.fixture(scope="module")
def keyed_server(tiny_engine):
    """The tiny model behind an API key."""
    from lmkit.serve import create_app

    server = ServerThread(create_app(tiny_engine, keyed_config()))
    yield server
    server.stop()


# ---- plain HTTP -------------------------------------------------------------------------------------------

def check_page(r: httpx.Response) -> None:
    """``r`` is the chat page: HTML, no cache, a policy that runs its own inline script only (by hash), nothing
    loaded from another origin."""
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8", r.headers
    assert r.headers["cache-control"] == "no-cache"
    policy = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'self'" and policy["connect-src"] == "'self'", policy
    for tag in ("script", "style"):
        (block,) = re.findall(rf"<{tag}>(.*?)</{tag}>", r.text, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert policy[f"{tag}-src"] == f"'sha256-{digest}'", (tag, policy)
    assert not re.search(r"""\b(src|href|action)\s*=\s*["']?\s*(https?:)?//""", r.text, re.I), "a remote asset"
    assert "@import" not in r.text and "url(" not in r.text
    assert len(r.content) < 30_000


def test_page_is_served_offline_with_its_policy(api_server):
    check_page(httpx.get(f"{api_server.url}/"))
    assert "/" not in httpx.get(f"{api_server.url}/openapi.json").json()["paths"]


def test_no_web_ui_leaves_the_root_unrouted(tiny_engine):
    from lmkit.serve import ServerConfig, create_app

    server = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", web_ui=False)))
    try:
        assert httpx.get(f"{server.url}/").status_code == 404
        assert httpx.get(f"{server.url}/v1/models").status_code == 200
    finally:
        server.stop()


def test_keys_open_the_page_and_nothing_else(keyed_server):
    url = keyed_server.url
    check_page(httpx.get(f"{url}/"))
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/"), ("GET", "/index.html"),
                         ("GET", "/openapi.json"), ("GET", "/metrics")]:
        r = httpx.request(method, f"{url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_gate_opens_only_get_of_the_page():
    from lmkit.serve import GateConfig

    config = GateConfig(api_keys=("k",))
    assert not config.needs_key("/", "GET") and not config.needs_key("/health", "GET")
    assert config.needs_key("/", "POST") and config.needs_key("//", "GET") and config.needs_key("/docs", "GET")
    assert not GateConfig().needs_key("/v1/models", "GET")


def test_proxy_serves_the_page(api_server):
    from lmkit.serve import GateConfig, ProxyConfig, create_proxy_app

    proxy = ServerThread(create_proxy_app(ProxyConfig(nodes=(api_server.url,), gate=GateConfig(api_keys=(KEY,)))))
    bare = ServerThread(create_proxy_app(ProxyConfig(web_ui=False)))
    try:
        check_page(httpx.get(f"{proxy.url}/"))
        assert httpx.get(f"{proxy.url}/v1/models").status_code == 401
        assert httpx.get(f"{bare.url}/").status_code == 404
    finally:
        proxy.stop()
        bare.stop()


def test_no_web_ui_option(monkeypatch):
    from typer.testing import CliRunner

    import lmkit.serve.api_server
    import lmkit.serve.proxy
    from lmkit.serve.cli import app

    seen = {}
    monkeypatch.setattr(lmkit.serve.api_server, "run_api_server", lambda model, engine, server, **kw:
                        seen.setdefault("api_server", []).append(server.web_ui))
    monkeypatch.setattr(lmkit.serve.proxy, "run_proxy", lambda config, log_level: seen.setdefault(
        "proxy", []).append(config.web_ui))
    runner = CliRunner()
    for command in ("api_server", "proxy"):
        for flags in ([], ["--no-web-ui"]):
            result = runner.invoke(app, [command, *flags])
            assert result.exit_code == 0, result.output
    assert seen == {"api_server": [True, False], "proxy": [True, False]}


# ---- in a browser -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    """A headless Chromium under selenium, with Debian's chromedriver (nothing downloaded)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("needs selenium: pip install -e '.[test]'")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,760"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


class Page:
    """The chat page of the server at ``url`` in ``driver``, with a clean browser storage."""

    def __init__(self, driver, url: str, wait_for_models: bool = True):
        self.driver = driver
        driver.get(f"{url}/")
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")
        driver.get(f"{url}/")
        if wait_for_models:
            self.until(lambda: self.js("return document.getElementById('model').options.length > 0"), "models")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def el(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def until(self, condition, what: str, timeout_s: float = 20.0, poll_s: float = 0.02):
        deadline = time.monotonic() + timeout_s
        while not (value := condition()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(poll_s)
        return value

    def settings(self, **values: str) -> None:
        self.el("details.settings summary").click()
        for name, value in values.items():
            field = self.el(f"#{name}")
            field.clear()
            field.send_keys(value)

    def send(self, text: str) -> None:
        self.el("#input").send_keys(text)
        self.el("#send").click()

    def answer_text(self) -> str:
        return self.js("const c = document.querySelectorAll('.msg.assistant .content'); "
                       "return c.length ? c[c.length - 1].textContent : '';")

    def wait_answered(self, num_answers: int = 1) -> dict:
        """The last answer as the page stored it, once ``num_answers`` answers are done."""
        self.until(lambda: self.js("return document.getElementById('stop').hidden && "
                                   "document.querySelectorAll('.msg.assistant').length === arguments[0]",
                                   num_answers), "the answer")
        (chat,) = json.loads(self.js("return localStorage.getItem('lmkit.chats')"))
        return chat["messages"][-1]


def direct(url: str, body: dict, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", **body}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_streamed_answer_grows_and_equals_the_servers(browser, slow_server):
    server, _ = slow_server
    page = Page(browser, server.url)
    page.settings(temperature="0", max_tokens="100")
    page.js("window.seenLengths = []; const box = document.getElementById('messages');"
            "new MutationObserver(() => { const c = box.querySelector('.msg.assistant .content');"
            "  if (c) window.seenLengths.push(c.textContent.length); })"
            ".observe(box, {childList: true, subtree: true, characterData: true});")
    page.send("hello")
    message = page.wait_answered()
    expected = direct(server.url, {"messages": [{"role": "user", "content": "hello"}], "temperature": 0,
                                   "max_tokens": 100})
    assert message["content"] == expected["message"]["content"] and message["finish_reason"] == "length"
    assert message["num_tokens"] == 100 and not message.get("error") and not message.get("stopped")
    assert page.answer_text().strip(), "nothing painted"
    assert len(set(page.js("return window.seenLengths"))) >= 3, "the answer was not painted as it streamed"
    assert "100 tokens" in page.el(".msg.assistant .meta").text


def metric_total(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_stop_cancels_the_engine_request(browser, slow_server):
    server, engine = slow_server
    page = Page(browser, server.url)
    page.settings(temperature="0", max_tokens="480")
    generated_before = engine.metrics().num_generated_tokens
    finished_before = metric_total(server.url, "lmkit_requests_total")
    page.send("hello")
    page.until(page.answer_text, "the first text", poll_s=0.002)
    page.el("#stop").click()
    message = page.wait_answered()
    wait_idle(engine=engine)
    assert_blocks_free(engine)
    assert message["stopped"] and message["content"] and "finish_reason" not in message, message
    num_generated = engine.metrics().num_generated_tokens - generated_before
    assert 0 < num_generated < 480, num_generated
    assert metric_total(server.url, "lmkit_requests_total") == finished_before  # cancelled, not finished
    assert "stopped" in page.el(".msg.assistant .meta").text and page.el("#send").is_displayed()


def test_api_key_asked_for_and_used(browser, keyed_server):
    page = Page(browser, keyed_server.url, wait_for_models=False)
    page.until(lambda: page.el("#key-form").is_displayed(), "the key form")
    assert page.js("return document.getElementById('model').options.length") == 0
    page.el("#key-input").send_keys("wrong\n")
    page.until(lambda: page.el("#key-message").text == "Incorrect API key provided.", "the key asked again")
    assert page.el("#key-form").is_displayed()
    page.el("#key-input").send_keys(KEY + "\n")
    page.until(lambda: not page.el("#key-form").is_displayed(), "the key form to close")
    page.until(lambda: page.js("return document.getElementById('model').value") == "tiny", "the models")
    page.settings(temperature="0", max_tokens="8")
    page.send("hi")
    message = page.wait_answered()
    expected = direct(keyed_server.url, {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                         "max_tokens": 8}, key=KEY)
    assert message["content"] == expected["message"]["content"] and not message.get("error"), message
    assert page.js("return sessionStorage.getItem('lmkit.apiKey')") == KEY
    assert KEY not in page.js("return JSON.stringify(localStorage)")


def test_reasoning_is_collapsed_and_tool_calls_shown(browser, tiny_engine):
    from lmkit.serve import ServerConfig, create_app

    thinking = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", reasoning_parser="deepseek_r1")))
    tools = ServerThread(create_app(tiny_engine, ServerConfig(model_name="tiny", tool_call_parser="hermes")))
    try:
        page = Page(browser, thinking.url)
        page.settings(temperature="0", max_tokens="12")
        page.send("hi")
        message = page.wait_answered()
        expected = direct(thinking.url, {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                         "max_tokens": 12})["message"]
        assert message["reasoning"] == expected["reasoning_content"] and not message["content"], message
        details = page.el(".msg.assistant details.reasoning")
        assert details.is_displayed() and details.get_attribute("open") is None
        assert page.js("return arguments[0].querySelector('.text').textContent", details) == message["reasoning"]

        # the page sends no tools: its stream reader and view are given a real streamed tool call
        page = Page(browser, tools.url)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200,
                "seed": 2, "temperature": 1.0, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}
        shown = page.driver.execute_async_script("""
            const [body, done] = arguments;
            const message = {role: "assistant", content: ""};
            fetch("v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                          body: JSON.stringify({...body, stream: true})})
              .then((r) => readEvents(r, (chunk) => applyChunk(message, chunk)))
              .then(() => {
                message.done = true;
                const view = messageView(message);
                document.getElementById("messages").append(view);
                done({message, names: [...view.querySelectorAll(".tool .name")].map((e) => e.textContent),
                      args: [...view.querySelectorAll(".tool pre")].map((e) => e.textContent)});
              }, (e) => done({error: String(e)}));""", body)
        expected = direct(tools.url, body)
        (call,) = expected["message"]["tool_calls"]
        arguments = call["function"]["arguments"]
        assert shown["message"]["tool_calls"] == [{"name": "get_weather", "arguments": arguments}], shown
        assert shown["message"]["finish_reason"] == expected["finish_reason"] and shown["names"] == ["get_weather"]
        try:  # complete arguments are shown indented, cut ones as they came
            assert json.loads(shown["args"][0]) == json.loads(arguments)
        except json.JSONDecodeError:
            assert shown["args"] == [arguments]
    finally:
        thinking.stop()
        tools.stop()


ALLOWED_TAGS = {"P", "BR", "STRONG", "EM", "DEL", "CODE", "PRE", "A", "H1", "H2", "H3", "H4", "H5", "H6", "UL", "OL",
                "LI", "HR"}


def test_model_text_never_becomes_markup(browser, api_server):
    page = Page(browser, api_server.url)
    render = ("const box = document.createElement('div'); box.innerHTML = renderMarkdown(arguments[0]);"
              "return {text: box.textContent, html: box.innerHTML, elements: [...box.querySelectorAll('*')].map("
              "(e) => [e.tagName, Object.fromEntries([...e.attributes].map((a) => [a.name, a.value])),"
              "        e.textContent])};")
    hostile = ('<img src=x onerror="window.pwned=1"> <script>window.pwned=1</script> [x](javascript:alert(1)) '
               '[y](https://a.example/p_q_"onmouseover="window.pwned=1) **<b>b</b>** `<i>` _<svg onload=x>_\n'
               '```html" onclick="x\n<iframe src="https://evil.example"></iframe>\n```\n\x00<u>\x00')
    out = page.js(render, hostile)
    for tag, attributes, _ in out["elements"]:
        assert tag in ALLOWED_TAGS, out["html"]
        for name, value in attributes.items():
            assert (name, tag) in {("href", "A"), ("target", "A"), ("rel", "A"), ("data-lang", "PRE")}, out["html"]
            assert name != "href" or re.match(r"https?://", value), value
    assert page.js("return window.pwned === undefined")
    assert "<script>" in out["text"] and '<img src=x onerror="window.pwned=1">' in out["text"]
    links = [a for t, a, _ in out["elements"] if t == "A"]
    assert links == [{"href": 'https://a.example/p_q_"onmouseover="window.pwned=1', "target": "_blank",
                      "rel": "noopener noreferrer"}], links

    markdown = ("# Title\n\nSome **bold**, *it* and `code` with a [link](https://lmkit.example/a_b).\n\n"
                "- one\n- two\n\n1. first\n2. second\n\n```python\nprint('<hi>')\n```\n")
    out = page.js(render, markdown)
    assert [(t, text) for t, _, text in out["elements"] if t != "P"] == [
        ("H1", "Title"), ("STRONG", "bold"), ("EM", "it"), ("CODE", "code"), ("A", "link"), ("UL", "onetwo"),
        ("LI", "one"), ("LI", "two"), ("OL", "firstsecond"), ("LI", "first"), ("LI", "second"),
        ("PRE", "print('<hi>')"), ("CODE", "print('<hi>')")]
