"""What a hostile or careless client costs an api_server: its start-up time, its idle memory, and how long
`/health` takes to answer while clients send prompts far larger than the context.

    python benchmark/bench_server_hardening.py [--model smollm2] [--attackers 4] [--prompt-mib 3.9]
        [--rounds 3] [--pythonpath DIR] [--server-args "..."] [--label NAME] [--csv FILE] [--smoke]

Starts `python -m lmkit serve api_server MODEL` on a free loopback port (with ``--pythonpath`` another copy
of lmkit, e.g. an older tree, runs instead), and measures:

- start-up: seconds from the process's start to the first 200 on /health;
- idle RSS: the server's resident memory once /health answers and it has been idle for a second (VmRSS);
  whether torch was loaded (its shared objects in /proc/PID/maps);
- /health under attack: ``--attackers`` clients at once each send a ``--prompt-mib`` MiB prompt (half to
  /v1/completions, half to /v1/chat/completions) that cannot fit the context, ``--rounds`` times, while a
  poller asks /health every 20 ms; reports the pollers' latency p50 / p99 / max over the attack and the
  attackers' statuses (a correct server answers every one with 400).

Run it on two trees in one session to compare (the CPU named in the output and the CSV).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from summary import append_csv, summarize  # noqa: E402

HEALTH_POLL_S = 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def start_server(model: str, port: int, pythonpath: str | None, server_args: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # run from an empty folder, so the working tree's packages never shadow the copy under test
    cwd = tempfile.mkdtemp(prefix="lmkit-bench-")
    cmd = [sys.executable, "-m", "lmkit", "serve", "api_server", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *server_args]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_healthy(session, url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


async def attack(session, url: str, model_name: str, attackers: int, prompt_bytes: int, rounds: int):
    """Health latencies (s) measured while the attack runs, and the attackers' statuses."""
    import aiohttp

    text = ("All work and no play makes Jack a dull boy. " * (prompt_bytes // 44 + 1))[:prompt_bytes]
    statuses: Counter = Counter()
    latencies: list[float] = []
    done = asyncio.Event()

    async def one(i: int) -> None:
        if i % 2 == 0:
            path, body = "/v1/completions", {"model": model_name, "prompt": text, "max_tokens": 4}
        else:
            path, body = "/v1/chat/completions", {"model": model_name, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": text}]}
        try:
            async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
                await r.read()
                statuses[r.status] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            statuses[type(e).__name__] += 1

    async def poll() -> None:
        while not done.is_set():
            started = time.perf_counter()
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            latencies.append(time.perf_counter() - started if ok else float("inf"))
            await asyncio.sleep(HEALTH_POLL_S)

    poller = asyncio.ensure_future(poll())
    for _ in range(rounds):
        await asyncio.gather(*(one(i) for i in range(attackers)))
    done.set()
    await poller
    return latencies, statuses


async def model_name_of(session, url: str) -> str:
    async with session.get(f"{url}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def measure(args) -> dict:
    import aiohttp

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start_server(args.model, port, args.pythonpath, shlex.split(args.server_args))
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc)
            startup_s = time.perf_counter() - started
            await asyncio.sleep(1.0)
            idle_rss = rss_mib(proc.pid)
            torch_loaded = has_torch(proc.pid)
            name = await model_name_of(session, url)
            latencies, statuses = await attack(session, url, name, args.attackers, int(args.prompt_mib * 2**20),
                                               args.rounds)
            peak_rss = rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stats = summarize([x for x in latencies if x != float("inf")])
    return {"startup_s": startup_s, "idle_rss_mib": idle_rss, "peak_rss_mib": peak_rss, "torch": torch_loaded,
            "health_n": len(latencies), "health_failed": sum(x == float("inf") for x in latencies),
            "health_p50_ms": stats["p50"] * 1e3, "health_p99_ms": stats["p99"] * 1e3,
            "health_max_ms": max((x for x in latencies if x != float("inf")), default=float("nan")) * 1e3,
            "attack_statuses": dict(statuses), "exit_code": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model folder or smollm2 (the bundled model)")
    p.add_argument("--attackers", type=int, default=4, help="oversized prompts sent at once")
    p.add_argument("--prompt-mib", type=float, default=3.9, help="size of each oversized prompt")
    p.add_argument("--rounds", type=int, default=3, help="attack waves")
    p.add_argument("--pythonpath", default=None, help="PYTHONPATH of the lmkit copy to run (default: installed)")
    p.add_argument("--server-args", default="", help="more api_server options")
    p.add_argument("--label", default="", help="names this tree in the output and CSV")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="one small attack, to check the script runs")
    args = p.parse_args()
    if args.smoke:
        args.attackers, args.prompt_mib, args.rounds = 2, 0.5, 1
    r = asyncio.run(measure(args))
    cpu = cpu_name()
    print(f"{args.label or 'lmkit'} ({args.model}, {cpu}): start-up {r['startup_s']:.2f} s, idle RSS "
          f"{r['idle_rss_mib']:.0f} MiB (torch loaded: {r['torch']}), peak RSS {r['peak_rss_mib']:.0f} MiB; "
          f"/health during {args.rounds} x {args.attackers} prompts of {args.prompt_mib} MiB: p50 "
          f"{r['health_p50_ms']:.1f} ms, p99 {r['health_p99_ms']:.1f} ms, max {r['health_max_ms']:.1f} ms over "
          f"{r['health_n']} polls ({r['health_failed']} failed); attackers got {r['attack_statuses']}; "
          f"exit code {r['exit_code']}")
    if args.csv:
        append_csv(args.csv, ["date", "cpu", "label", "model", "attackers", "prompt_mib", "rounds", "startup_s",
                              "idle_rss_mib", "peak_rss_mib", "torch", "health_p50_ms", "health_p99_ms",
                              "health_max_ms", "health_failed", "attack_statuses", "exit_code"],
                   [[datetime.now().isoformat(timespec="seconds"), cpu, args.label, args.model, args.attackers,
                     args.prompt_mib, args.rounds, f"{r['startup_s']:.3f}", f"{r['idle_rss_mib']:.1f}",
                     f"{r['peak_rss_mib']:.1f}", r["torch"], f"{r['health_p50_ms']:.2f}",
                     f"{r['health_p99_ms']:.2f}", f"{r['health_max_ms']:.2f}", r["health_failed"],
                     " ".join(f"{k}:{v}" for k, v in r["attack_statuses"].items()), r["exit_code"]]])


if __name__ == "__main__":
    main()
