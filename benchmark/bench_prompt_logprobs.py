"""Prompt scoring throughput: tokens/s of scoring 512-token prompts through `lmkit serve api_server` at 8
concurrent requests (echo + logprobs, max_tokens 0: what an lm-eval loglikelihood request costs), side by side
with HF transformers scoring the same prompts (forward in the same --dtype + fp32 log_softmax gather, batches of
the same size).

    python benchmark/bench_prompt_logprobs.py [--model smollm2] [--prompt-tokens 512] [--concurrency 8]
        [--num-prompts 32] [--threads 2] [--rounds 2] [--csv benchmark/results/prompt_logprobs.csv] [--smoke]

The prompts are distinct windows of held-out text (pydoc's held-out topics, then Hamlet), sent as token ids.
The server runs in its own process with --num-threads; HF runs in this process with torch.set_num_threads,
after the server has stopped (never both at once). Each round scores every prompt once; a warm-up round goes
first. Reported: scored prompt tokens per second (mean over rounds), and the server's request latency p50/p90.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale_out import wait_up  # noqa: E402
from bench_server_hardening import cpu_name, free_port  # noqa: E402
from summary import append_csv, summarize  # noqa: E402


def prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    from lmkit.lite.corpora import hamlet, pydoc_evaluation

    ids = tokenizer.encode("\n\n".join(pydoc_evaluation() + hamlet()), add_special_tokens=False)
    if len(ids) < num * length:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than {num} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(num)]


async def score_round(url: str, batch: list[list[int]], concurrency: int) -> tuple[float, list[float]]:
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for p in batch:
        queue.put_nowait(p)
    latencies: list[float] = []

    async def worker(session) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            body = {"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise SystemExit(f"the server answered {r.status}: {data}")
            assert len(data["choices"][0]["logprobs"]["token_logprobs"]) == len(prompt)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def run_server(args, batch: list[list[int]]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "lmkit", "serve", "api_server", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--model-name", "m", "--num-threads", str(args.threads),
           "--dtype", args.dtype, "--max-batch-size", str(max(args.concurrency, 8)),
           "--session-len", str(args.prompt_tokens + 64)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(f"{url}/health", proc)
        asyncio.run(score_round(url, batch[:args.concurrency], args.concurrency))  # warm-up
        rates, lat = [], []
        for _ in range(args.rounds):
            seconds, latencies = asyncio.run(score_round(url, batch, args.concurrency))
            rates.append(sum(len(p) for p in batch) / seconds)
            lat += latencies
        return {"tok_s": sum(rates) / len(rates), "p50_s": summarize(lat)["p50"], "p90_s": summarize(lat)["p90"]}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_hf(args, folder: Path, batch: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32  # the same compute dtype as the server
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()

    def score(group: list[list[int]]) -> None:
        ids = torch.tensor(group)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
            logp.gather(-1, ids[:, 1:, None])
            logp.max(-1)  # the greedy check lm-eval makes

    score(batch[:args.concurrency])  # warm-up
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for i in range(0, len(batch), args.concurrency):
            score(batch[i:i + args.concurrency])
        rates.append(sum(len(p) for p in batch) / (time.perf_counter() - start))
    return {"tok_s": sum(rates) / len(rates), "p50_s": float("nan"), "p90_s": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers row")
    ap.add_argument("--csv", type=Path, default=HERE / "results" / "prompt_logprobs.csv")
    ap.add_argument("--smoke", action="store_true", help="a few short prompts, one round (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_tokens, args.num_prompts, args.concurrency, args.rounds = 64, 4, 2, 1

    from lmkit.model_path import resolve_model
    from lmkit.tokenizer import Tokenizer

    folder = resolve_model(args.model)
    batch = prompts(Tokenizer(folder), args.num_prompts, args.prompt_tokens)
    rows = {"lmkit api_server": run_server(args, batch)}
    if not args.no_hf:
        rows["HF transformers"] = run_hf(args, folder, batch)
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"# {cpu_name()}, {args.threads} threads, {folder.name}, {args.dtype}, {args.num_prompts} prompts x "
          f"{args.prompt_tokens} tokens, {args.concurrency} concurrent, {args.rounds} rounds, {stamp}")
    print(f"{'scorer':<20} {'tokens/s':>10} {'p50 s':>8} {'p90 s':>8}")
    for name, r in rows.items():
        print(f"{name:<20} {r['tok_s']:>10.1f} {r['p50_s']:>8.3f} {r['p90_s']:>8.3f}")
    if not args.smoke:
        append_csv(args.csv, ["date", "cpu", "threads", "model", "dtype", "prompt_tokens", "concurrency", "scorer",
                              "tok_s", "p50_s", "p90_s"],
                   [[stamp, cpu_name(), args.threads, folder.name, args.dtype, args.prompt_tokens, args.concurrency,
                     name, f"{r['tok_s']:.1f}", f"{r['p50_s']:.3f}", f"{r['p90_s']:.3f}"] for name, r in rows.items()])


if __name__ == "__main__":
    main()
