"""Time to the first painted token of the chat page (GET /): from the click on Send to the first text of the answer
in the page's DOM, in a real headless Chromium (Debian's chromium and chromium-driver, driven by selenium), side
by side with the API's own time to first token (the first SSE chunk with text, read by httpx) on the same idle
server, same message, greedy.

    python benchmark/bench_chat_page.py [--model smollm2] [--rounds 5] [--threads 2] [--message "Hi"]

The server runs in its own process (`lmkit serve MODEL --num-threads N`); each round sends one message in a new
chat and waits for the whole answer before the next (an idle server each time). Reported: median, min and max of
both, and what the page adds (median difference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale_out import wait_up  # noqa: E402
from bench_server_hardening import cpu_name, free_port  # noqa: E402

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,760"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(120)
    return driver


# Clicks Send and resolves with the milliseconds from the click to the first text of the answer, once the whole
# answer is in (the Stop button hidden again).
PAGE_ROUND = """
const [message, done] = [arguments[0], arguments[arguments.length - 1]];
const box = document.getElementById('messages');
let first = null;
const seen = new MutationObserver(() => {
  const c = box.querySelectorAll('.msg.assistant .content');
  if (first === null && c.length && c[c.length - 1].textContent.trim()) first = performance.now();
});
seen.observe(box, {childList: true, subtree: true, characterData: true});
document.getElementById('input').value = message;
const start = performance.now();
document.getElementById('send').click();
const poll = setInterval(() => {
  if (first !== null && document.getElementById('stop').hidden) {
    clearInterval(poll); seen.disconnect(); done(first - start);
  }
}, 5);
"""


def api_ttft_ms(url: str, model: str, message: str, max_tokens: int) -> float:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": message}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = (time.perf_counter() - start) * 1e3
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--message", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "lmkit", "serve", args.model, "--port", str(port),
                               "--num-threads", str(args.threads)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    driver = None
    try:
        wait_up(url, server)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        driver = browser()
        driver.get(f"{url}/")
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")
        page, api = [], []
        for i in range(args.rounds + 1):  # the first of each is a warm-up
            driver.get(f"{url}/")
            while not driver.execute_script("return document.getElementById('model').options.length > 0"):
                time.sleep(0.02)
            driver.execute_script("document.getElementById('new-chat').click();"
                                  "document.getElementById('temperature').value = '0';"
                                  "document.getElementById('max_tokens').value = arguments[0];", str(args.max_tokens))
            painted = driver.execute_async_script(PAGE_ROUND, args.message)
            direct = api_ttft_ms(url, model, args.message, args.max_tokens)
            if i > 0:
                page.append(painted)
                api.append(direct)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
        print(f"# {cpu_name()}, {model}, {args.threads} threads, idle server, {args.rounds} rounds, {stamp}")
        for name, values in (("first painted token (page)", page), ("first token (API, SSE)", api)):
            print(f"{name:<28} median {statistics.median(values):6.1f} ms  min {min(values):6.1f}  "
                  f"max {max(values):6.1f}")
        print(f"the page adds {statistics.median(p - a for p, a in zip(page, api)):.1f} ms (median)")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
