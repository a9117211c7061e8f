"""What a hostile or careless client costs an api_server: its start-up time, its idle memory, and how long
`/health` and an ordinary chat request take while clients send what issue 63 found hurting it.

    python benchmark/bench_server_hardening.py [--model smollm2] [--mix oversized,choices,schema,scoring,copies]
        [--attackers 4] [--prompt-mib 3.9] [--rounds 3] [--pythonpath DIR] [--server-args "..."]
        [--label NAME] [--csv FILE] [--smoke]

Starts `python -m lmkit serve api_server MODEL` on a free loopback port (with ``--pythonpath`` another copy
of lmkit, e.g. an older tree, runs instead), and measures:

- start-up: seconds from the process's start to the first 200 on /health;
- idle RSS: the server's resident memory once /health answers and it has been idle for a second (VmRSS);
  whether torch was loaded (its shared objects in /proc/PID/maps);
- under each mix (``--mix``, comma-separated), ``--attackers`` clients at once, ``--rounds`` times, while a
  poller asks /health every 20 ms and a victim sends an ordinary chat request ("Hi", 16 tokens) again and again:
  the pollers' latency p50 / p99 / max, the victim's median latency against its median on the idle server
  (target <= 2x), the attackers' statuses and wall time, the RSS's peak (sampled with each poll) and two seconds
  after the attack (target: within 10% of idle). Mixes:
  - ``oversized``: a ``--prompt-mib`` MiB prompt that cannot fit the context (half to /v1/completions, half to
    /v1/chat/completions; a correct server answers 400);
  - ``choices``: ``guided_choice`` with 100,000 strings (0.9 MB, within the body limit; 400 past the choice bound);
  - ``schema``: ``guided_json`` given as a string nested 1,000 deep, and a JSON schema of 20,000 properties;
  - ``scoring``: an 8,100-token prompt scored with ``echo`` and ``logprobs: 20`` (one attacker per round: the
    work bound of one request; pass ``--server-args "--session-len 8192"``);
  - ``copies``: the same prompt and scores into ``n: 5`` completions, the most one answer may render
    (1.7M scores, an 85 MB answer; one attacker per round, ``--session-len 8192``).

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
MIXES = ("oversized", "choices", "schema", "scoring", "copies")
ONE_ATTACKER = ("scoring", "copies")
VICTIM = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}


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


def attack_requests(mix: str, model_name: str, prompt_bytes: int) -> list[tuple[str, dict]]:
    """(path, body) of each attacker of ``mix``, in turn."""
    text = ("All work and no play makes Jack a dull boy. " * (prompt_bytes // 44 + 1))[:prompt_bytes]
    chat = lambda **fields: {"model": model_name, "max_tokens": 4,  # noqa: E731
                             "messages": [{"role": "user", "content": "Pick one."}], **fields}
    if mix == "oversized":
        return [("/v1/completions", {"model": model_name, "prompt": text, "max_tokens": 4}),
                ("/v1/chat/completions", {"model": model_name, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": text}]})]
    if mix == "choices":
        return [("/v1/chat/completions", chat(guided_choice=[f"c{i:05d}" for i in range(100_000)]))]  # 0.9 MB
    if mix == "schema":
        deep = "[" * 1000 + "]" * 1000
        wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
        return [("/v1/chat/completions", chat(guided_json=deep)), ("/v1/chat/completions", chat(guided_json=wide))]
    if mix in ONE_ATTACKER:
        prompt = "All work and no play makes Jack a dull boy. " * 740  # ~8,100 SmolLM2 tokens
        return [("/v1/completions", {"model": model_name, "prompt": prompt, "max_tokens": 1, "echo": True,
                                     "logprobs": 20, "n": 5 if mix == "copies" else 1})]
    raise ValueError(f"unknown mix {mix!r}: one of {', '.join(MIXES)}")


async def timed_post(session, url: str, body: dict, timeout_s: float = 600) -> tuple[object, float]:
    import aiohttp

    started = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            await r.read()
            return r.status, time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__, time.perf_counter() - started


async def attack(session, url: str, pid: int, model_name: str, mix: str, attackers: int, prompt_bytes: int,
                 rounds: int):
    """(/health latencies (s), the victim's latencies (s), the attackers' statuses, the attack's wall seconds, the
    server's highest RSS sampled at each poll (MiB))."""
    import aiohttp

    requests = attack_requests(mix, model_name, prompt_bytes)
    statuses: Counter = Counter()
    latencies: list[float] = []
    victim: list[float] = []
    rss = [rss_mib(pid)]
    done = asyncio.Event()

    async def one(i: int) -> None:
        path, body = requests[i % len(requests)]
        status, _ = await timed_post(session, url + path, body)
        statuses[status] += 1

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
            rss.append(rss_mib(pid))
            await asyncio.sleep(HEALTH_POLL_S)

    async def ordinary() -> None:
        while not done.is_set():
            status, seconds = await timed_post(session, f"{url}/v1/chat/completions", {"model": model_name, **VICTIM})
            victim.append(seconds if status == 200 else float("inf"))

    side = [asyncio.ensure_future(poll()), asyncio.ensure_future(ordinary())]
    started = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one(i) for i in range(attackers)))
    wall = time.perf_counter() - started
    done.set()
    await asyncio.gather(*side)
    return latencies, victim, statuses, wall, max(rss)


