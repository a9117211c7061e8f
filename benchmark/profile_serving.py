"""Serving benchmark: drives any OpenAI-compatible server over HTTP with streamed requests.

    python benchmark/profile_serving.py --base-url http://127.0.0.1:23333 --concurrency 1 8 32
        [--request-rate R] [--num-prompts N] [--endpoint completions|chat] [--tokenizer HF_FOLDER]
        [--workload sharegpt|fixed | --dataset ShareGPT.json] [--input-len 128 --output-len 128] [--csv results.csv]
        [--label NAME]

Workload: the ShareGPT-like lengths of ``benchmark/workloads.py`` (prompt token ids decoded to text with
``--tokenizer``, default the bundled SmolLM2), or with ``--dataset`` a real ShareGPT JSON file (first turn
as written, second turn's token count as output length, vLLM's filter). Every request asks for its drawn
output length with ``ignore_eos`` (``--no-ignore-eos`` for servers without that extension) and
stream_options.include_usage. HTTP through aiohttp, as vLLM's serving benchmark.
Load: a fixed number of requests in flight (``--concurrency``), or Poisson arrivals at
``--request-rate`` per second (with ``--concurrency`` as a cap).

Per level: request throughput, output tokens/s, TTFT (first content chunk), TPOT ((e2e - ttft) /
(tokens - 1)), ITL (gaps between content chunks) and end-to-end latency, mean / p50 / p90 / p99; and
from an lmkit api_server's Prometheus /metrics (polled every 0.2 s during the level, so a level of
millisecond requests may read 0) the peak KV-cache usage and the
level's prefix-cache hit rate ("-" for servers without them, e.g. another engine or the proxy).
``--smoke``: 4 short requests at concurrency 1 and 2 (for tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from cli_args import count, positive  # noqa: E402
from summary import STAT_KEYS, append_csv, summarize  # noqa: E402


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def nan_dash(x: float, width: int) -> str:
    """x with 3 decimals, or "-" when the server did not report it (NaN), right-aligned in width."""
    return f"{'-' if x != x else format(x, '.3f'):>{width}}"


def scrape(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page (enough for lmkit's engine gauges and counters)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class ServerGauges:
    """KV usage (peak over the level, sampled every 0.2 s) and the level's prefix-cache hit rate, read from
    the server's Prometheus /metrics when it is an lmkit api_server; NaN for servers without them."""

    def __init__(self, session, base_url: str):
        self.session, self.url, self.peak_kv, self.start = session, base_url + "/metrics", float("nan"), None
        self.hit_rate = float("nan")

    async def read(self) -> dict[str, float] | None:
        import aiohttp

        try:
            async with self.session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                m = scrape(await r.text()) if r.status == 200 else {}
        except Exception:  # noqa: BLE001 - any failure: no server gauges
            return None
        return m if "lmkit_kv_cache_usage_ratio" in m else None

    async def poll(self, done: asyncio.Event) -> None:
        self.start = await self.read()
        if self.start is None:
            return
        while not done.is_set():
            m = await self.read()
            if m is not None:
                usage = m["lmkit_kv_cache_usage_ratio"]
                self.peak_kv = usage if self.peak_kv != self.peak_kv else max(self.peak_kv, usage)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 0.2)
        end = await self.read()
        key_q, key_h = "lmkit_prefix_cache_queries_tokens_total", "lmkit_prefix_cache_hits_tokens_total"
        if end is not None and key_q in end and key_h in end:
            queried = end[key_q] - self.start.get(key_q, 0.0)
            self.hit_rate = (end[key_h] - self.start.get(key_h, 0.0)) / queried if queried > 0 else 0.0


