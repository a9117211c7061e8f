"""Cache-aware routing: the proxy's `prefix` strategy against `min_expected_latency` in front of the same
api_servers (prefix caching on), and one api_server alone, on a multi-tenant load and on a load with no shared
prefixes, in interleaved rounds.

    python benchmark/bench_prefix_routing.py [--model PATH] [--nodes 3] [--tenants 8] [--per-tenant 8]
        [--system-tokens 1200] [--concurrency 4] [--max-output 16] [--rounds 2] [--csv FILE] [--smoke]

Starts --nodes api_servers (`--enable-prefix-caching`, one engine thread each) and three proxies: `prefix` and
`min_expected_latency` in front of all of them, `min_expected_latency` in front of the first alone. Loads:
- tenants: --tenants system prompts of ~--system-tokens tokens (held-out pydoc text, a different slice each),
  --per-tenant short questions each, shuffled, --concurrency in flight, streamed chat completions of
  --max-output tokens;
- distinct: as many requests, each with a system prompt of its own (nothing to share).
Every run draws its prompts afresh (a run number heads each system prompt), so no run finds another's prefixes in
a node's cache. Per run: requests/s, TTFT mean / p50 / p99, and the cached share of prompt tokens (the nodes'
`lmkit_prefix_cache_hits_tokens_total` over `lmkit_prefix_cache_queries_tokens_total` during the run, from /metrics).
Reported: per round, TTFT mean of min_expected_latency over prefix, the cached share of prefix over the single
node's, and on the distinct load the throughput of prefix over min_expected_latency; their medians.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale_out import free_port, lmkit, nodes_up, wait_up  # noqa: E402
from cli_args import count  # noqa: E402
from summary import append_csv  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    """The node's prefix-cache counters from /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("lmkit_prefix_cache_hits_tokens_total", "lmkit_prefix_cache_queries_tokens_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def corpus_words() -> list[str]:
    from lmkit.lite.corpora import evaluation_corpus

    return " ".join(evaluation_corpus("pydoc")).split()


def make_load(kind: str, args, run: int, words: list[str]) -> list[list[dict]]:
    """The chat messages of every request of one run, in the order they are sent."""
    rng = random.Random(run)
    size = int(args.system_tokens * 0.75)  # ~1.3 tokens a word

    def system(i: int) -> str:
        start = rng.randrange(0, len(words) - size)
        return f"Run {run}, assistant {i}. Answer from this manual only.\n" + " ".join(words[start:start + size])

    n = args.tenants * args.per_tenant
    if kind == "tenants":
        prompts = [system(t) for t in range(args.tenants)]
        order = [t for t in range(args.tenants) for _ in range(args.per_tenant)]
        rng.shuffle(order)
        return [[{"role": "system", "content": prompts[t]}, {"role": "user", "content": f"Question {i}: what is "
                 f"{words[rng.randrange(len(words))]}?"}] for i, t in enumerate(order)]
    return [[{"role": "system", "content": system(i)}, {"role": "user", "content": "Summarize."}] for i in range(n)]


