"""lmkit on Ray Serve, on a local Ray cluster of two processes (a head and a worker node, one CPU each):
replicas answer the official openai client, streamed and not, with api_server's errors and keys; a replica
killed mid-load is replaced while its streams end cleanly and new requests succeed; autoscaling goes from 1
to 2 replicas under a burst and back; `lmkit serve ray` drains and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason='lmkit.serve.ray needs the ray extra: pip install -e ".[ray]"')
pytestmark = pytest.mark.slow  # every test here runs on a Ray cluster this module starts (~3 min in all)

from tests.serve.harness import (free_port, leave_long_completion, lmkit_subprocess,  # noqa: E402
                                 streams_in_progress)

KEY = "ray-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(device="cpu", dtype="float32", cache_max_entry_count=256, max_batch_size=8, cache_block_seq_len=16,
              session_len=512, num_threads=1)


def ray_env() -> dict[str, str]:
    """The Ray processes' settings: lmkit's, with autoscaling metrics pushed often (decisions in seconds)."""
    from lmkit.serve.ray import RAY_SERVE_ENV, cluster_auth_env

    return {**RAY_SERVE_ENV, **cluster_auth_env(), "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "RAY_USAGE_STATS_ENABLED": "0"}


def ray_command(*args: str) -> None:
    ray_bin = str(Path(sys.executable).parent / "ray")
    done = subprocess.run([ray_bin, *args], env={**os.environ, **ray_env()}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"ray {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a worker node as separate processes on this machine; Serve's proxy on a free port."""
    import ray
    from ray import serve

    port = free_port()
    metrics_ports = [free_port(), free_port()]  # each node's metrics agent (Prometheus text)
    node = ["--num-cpus", "1", "--object-store-memory", str(80 * 2**20), "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1"]
    ray_command("start", "--head", "--port", str(port), "--include-dashboard=false",
                "--metrics-export-port", str(metrics_ports[0]), *node)
    try:
        ray_command("start", "--address", f"127.0.0.1:{port}", "--metrics-export-port", str(metrics_ports[1]), *node)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        # picked only now: the two nodes' processes took their ephemeral ports meanwhile (a port picked before
        # `ray start` was once taken by one of them, and Serve's proxy could not bind it)
        http_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield {"address": f"127.0.0.1:{port}", "url": f"http://127.0.0.1:{http_port}",
               "metrics": [f"http://127.0.0.1:{p}/metrics" for p in metrics_ports]}
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        ray_command("stop", "--force")


def replica_pids(app: str, deployment: str) -> set[int]:
    """Process ids of the live replicas of ``deployment``: Ray titles them ray::ServeReplica:APP:DEPLOYMENT when
    idle and ray::ServeReplica:APP:DEPLOYMENT.METHOD while a method runs (a replica still closing a stream or
    pushing its metrics)."""
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    name = f.read().split(b"\0")[0].strip()
                    if name == title or name.startswith(title + b"."):
                        pids.add(int(entry))
            except OSError:
                pass
    return pids


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def two_replicas(ray_cluster, slow_llama):
    """The slow model as `tiny` on two replicas (half a CPU each), API keys on."""
    from ray import serve

    from lmkit import EngineConfig
    from lmkit.serve import GateConfig, ServerConfig
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy

    app = build_app({"tiny": str(slow_llama)}, EngineConfig(**ENGINE), ServerConfig(gate=GateConfig(api_keys=(KEY,))),
                    ReplicaConfig(min_replicas=2, max_replicas=2, num_cpus_per_replica=0.5))
    deploy(app, "lmkit", "/")
    yield ray_cluster["url"]
    serve.delete("lmkit")