async def one_request(session, args, model: str, prompt: str, prompt_tokens: int, output_len: int) -> Result:
    body = {"model": model, "max_tokens": output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    result = Result(False, prompt_tokens)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(args.base_url + path, json=body) as r:
            if r.status != 200:
                result.error = f"{r.status}: {(await r.read())[:200]!r}"
                return result
            async for line in r.content:  # SSE: one "data: {...}" line per chunk, blank lines between
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices", []):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        chunks += 1
    except Exception as e:  # a benchmark reports failures instead of stopping
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def open_session(args, connections: int):
    """The client's HTTP session: aiohttp, as vLLM's serving benchmark: its C parser takes ~40 us of CPU per
    streamed chunk, httpx ~120 us, on the cores that also run the servers. No overall timeout (a level may
    take minutes)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 20,
                                 connector=aiohttp.TCPConnector(limit=connections))


async def first_model(args) -> str:
    async with open_session(args, 1) as session, session.get(args.base_url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def run_level(args, model: str, requests: list, concurrency: int) -> dict:
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(concurrency)
    async with open_session(args, concurrency + 4) as session:
        async def gated(prompt, n_prompt, out_len):
            async with sem:
                return await one_request(session, args, model, prompt, n_prompt, out_len)

        gauges, done = ServerGauges(session, args.base_url), asyncio.Event()
        poller = asyncio.ensure_future(gauges.poll(done))
        started = time.perf_counter()
        tasks = []
        for prompt, n_prompt, out_len in requests:
            tasks.append(asyncio.ensure_future(gated(prompt, n_prompt, out_len)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        done.set()
        await poller
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "request_rate": args.request_rate or 0.0, "num_requests": len(results),
        "num_failed": len(results) - len(ok), "errors": [r.error for r in results if not r.ok][:3],
        "elapsed_s": elapsed, "request_throughput": len(ok) / elapsed,
        "output_tok_s": sum(r.output_tokens for r in ok) / elapsed,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / elapsed,
        "ttft": summarize([r.ttft_s for r in ok]), "tpot": summarize(tpot),
        "itl": summarize([x for r in ok for x in r.itl_s]), "e2e": summarize([r.e2e_s for r in ok]),
        "peak_kv_usage": gauges.peak_kv, "prefix_hit_rate": gauges.hit_rate,
    }


def make_requests(args, tokenizer, num: int, seed: int) -> list[tuple[str, int, int]]:
    if args.dataset:  # a real ShareGPT file: the prompts as written
        reqs = workloads.sharegpt_file(args.dataset, tokenizer, num, seed, max_prompt=args.max_prompt,
                                       max_total=args.max_prompt + args.max_output)
        return [(r.text, len(r.prompt_ids), min(r.output_len, args.max_output)) for r in reqs]
    if args.workload == "fixed":
        reqs = workloads.fixed(tokenizer, num, args.input_len, args.output_len, seed)
    else:
        reqs = workloads.sharegpt_like(tokenizer, num, seed, max_prompt=args.max_prompt,
                                       max_total=args.max_prompt + args.max_output)
        reqs = [workloads.Request(r.prompt_ids, min(r.output_len, args.max_output)) for r in reqs]
    return [(tokenizer.decode(r.prompt_ids), len(r.prompt_ids), r.output_len) for r in reqs]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:23333")
    ap.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tokenizer", default=None, help="HF folder for the workload's text (default: bundled SmolLM2)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--concurrency", type=count, nargs="+", default=[1, 8, 32])
    ap.add_argument("--request-rate", type=positive, default=None,
                    help="Poisson arrivals per second (default: all at once, capped by concurrency)")
    ap.add_argument("--num-prompts", type=count, default=None, help="per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--workload", choices=["sharegpt", "fixed"], default="sharegpt")
    ap.add_argument("--dataset", type=Path, default=None, help="a ShareGPT JSON file instead of the generator")
    ap.add_argument("--input-len", type=count, default=128)
    ap.add_argument("--output-len", type=count, default=128)
    ap.add_argument("--max-prompt", type=count, default=1024)
    ap.add_argument("--max-output", type=count, default=1024, help="cap on the drawn output lengths")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0: greedy, the usual benchmark setting; 1: the "
                         "OpenAI API's default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a name for this run in the CSV (e.g. direct, proxy)")
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="4 short requests at concurrency 1 and 2")
    args = ap.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.smoke:
        args.concurrency, args.num_prompts, args.workload, args.input_len, args.output_len = [1, 2], 4, "fixed", 16, 4
    workload = workloads.describe(args.workload, args.dataset)

    from lmkit.model_path import resolve_model
    from lmkit.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.tokenizer))
    model = args.model or asyncio.run(first_model(args))
    asyncio.run(run_level(args, model, make_requests(args, tokenizer, 1, 10_000)[:1], 1))  # warm up
    rows = []
    for c in args.concurrency:
        num = args.num_prompts or max(8, 2 * c)
        rows.append(asyncio.run(run_level(args, model, make_requests(args, tokenizer, num, args.seed + c), c)))
    print(f"{args.base_url} model {model} endpoint {args.endpoint} workload {workload} {args.label} {date.today()}")
    print(f"{'conc':>5}{'reqs':>6}{'fail':>5}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'E2E p50':>9}{'KV peak':>8}{'prefix hit':>11}")
    for r in rows:
        print(f"{r['concurrency']:>5}{r['num_requests']:>6}{r['num_failed']:>5}{r['request_throughput']:8.3f}"
              f"{r['output_tok_s']:11.1f}{r['ttft']['p50'] * 1e3:8.1f}ms{r['ttft']['p99'] * 1e3:8.1f}ms"
              f"{r['tpot']['p50'] * 1e3:8.1f}ms{r['tpot']['p99'] * 1e3:8.1f}ms{r['itl']['p50'] * 1e3:7.1f}ms"
              f"{r['itl']['p99'] * 1e3:7.1f}ms{r['e2e']['p50']:8.2f}s{nan_dash(r['peak_kv_usage'], 8)}"
              f"{nan_dash(r['prefix_hit_rate'], 11)}")
        for e in r["errors"]:
            print(f"  error: {e}")
    if args.csv:
        append_csv(args.csv, ["date", "label", "base_url", "model", "endpoint", "workload", "concurrency",
                              "request_rate", "num_requests", "num_failed", "request_throughput", "input_tok_s",
                              "output_tok_s"]
                   + [f"{k}_{p}_ms" for k in ("ttft", "tpot", "itl", "e2e") for p in STAT_KEYS]
                   + ["peak_kv_usage", "prefix_hit_rate"],
                   [[date.today(), args.label, args.base_url, model, args.endpoint, workload, r["concurrency"],
                     r["request_rate"], r["num_requests"], r["num_failed"], f"{r['request_throughput']:.4f}",
                     f"{r['input_tok_s']:.2f}", f"{r['output_tok_s']:.2f}"]
                    + [f"{r[k][p] * 1e3:.2f}" for k in ("ttft", "tpot", "itl", "e2e") for p in STAT_KEYS]
                    + [nan_dash(r["peak_kv_usage"], 0).strip(), nan_dash(r["prefix_hit_rate"], 0).strip()]
                    for r in rows])
    return rows


if __name__ == "__main__":
    main()