async def model_name_of(session, url: str) -> str:
    async with session.get(f"{url}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def measure(args) -> dict:
    """Start-up and idle RSS of one server, then each mix of ``args.mixes`` in turn against it."""
    import aiohttp

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start_server(args.model, port, args.pythonpath, shlex.split(args.server_args))
    mixes = {}
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc)
            startup_s = time.perf_counter() - started
            await asyncio.sleep(1.0)
            idle_rss = rss_mib(proc.pid)
            torch_loaded = has_torch(proc.pid)
            name = await model_name_of(session, url)
            idle_victim = []
            for _ in range(5):
                _, seconds = await timed_post(session, f"{url}/v1/chat/completions", {"model": name, **VICTIM})
                idle_victim.append(seconds)
            idle_victim_s = sorted(idle_victim)[2]
            for mix in args.mixes:
                attackers = 1 if mix in ONE_ATTACKER else args.attackers
                latencies, victim, statuses, wall, peak_rss = await attack(
                    session, url, proc.pid, name, mix, attackers, int(args.prompt_mib * 2**20), args.rounds)
                await asyncio.sleep(args.settle_s)
                ok = [x for x in latencies if x != float("inf")]
                stats = summarize(ok)
                served = sorted(x for x in victim if x != float("inf"))
                mixes[mix] = {
                    "attackers": attackers, "attack_s": wall, "attack_statuses": dict(statuses),
                    "health_n": len(latencies), "health_failed": len(latencies) - len(ok),
                    "health_p50_ms": stats["p50"] * 1e3, "health_p99_ms": stats["p99"] * 1e3,
                    "health_max_ms": max(ok, default=float("nan")) * 1e3,
                    "victim_n": len(victim), "victim_failed": len(victim) - len(served),
                    "victim_p50_ms": (served[len(served) // 2] if served else float("nan")) * 1e3,
                    "victim_ratio": (served[len(served) // 2] / idle_victim_s) if served else float("nan"),
                    "peak_rss_mib": peak_rss, "rss_after_mib": rss_mib(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"startup_s": startup_s, "idle_rss_mib": idle_rss, "torch": torch_loaded,
            "victim_idle_ms": idle_victim_s * 1e3, "mixes": mixes, "exit_code": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model folder or smollm2 (the bundled model)")
    p.add_argument("--mix", default="oversized", help=f"comma-separated, of {', '.join(MIXES)}, or all")
    p.add_argument("--attackers", type=int, default=4, help="attack requests sent at once (scoring, copies: 1)")
    p.add_argument("--prompt-mib", type=float, default=3.9, help="size of each oversized prompt")
    p.add_argument("--rounds", type=int, default=3, help="attack waves")
    p.add_argument("--pythonpath", default=None, help="PYTHONPATH of the lmkit copy to run (default: installed)")
    p.add_argument("--server-args", default="", help="more api_server options")
    p.add_argument("--label", default="", help="names this tree in the output and CSV")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="one small attack, to check the script runs")
    args = p.parse_args()
    args.mixes = list(MIXES) if args.mix == "all" else [m.strip() for m in args.mix.split(",") if m.strip()]
    unknown = [m for m in args.mixes if m not in MIXES]
    if unknown or not args.mixes:
        p.error(f"argument --mix: {', '.join(unknown) or 'nothing'}: choose from {', '.join(MIXES)} or all")
    args.settle_s = 2.0  # after an attack, before the RSS is read
    if args.smoke:
        args.attackers, args.prompt_mib, args.rounds, args.settle_s = 2, 0.5, 1, 0.2
    r = asyncio.run(measure(args))
    cpu = cpu_name()
    label = args.label or "lmkit"
    print(f"{label} ({args.model}, {cpu}): start-up {r['startup_s']:.2f} s, idle RSS {r['idle_rss_mib']:.0f} MiB "
          f"(torch loaded: {r['torch']}), an ordinary chat request on the idle server {r['victim_idle_ms']:.0f} ms; "
          f"exit code {r['exit_code']}")
    rows = []
    for mix, m in r["mixes"].items():
        print(f"  {mix}: {args.rounds} x {m['attackers']} in {m['attack_s']:.1f} s, statuses {m['attack_statuses']}; "
              f"/health p50 {m['health_p50_ms']:.1f} ms, p99 {m['health_p99_ms']:.1f} ms, max "
              f"{m['health_max_ms']:.1f} ms over {m['health_n']} polls ({m['health_failed']} failed); ordinary "
              f"chat p50 {m['victim_p50_ms']:.0f} ms = {m['victim_ratio']:.2f}x idle over {m['victim_n']} "
              f"({m['victim_failed']} failed); RSS peak {m['peak_rss_mib']:.0f} MiB, {args.settle_s:g} s after "
              f"{m['rss_after_mib']:.0f} MiB ({m['rss_after_mib'] / r['idle_rss_mib']:.2f}x idle)")
        rows.append([datetime.now().isoformat(timespec="seconds"), cpu, args.label, args.model, mix, m["attackers"],
                     args.prompt_mib, args.rounds, f"{r['startup_s']:.3f}", f"{r['idle_rss_mib']:.1f}",
                     f"{m['peak_rss_mib']:.1f}", f"{m['rss_after_mib']:.1f}", r["torch"], f"{m['attack_s']:.2f}",
                     f"{m['health_p50_ms']:.2f}", f"{m['health_p99_ms']:.2f}", f"{m['health_max_ms']:.2f}",
                     m["health_failed"], f"{r['victim_idle_ms']:.1f}", f"{m['victim_p50_ms']:.1f}",
                     f"{m['victim_ratio']:.3f}", " ".join(f"{k}:{v}" for k, v in m["attack_statuses"].items()),
                     r["exit_code"]])
    if args.csv:
        append_csv(args.csv, ["date", "cpu", "label", "model", "mix", "attackers", "prompt_mib", "rounds",
                              "startup_s", "idle_rss_mib", "peak_rss_mib", "rss_after_mib", "torch", "attack_s",
                              "health_p50_ms", "health_p99_ms", "health_max_ms", "health_failed", "victim_idle_ms",
                              "victim_p50_ms", "victim_ratio", "attack_statuses", "exit_code"], rows)


if __name__ == "__main__":
    main()