def engine_states(app: str, deployment: str, calls: int = 12) -> dict[int, dict]:
    """engine_state() of the replicas that answer ``calls`` calls, by process id."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    states = [handle.engine_state.remote().result(timeout_s=30) for _ in range(calls)]
    return {s["pid"]: s for s in states}


def assert_engines_idle(app: str, deployment: str) -> None:
    def idle():
        states = engine_states(app, deployment)
        return all(s["num_running"] == 0 and s["num_waiting"] == 0 and
                   s["num_free_blocks"] + s["num_cached_blocks"] == s["num_total_blocks"] for s in states.values())
    wait_for(idle, 20, f"every replica of {deployment} idle with all its KV blocks free")


def test_two_replicas_answer_the_openai_client(two_replicas):
    import openai

    url = two_replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    greedy = r.choices[0].message.content
    parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
    chunks = list(parts)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 5
    # concurrent requests spread over both replicas by Ray's router (each answer names its replica); both nodes run
    # a proxy on the one port, so with RAY_SERVE_ENV's local-node preference off the split is not the kernel's
    # spread of connections over proxies
    replicas: list[str] = []

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"p{i}", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            replicas.append(r.headers["x-lmkit-replica"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(replicas) == 8 and len(set(replicas)) == 2, replicas
    assert len(replica_pids("lmkit", "model-tiny")) == 2
    assert_engines_idle("lmkit", "model-tiny")


def test_errors_and_keys_as_api_server(two_replicas):
    url = two_replicas
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open, as api_server's probe
    denied = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json",
                     headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    impossible = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                            headers=AUTH, timeout=30)
    assert impossible.status_code == 400 and impossible.json()["error"]["param"] == "max_tokens", impossible.text
    huge = httpx.post(f"{url}/v1/completions", content=b"x" * (2**20 + 1), headers=AUTH, timeout=30)
    assert huge.status_code == 413, huge.text
    metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)  # the replica that answers
    assert metrics.status_code == 200 and 'vllm:num_requests_running{model_name="tiny"}' in metrics.text


def test_replicas_export_engine_gauges_through_rays_metrics_agent(two_replicas, ray_cluster):
    """Each replica's health check sets its engine gauges; Ray's metrics agents export them (ray_ prefix),
    tagged with the model and the replica."""
    from prometheus_client.parser import text_string_to_metric_families

    def exported() -> dict[str, list]:
        samples: dict[str, list] = {}
        for url in ray_cluster["metrics"]:
            try:
                text = httpx.get(url, timeout=10).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                if family.name.startswith("ray_lmkit_"):
                    samples.setdefault(family.name, []).extend(family.samples)
        return samples if len({s.labels.get("replica") for s in samples.get("ray_lmkit_num_requests_running", [])
                               if s.labels.get("model_name") == "tiny"}) == 2 else {}

    samples = wait_for(exported, 60, "both replicas' lmkit gauges in Ray's metrics export")
    for name in ("ray_lmkit_num_requests_running", "ray_lmkit_num_requests_waiting", "ray_lmkit_kv_cache_usage_ratio"):
        tiny = [s for s in samples[name] if s.labels.get("model_name") == "tiny"]
        assert tiny and all(s.labels["deployment"] == "model-tiny" and s.value >= 0 for s in tiny), samples[name]


def test_a_client_that_leaves_frees_its_engine_request(two_replicas):
    url = two_replicas
    for _ in range(2):
        body = {"model": "tiny", "prompt": "leave", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            next(lines), next(lines)  # generating; then the client goes
        body = {"model": "tiny", "prompt": "leave", "max_tokens": 500, "n": 4, "ignore_eos": True}
        leave_long_completion(url, False, body=body, headers=AUTH, started=lambda: any(  # gone while it generates
            s["num_running"] for s in engine_states("lmkit", "model-tiny", calls=4).values()))
    assert_engines_idle("lmkit", "model-tiny")


def test_a_killed_replica_is_replaced_and_its_streams_end_cleanly(two_replicas):
    url = two_replicas
    def both_up():  # a replica's process takes its title a moment after it starts
        pids = replica_pids("lmkit", "model-tiny")
        return pids if len(pids) == 2 else None

    before = wait_for(both_up, 60, "both replicas' processes")
    outcomes: dict[int, str] = {}
    started = threading.Barrier(7, timeout=60)

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"long {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=90) as r:
            lines = r.iter_lines()
            rest = [next(lines)]
            started.wait()
            try:
                rest += [line for line in lines if line]
            except httpx.RemoteProtocolError:  # Ray's proxy closes the stream of a replica that died
                outcomes[i] = "cut"
                return
        assert rest[-1] == "data: [DONE]", rest[-3:]  # never a stream that looks complete but is not
        outcomes[i] = "done"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait()
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert sorted(outcomes) == list(range(6)), f"streams that hung or broke: {set(range(6)) - set(outcomes)}"
    assert "done" in outcomes.values() and "cut" in outcomes.values(), outcomes  # each replica had some
    for i in range(6):  # new requests go to live replicas (one that dies first is retried on another)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 4},
                       headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    def replaced():
        pids = replica_pids("lmkit", "model-tiny")
        return len(pids) == 2 and victim not in pids

    wait_for(replaced, 90, "a new replica in place of the killed one")
    wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, 60, "/health 200 again")
    assert_engines_idle("lmkit", "model-tiny")


def test_several_models_behind_the_router(ray_cluster, tiny_llama, slow_llama):
    """Two models in one application under a route prefix, with keys: routed by `model`; /v1/models and
    /health cover both; /health is open under the prefix too; the replicas stream 3 tokens a chunk (the
    server config's stream_interval reaches them)."""
    import openai
    from ray import serve

    from lmkit import EngineConfig
    from lmkit.serve import GateConfig, ServerConfig
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy

    app = build_app({"small": str(tiny_llama[0]), "wide": str(slow_llama)}, EngineConfig(**ENGINE),
                    ServerConfig(gate=GateConfig(api_keys=(KEY,)), stream_interval=3),
                    ReplicaConfig(num_cpus_per_replica=0.5))
    deploy(app, "pair", "/pair")
    url = f"{ray_cluster['url']}/pair"
    try:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["small", "wide"]
        for name in ("small", "wide"):
            r = client.completions.create(model=name, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
            assert r.model == name and r.usage.completion_tokens == 3
            parts = list(client.completions.create(model=name, prompt="hi", max_tokens=8, stream=True, logprobs=0,
                                                   extra_body={"ignore_eos": True}))
            assert parts[-1].choices[0].finish_reason == "length"
            assert [len(p.choices[0].logprobs.tokens) for p in parts if p.choices[0].logprobs] == [1, 3, 3, 1]
        with pytest.raises(openai.NotFoundError, match="small.*wide"):
            client.completions.create(model="other", prompt="hi", max_tokens=3)
        missing = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=AUTH, timeout=30)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
        assert httpx.post(f"{url}/v1/completions", json={"model": "small", "prompt": "x"},
                          timeout=30).status_code == 401
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
        assert metrics.status_code == 404 and "metrics-export-port" in metrics.json()["error"]["message"]
    finally:
        serve.delete("pair")


def test_prefix_routing_keeps_each_tenant_on_one_replica(ray_cluster, slow_llama):
    """request_router='prefix': one model's two replicas behind the Router, which reads each request's leading
    text. Four tenants, each its own 400-character system text, three turns each in turn: every tenant's turns
    answered by one replica (its x-lmkit-replica header), the tenants on both replicas, the repeated turns
    served from the replicas' prefix caches."""
    from ray import serve

    from lmkit import EngineConfig
    from lmkit.serve import ServerConfig
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy

    app = build_app({"tiny": str(slow_llama)}, EngineConfig(**ENGINE, enable_prefix_caching=True), ServerConfig(),
                    ReplicaConfig(min_replicas=2, max_replicas=2, num_cpus_per_replica=0.5, request_router="prefix"))
    deploy(app, "prefix", "/prefix")
    url = f"{ray_cluster['url']}/prefix"
    systems = [(f"tenant {t}: " + "abcdefghij"[t] * 390)[:400] for t in range(4)]
    seen: dict[int, set[str]] = {t: set() for t in range(4)}
    try:
        for turn in range(3):
            for t in range(4):
                r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"{systems[t]} q{turn}?",
                                                              "max_tokens": 2}, timeout=60)
                assert r.status_code == 200, r.text
                seen[t].add(r.headers["x-lmkit-replica"])
        bad = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=60,
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400, bad.text  # the replica's own answer: the router routes it without keys
        assert all(len(replicas) == 1 for replicas in seen.values()), seen
        assert len(set().union(*seen.values())) == 2, seen
        states = engine_states("prefix", "model-tiny")
        assert len(states) == 2, states
        hits = sum(s["num_prefix_hit_tokens"] for s in states.values())
        assert hits >= 8 * 384, f"{hits} prefix-hit tokens over 8 repeated turns of 400+ tokens"
    finally:
        serve.delete("prefix")