async def run_load(url: str, requests: list[list[dict]], args) -> dict:
    import aiohttp

    ttfts, queue = [], list(enumerate(requests))

    async def worker(session):
        while queue:
            _, messages = queue.pop(0)
            body = {"model": "m", "messages": messages, "max_tokens": args.max_output, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            start = time.perf_counter()
            first = None
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise SystemExit(f"{url}: {r.status} {await r.text()}")
                async for line in r.content:
                    if first is None and line.startswith(b"data: {") and b'"content"' in line:
                        first = time.perf_counter()
            ttfts.append((first or time.perf_counter()) - start)

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    ttfts.sort()
    return {"req_s": len(requests) / elapsed, "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF or AWQ folder (default: the bundled SmolLM2)")
    ap.add_argument("--nodes", type=count, default=3)
    ap.add_argument("--tenants", type=count, default=8)
    ap.add_argument("--per-tenant", type=count, default=8)
    ap.add_argument("--system-tokens", type=count, default=1200)
    ap.add_argument("--concurrency", type=count, default=4)
    ap.add_argument("--max-output", type=count, default=16)
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="2 nodes, 2 tenants x 2, short prompts, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.nodes, args.tenants, args.per_tenant, args.system_tokens, args.rounds = 2, 2, 2, 200, 1
        args.max_output, args.concurrency = 4, 2
    model = args.model or "smollm2"
    words = corpus_words()
    logs = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    procs, nodes = [], []
    try:
        for i in range(args.nodes):
            port = free_port()
            procs.append(lmkit(["serve", "api_server", model, "--port", str(port), "--served-model-name", "m",
                                "--enable-prefix-caching", "--num-threads", "1", "--session-len", "4096"],
                               logs / f"node{i}.log"))
            nodes.append(f"http://127.0.0.1:{port}")
        proxies = {}
        for label, strategy, members in (("prefix", "prefix", nodes), ("min_expected_latency", "min_expected_latency",
                                         nodes), ("one node", "min_expected_latency", nodes[:1])):
            port = free_port()
            procs.append(lmkit(["serve", "proxy", "--port", str(port), "--strategy", strategy,
                                *[a for n in members for a in ("--node", n)]], logs / f"proxy-{strategy}.log"))
            proxies[label] = f"http://127.0.0.1:{port}"
        for url, proc in zip([*nodes, *proxies.values()], procs):
            wait_up(url + "/health", proc)
        for label, url in proxies.items():  # a proxy's first health checks may have run before its nodes were up
            deadline, want = time.monotonic() + 120, 1 if label == "one node" else len(nodes)
            while nodes_up(url) < want:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url}: {nodes_up(url)} of {want} nodes up after 120 s")
                time.sleep(0.2)
        for n in nodes:  # warm-up: each node's first requests pay one-time costs
            asyncio.run(run_load(n, make_load("distinct", argparse.Namespace(**{**vars(args), "tenants": 1,
                                                                                "per_tenant": 2}), -1, words), args))
        rows, run = [], 0
        for r in range(args.rounds):
            for kind in ("tenants", "distinct"):
                labels = list(proxies) if kind == "tenants" else ["prefix", "min_expected_latency"]
                if r % 2:
                    labels.reverse()
                for label in labels:
                    run += 1
                    members = nodes if label != "one node" else nodes[:1]
                    before = [scrape(n) for n in members]
                    result = asyncio.run(run_load(proxies[label], make_load(kind, args, run, words), args))
                    after = [scrape(n) for n in members]
                    hits = sum(a.get("lmkit_prefix_cache_hits_tokens_total", 0) - b.get("lmkit_prefix_cache_hits_tokens_total", 0)
                               for a, b in zip(after, before))
                    queries = sum(a.get("lmkit_prefix_cache_queries_tokens_total", 0)
                                  - b.get("lmkit_prefix_cache_queries_tokens_total", 0) for a, b in zip(after, before))
                    rows.append({"round": r + 1, "load": kind, "routing": label, **result,
                                 "cached_share": hits / queries if queries else 0.0})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    print(f"cache-aware routing, {model}, {args.nodes} api_servers (1 engine thread each, prefix caching on), "
          f"{args.tenants} tenants x {args.per_tenant} requests, system prompts ~{args.system_tokens} tokens, "
          f"concurrency {args.concurrency}, {args.max_output} output tokens, {date.today()}")
    print(f"{'round':>5} {'load':>9} {'routing':>22} {'req/s':>7} {'TTFT mean':>10} {'p50':>8} {'p99':>8} "
          f"{'cached':>7}")
    for x in rows:
        print(f"{x['round']:>5} {x['load']:>9} {x['routing']:>22} {x['req_s']:7.2f} {x['ttft_mean_s'] * 1e3:8.0f}ms "
              f"{x['ttft_p50_s'] * 1e3:6.0f}ms {x['ttft_p99_s'] * 1e3:6.0f}ms {100 * x['cached_share']:6.1f}%")

    def pick(r, load, routing):
        return next(x for x in rows if x["round"] == r and x["load"] == load and x["routing"] == routing)

    ttft, share, distinct = [], [], []
    for r in range(1, args.rounds + 1):
        p, m, one = (pick(r, "tenants", k) for k in ("prefix", "min_expected_latency", "one node"))
        ttft.append(m["ttft_mean_s"] / p["ttft_mean_s"])
        share.append(p["cached_share"] / one["cached_share"] if one["cached_share"] else float("nan"))
        distinct.append(pick(r, "distinct", "prefix")["req_s"] / pick(r, "distinct", "min_expected_latency")["req_s"])
        print(f"round {r}: tenants TTFT mean min_expected_latency / prefix {ttft[-1]:.2f}x, cached share prefix / one "
              f"node {share[-1]:.2f}, throughput prefix / min_expected_latency {p['req_s'] / m['req_s']:.2f}x; "
              f"distinct throughput prefix / min_expected_latency {distinct[-1]:.2f}x")
    print(f"median over {args.rounds} rounds: TTFT {statistics.median(ttft):.2f}x, cached share "
          f"{statistics.median(share):.2f} of one node's, distinct throughput {statistics.median(distinct):.2f}x")
    if args.csv:
        append_csv(args.csv, ["date", "model", "round", "load", "routing", "req_s", "ttft_mean_s", "ttft_p50_s",
                              "ttft_p99_s", "cached_share"],
                   [[date.today(), model, x["round"], x["load"], x["routing"], f"{x['req_s']:.3f}",
                     f"{x['ttft_mean_s']:.4f}", f"{x['ttft_p50_s']:.4f}", f"{x['ttft_p99_s']:.4f}",
                     f"{x['cached_share']:.4f}"] for x in rows])
    return rows


if __name__ == "__main__":
    main()
