"""Scale-out through the proxy: request throughput of one api_server vs two behind `lmkit serve proxy`,
each node pinned to its own cores, in interleaved rounds.

    python benchmark/bench_scale_out.py [--model PATH] [--node-cores 0 1] [--rounds 3]
        [--concurrency 32] [--num-prompts 192] [--max-output 256] [--server-args "..."] [--node-quota CPUS]
        [--csv FILE] [--smoke]

Starts one api_server per --node-cores entry (a CPU list as taskset takes it, e.g. "0" or "0-3"; the node
gets that many engine threads), a proxy in front of the first node and one in front of all of them (both
unpinned, strategy min_expected_latency), warms every node up, then runs `profile_serving.py` (streamed
completions, ShareGPT-like lengths, `--concurrency` in flight) against the one-node proxy and the
all-node proxy, alternating which goes first, `--rounds` times. Reports each run's request throughput,
output tok/s, TTFT and TPOT p50 and the CPU seconds the proxy and each node spent during it (Linux
/proc), each round's throughput ratio, and the median ratio over the rounds.

On a machine with no spare core the benchmark client and the proxy share the nodes' cores; the CPU
columns show how much they took. --node-quota also limits each node to that many CPUs (a cgroup of its own,
cpu_limits.py), leaving the rest of its cores to the proxy and the client, as bench_ray_serve.py does for Ray.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cli_args import count, positive  # noqa: E402
from cpu_limits import QuotaGroup, confine, quota_groups  # noqa: E402
from summary import append_csv  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(spec: str) -> set[int]:
    """taskset's CPU list syntax: "0", "0-3", "0,2,4-5"."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _stat_cpu(path: str) -> tuple[str, float] | None:
    """(name, user + system CPU seconds so far) from a /proc stat file (a process's or one of its threads'),
    None where it is gone."""
    try:
        head, tail = Path(path).read_text().rsplit(")", 1)
    except OSError:
        return None
    fields = tail.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (NaN where /proc is missing)."""
    stat = _stat_cpu(f"/proc/{pid}/stat")
    return float("nan") if stat is None else stat[1]


def engine_cpu_seconds(pid: int) -> float:
    """User + system CPU so far of a process's engine threads (its loop and kernel team, named by the engine:
    ENGINE_THREAD_NAMES); the rest of the process's CPU is its server's (Python, the event loop, Ray's runtime).
    NaN where /proc is missing."""
    from lmkit.cpus import ENGINE_THREAD_NAMES

    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return float("nan")
    stats = (_stat_cpu(f"/proc/{pid}/task/{tid}/stat") for tid in threads)  # None: the thread ended
    return sum(cpu for name, cpu in filter(None, stats) if name.startswith(ENGINE_THREAD_NAMES))


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up within {timeout_s:.0f} s")


def nodes_up(proxy_url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(proxy_url + "/health", timeout=5) as r:
        return json.load(r)["num_nodes_up"]


def lmkit(args: list[str], log: Path, cpus: set[int] | None = None, threads: int | None = None,
          group: QuotaGroup | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "lmkit", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=confine(cpus, group))


def run_client(args, url: str, label: str, csv_path: Path, procs: dict[str, subprocess.Popen]) -> dict:
    cmd = [sys.executable, str(HERE / "profile_serving.py"), "--base-url", url, "--concurrency",
           str(args.concurrency), "--num-prompts", str(args.num_prompts), "--max-output", str(args.max_output),
           "--csv", str(csv_path), "--label", label, *args.client_args]
    if args.model:
        cmd += ["--tokenizer", args.model]

    def engines() -> float:
        return sum(engine_cpu_seconds(p.pid) for name, p in procs.items() if name.startswith("node"))

    before, engines_before = {name: cpu_seconds(p.pid) for name, p in procs.items()}, engines()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"profile_serving failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    with open(csv_path) as f:
        row = list(csv.DictReader(f))[-1]
    if int(row["num_failed"]):
        raise SystemExit(f"{label}: {row['num_failed']} requests failed:\n{run.stdout[-2000:]}")
    # (the window also holds the client's start, its tokenizer and workload, while the servers idle)
    row["cpu_s"] = {name: cpu_seconds(p.pid) - before[name] for name, p in procs.items()}
    row["engines_cpu_s"] = engines() - engines_before
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF or AWQ folder (default: the bundled SmolLM2)")
    ap.add_argument("--node-cores", nargs="+", default=None,
                    help="one CPU list per node (default: one CPU each for two nodes: the first two this "
                         "process may use)")
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--concurrency", type=count, default=32)
    ap.add_argument("--num-prompts", type=count, default=192,
                    help="per run; at 96 (3 x concurrency 32) the drain at the end, where one node may idle while "
                         "the other finishes, cost the two-node runs ~5%%")
    ap.add_argument("--max-output", type=count, default=256)
    ap.add_argument("--server-args", default="--session-len 4096 --cache-max-entry-count 0.3",
                    help="more api_server options, one string")
    ap.add_argument("--client-args", default="", help="more profile_serving.py options, one string")
    ap.add_argument("--csv", type=Path, default=None, help="append one row per run")
    ap.add_argument("--node-quota", type=positive, default=None,
                    help="CPUs each node may use, a cgroup quota on top of its pinning (needs a writable cgroup "
                         "file system)")
    ap.add_argument("--smoke", action="store_true", help="1 round, 4 short fixed-length requests at concurrency 2")
    args = ap.parse_args(argv)
    args.client_args = shlex.split(args.client_args)
    if args.smoke:
        args.rounds, args.concurrency, args.num_prompts = 1, 2, 4
        args.client_args += ["--workload", "fixed", "--input-len", "16", "--output-len", "4"]
    allowed = sorted(os.sched_getaffinity(0))
    if args.node_cores is None:
        if len(allowed) < 2:
            raise SystemExit("two nodes need two CPUs; this process may use one (pass --node-cores)")
        args.node_cores = [str(allowed[0]), str(allowed[1])]
    node_cpus = [parse_cpus(spec) for spec in args.node_cores]
    if len(node_cpus) < 2:
        raise SystemExit("--node-cores: give at least two CPU lists (one per node)")

    work = Path(tempfile.mkdtemp(prefix="scale_out_"))
    procs: dict[str, subprocess.Popen] = {}
    names = [f"node{i}" for i in range(len(node_cpus))]
    groups = [] if args.node_quota is None else quota_groups(args.node_quota, names)
    try:
        node_urls = []
        for i, cpus in enumerate(node_cpus):
            port = free_port()
            cmd = ["serve", "api_server", *([args.model] if args.model else []), "--host", "127.0.0.1", "--port",
                   str(port), "--num-threads", str(len(cpus)), "--log-level", "warning", *shlex.split(args.server_args)]
            procs[f"node{i}"] = lmkit(cmd, work / f"node{i}.log", cpus, len(cpus), groups[i] if groups else None)
            node_urls.append(f"http://127.0.0.1:{port}")
        proxy_urls = {}
        for name, nodes in (("one", node_urls[:1]), ("all", node_urls)):
            port = free_port()
            cmd = ["serve", "proxy", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
            for url in nodes:
                cmd += ["--node", url]
            procs[f"proxy_{name}"] = lmkit(cmd, work / f"proxy_{name}.log")
            proxy_urls[name] = f"http://127.0.0.1:{port}"
        for i, url in enumerate(node_urls):
            wait_up(url + "/health", procs[f"node{i}"])
        for name, url in proxy_urls.items():
            wait_up(url + "/health", procs[f"proxy_{name}"])
            expected = 1 if name == "one" else len(node_urls)
            deadline = time.monotonic() + 30  # until the proxy's health checks have seen every node
            while nodes_up(url) < expected:
                if time.monotonic() > deadline:
                    raise SystemExit(f"proxy {url}: {nodes_up(url)} of {expected} nodes up after 30 s")
                time.sleep(0.2)
        for url in node_urls:  # warm-up: first requests allocate and fault in the weights
            subprocess.run([sys.executable, str(HERE / "profile_serving.py"), "--base-url", url, "--concurrency", "2",
                            "--num-prompts", "4", "--workload", "fixed", "--input-len", "64", "--output-len", "16",
                            *(["--tokenizer", args.model] if args.model else [])], capture_output=True, check=True)

        csv_path = work / "runs.csv"
        setups = {"one": f"1 node (CPU {args.node_cores[0]})",
                  "all": f"{len(node_urls)} nodes (CPU {' / '.join(args.node_cores)})"}
        rows, ratios = [], []
        for r in range(args.rounds):
            order = ("one", "all") if r % 2 == 0 else ("all", "one")
            got = {}
            for name in order:
                row = run_client(args, proxy_urls[name], name, csv_path, procs)
                got[name] = row
                rows.append({"round": r + 1, "setup": setups[name], **row})
            ratios.append(float(got["all"]["request_throughput"]) / float(got["one"]["request_throughput"]))
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for group in groups:
            group.remove()

    names = list(procs)
    quota = f", each node limited to {args.node_quota:g} CPUs" if groups else ""
    print(f"scale-out through the proxy, {datetime.now():%Y-%m-%d %H:%M}{quota}: concurrency {args.concurrency}, "
          f"{args.num_prompts} requests per run, outputs <= {args.max_output}, api_server {args.server_args!r}")
    print(f"{'round':>5}  {'setup':<28}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}  "
          + "  ".join(f"{n + ' CPU s':>16}" for n in names) + f"{'engines CPU s':>15}")
    for row in rows:
        print(f"{row['round']:>5}  {row['setup']:<28}{float(row['request_throughput']):8.3f}"
              f"{float(row['output_tok_s']):11.1f}{float(row['ttft_p50_ms']):8.0f}ms"
              f"{float(row['tpot_p50_ms']):8.1f}ms  " + "  ".join(f"{row['cpu_s'][n]:16.1f}" for n in names)
              + f"{row['engines_cpu_s']:15.1f}")
    print(f"ratio ({len(node_cpus)} nodes / one node) per round: " + " ".join(f"{x:.2f}x" for x in ratios)
          + f"; median {statistics.median(ratios):.2f}x")
    if args.csv:
        append_csv(args.csv, ["date", "round", "setup", "concurrency", "num_requests", "request_throughput",
                              "output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms"]
                   + [f"{n}_cpu_s" for n in names],
                   [[row["date"], row["round"], row["setup"], row["concurrency"], row["num_requests"],
                     row["request_throughput"], row["output_tok_s"], row["ttft_p50_ms"], row["tpot_p50_ms"],
                     row["e2e_p50_ms"]] + [f"{row['cpu_s'][n]:.2f}" for n in names] for row in rows])
    return rows


if __name__ == "__main__":
    main()