def test_autoscaling_from_1_to_2_replicas_and_back(ray_cluster, slow_llama):
    from ray import serve

    from lmkit import EngineConfig
    from lmkit.serve import ServerConfig
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy

    replicas = ReplicaConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=1, num_cpus_per_replica=0.5,
                             upscale_delay_s=0, downscale_delay_s=2, look_back_period_s=11)
    deploy(build_app({"scaled": str(slow_llama)}, EngineConfig(**ENGINE), ServerConfig(), replicas), "scaled",
           "/scaled")
    url = f"{ray_cluster['url']}/scaled"
    try:
        assert len(replica_pids("scaled", "model-scaled")) == 1
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                body = {"model": "scaled", "prompt": "burst", "max_tokens": 200, "ignore_eos": True}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text

        burst = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in burst:
            t.start()
        try:
            wait_for(lambda: len(replica_pids("scaled", "model-scaled")) == 2, 90, "a second replica under the burst")
        finally:
            stop.set()
            for t in burst:
                t.join(timeout=120)
        wait_for(lambda: len(replica_pids("scaled", "model-scaled")) == 1, 90, "back to one replica after the burst")
        r = httpx.post(f"{url}/v1/completions", json={"model": "scaled", "prompt": "x", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        serve.delete("scaled")


def test_a_model_that_cannot_load_fails_the_deployment_naming_it(ray_cluster, tmp_path):
    from ray import serve

    from lmkit import EngineConfig
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy

    missing = tmp_path / "no-such-model"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="model-broken: .*no-such-model"):
        deploy(build_app({"broken": str(missing)}, EngineConfig(**ENGINE),
                         replicas=ReplicaConfig(num_cpus_per_replica=0.5)), "broken", "/broken")
    assert time.monotonic() - started < 120
    assert "broken" not in serve.status().applications


def test_a_replica_that_cannot_start_beside_running_ones_fails_the_deployment(ray_cluster, slow_llama):
    """Once one replica of a deployment runs, Ray Serve retries another's failing constructor for ever and the
    application never leaves DEPLOYING; deploy gives up after CONSTRUCTOR_RETRIES failures, naming the error.
    Here the second engine's KV pool does not fit in what the first left (lmkit/memory.py): a memory fraction
    that holds this model's weights, the other engines' records and 16 MiB of KV once, not twice."""
    from ray import serve

    from lmkit import EngineConfig, env
    from lmkit.engine import Engine
    from lmkit.memory import Reservations, memory_limit
    from lmkit.serve.ray import ReplicaConfig, build_app, deploy
    from lmkit.serve.ray.config import CONSTRUCTOR_RETRIES

    probe = Engine(slow_llama, EngineConfig(**ENGINE))  # the weights' bytes as an engine loads them
    weight_bytes = probe.kv_pool.weight_bytes
    probe.close()
    with Reservations(env.runtime_dir()).lock():
        others = sum(r.total_bytes for r in Reservations(env.runtime_dir()).live())
    fraction = (weight_bytes + others + 16 * 2**20) / memory_limit().total_bytes
    engine = EngineConfig(**{**ENGINE, "cache_max_entry_count": fraction, "max_batch_size": 64})
    started = time.monotonic()
    # (Ray itself fails the deployment, without the count, when the loser fails 3 times before the winner runs)
    with pytest.raises(RuntimeError, match=rf"model-full( \(1 replica\(s\) run; another failed to start "
                                           rf"{CONSTRUCTOR_RETRIES} times\))?: .*KV pool does not fit"):
        deploy(build_app({"full": str(slow_llama)}, engine,
                         replicas=ReplicaConfig(min_replicas=2, max_replicas=2, num_cpus_per_replica=0.5)),
               "full", "/full")
    assert time.monotonic() - started < 120
    assert "full" not in serve.status().applications


def test_lmkit_serve_ray_drains_on_sigterm(ray_cluster, slow_llama):
    """`lmkit serve ray` joins the cluster, serves; on SIGTERM its streams in progress complete, the
    application is deleted, and it exits 0."""
    url = f"{ray_cluster['url']}/cli"
    port = ray_cluster["url"].rsplit(":", 1)[1]
    proc = lmkit_subprocess("serve", "ray", f"cli={slow_llama}", "--address", ray_cluster["address"], "--port", port,
                            "--app-name", "cli", "--route-prefix", "/cli", "--num-cpus-per-replica", "0.5",
                            "--device", "cpu", "--dtype", "float32", "--max-batch-size", "8", "--session-len", "512",
                            "--cache-block-seq-len", "16", "--cache-max-entry-count", "256", "--log-level", "warning")
    try:
        def ready():
            assert proc.poll() is None, proc.communicate(timeout=10)[1][-3000:]
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, 180, "lmkit serve ray answering /health")
        threads, results = streams_in_progress(url, "cli", 3, max_tokens=200, timeout_s=90)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == [0, 1, 2] and all(lines[-1] == "data: [DONE]" for lines in results.values())
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        from ray import serve

        assert "cli" not in serve.status().applications  # deleted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_lmkit_serve_ray_stops_on_sigterm_while_its_replicas_wait_to_start(ray_cluster, slow_llama):
    """SIGTERM while the application waits for its replicas (here for CPUs the cluster does not have, which Ray
    waits for without end): the application is deleted and the command exits 0. (Ray gives a replica that never
    started the whole graceful-shutdown time before it kills it, so the delete takes --drain-timeout.)"""
    from ray import serve

    port = ray_cluster["url"].rsplit(":", 1)[1]
    proc = lmkit_subprocess("serve", "ray", f"pending={slow_llama}", "--address", ray_cluster["address"], "--port",
                            port, "--app-name", "pending", "--route-prefix", "/pending", "--num-cpus-per-replica", "8",
                            "--device", "cpu", "--dtype", "float32", "--session-len", "512", "--drain-timeout", "2",
                            "--log-level", "info")
    try:
        def waiting():
            assert proc.poll() is None, proc.communicate(timeout=10)[1][-3000:]
            status = serve.status().applications.get("pending")
            return status is not None and status.status == "DEPLOYING"
        wait_for(waiting, 120, "application 'pending' deploying")
        time.sleep(2)  # still waiting: Ray neither starts nor fails a replica it has no CPUs for
        assert serve.status().applications["pending"].status == "DEPLOYING"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert "stopped before application 'pending' served" in err and "Traceback" not in err, err[-3000:]
        wait_for(lambda: "pending" not in serve.status().applications, 30, "application 'pending' deleted")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
