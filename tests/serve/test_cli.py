"""`lmkit chat` (one-shot --prompt, interactive with /reset and /exit, Ctrl-C stopping only the answer), `lmkit
serve MODEL` with vLLM's flag names, and the serving benchmarks' --smoke modes against real servers."""

from __future__ import annotations

import csv
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.factories import make_tiny_model, write_sharegpt_file
from tests.serve.harness import free_port, lmkit_subprocess, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}


def chat(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmkit", "chat", *args, "--session-len", "512", "--num-threads",
                             "1"], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_chat_prompt_mode(tiny_llama, tiny_llama_pipe):
    from lmkit import GenerationConfig

    p = chat(str(tiny_llama[0]), "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    gen = GenerationConfig(max_new_tokens=8)
    assert out == tiny_llama_pipe([{"role": "user", "content": "hello"}], gen).text + "\n"


def test_chat_interactive_reset_and_exit(tiny_llama):
    p = chat(str(tiny_llama[0]), "--max-new-tokens", "6")
    out, err = p.communicate("hi\n/reset\n/bogus\nagain\n/exit\n", timeout=120)
    assert p.returncode == 0, err
    assert "lmkit chat" in out and "history cleared" in out and "unknown command /bogus" in out
    assert out.count("assistant>") == 2


def read_until(p: subprocess.Popen, text: str, timeout_s: float) -> str:
    seen = ""
    deadline = time.monotonic() + timeout_s
    while text not in seen:
        if time.monotonic() >= deadline or p.poll() is not None:
            p.kill()  # before reading its stderr, which would otherwise block until the chat exits
            raise AssertionError(f"never saw {text!r}: {seen!r} {p.communicate()[1]}")
        ready, _, _ = select.select([p.stdout], [], [], 0.1)
        if ready:
            seen += os.read(p.stdout.fileno(), 65536).decode(errors="replace")
    return seen


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_chat(tmp_path):
    # ~60 M parameters: ~10 ms per token, so a 500-token answer takes seconds even with fast kernels
    # (a 10 M-parameter model finished its answer before the signal once the kernels got faster)
    folder = tmp_path / "slow"
    make_tiny_model(folder, "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)
    # started as a shell starts a background job (SIGINT ignored, which Python keeps): Ctrl-C must still stop
    # the answer (a full-suite run from a background job once saw the answer run to its end)
    p = chat(str(folder), "--max-new-tokens", "500", "--temperature", "0",
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        read_until(p, "you>", 120)
        p.stdin.write("tell me everything\n")
        p.stdin.flush()
        read_until(p, "assistant>", 30)
        time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        read_until(p, "(stopped)", 30)
        p.stdin.write("/exit\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_profile_serving_smoke(api_server, tiny_llama, tmp_path):
    out = tmp_path / "serving.csv"
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "profile_serving.py"), "--smoke", "--base-url",
                          api_server.url, "--tokenizer", str(tiny_llama[0]), "--csv", str(out), "--label", "t"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "out tok/s" in run.stdout and "TTFT p50" in run.stdout
    rows = out.read_text().splitlines()
    assert len(rows) == 3 and rows[1].split(",")[9] == "0"  # no failed request
    fields = [dict(zip(rows[0].split(","), r.split(","))) for r in rows[1:]]
    for f in fields:  # read from the server's /metrics ("-" if not): fractions (sampled, so 0 for ms-long requests)
        assert 0 <= float(f["peak_kv_usage"]) <= 1 and 0 <= float(f["prefix_hit_rate"]) <= 1, f
        assert float(f["ttft_p50_ms"]) <= float(f["ttft_p90_ms"]) <= float(f["ttft_p99_ms"]), f
    # --dataset: prompts of a ShareGPT-schema file, sent as written (sampled requests this time)
    write_sharegpt_file(tmp_path / "sg.json")
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "profile_serving.py"), "--smoke", "--base-url",
                          api_server.url, "--tokenizer", str(tiny_llama[0]), "--dataset", str(tmp_path / "sg.json"),
                          "--csv", str(out), "--label", "sg", "--temperature", "1", "--top-p", "0.9"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "workload ShareGPT file sg.json" in run.stdout
    rows = out.read_text().splitlines()
    assert len(rows) == 5 and all(r.split(",")[5] == "ShareGPT file sg.json" and r.split(",")[9] == "0"
                                  for r in rows[3:])


@pytest.mark.slow
def test_scale_out_benchmark_smoke(tiny_llama, tmp_path):
    """bench_scale_out.py --smoke: two pinned api_servers and two proxies as subprocesses, one round, a
    ratio and a CSV row per run with the CPU each process spent."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two nodes need two CPUs")
    out = tmp_path / "scale.csv"
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "bench_scale_out.py"), "--smoke", "--model",
                          str(tiny_llama[0]), "--server-args", "--session-len 512 --cache-max-entry-count 64",
                          "--csv", str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "median" in run.stdout and "2 nodes" in run.stdout, run.stdout
    rows = list(csv.DictReader(out.open()))
    assert [r["setup"].split(" (")[0] for r in rows] == ["1 node", "2 nodes"]
    for r in rows:  # (the CPU of 4 tiny requests may round to 0 at the kernel's 10 ms ticks)
        assert float(r["request_throughput"]) > 0 and int(r["num_requests"]) == 4, r
        assert all(float(r[f"{p}_cpu_s"]) >= 0 for p in ("node0", "node1", "proxy_one", "proxy_all")), r


def test_serve_ray_without_ray_says_what_to_install(tmp_path):
    """Where Ray is not installed (the core install), `lmkit serve ray` names the extra, without a traceback."""
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['lmkit', 'serve', 'ray']; "
            "from lmkit.cli.main import main; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'pip install -e ".[ray]"' in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_vllm_flag_names_reach_lmkits_settings(monkeypatch):
    """vLLM's names for what lmkit has set the same fields as lmkit's own: --max-model-len, --served-model-name,
    --api-key, --max-num-seqs, --max-num-batched-tokens, --gpu-memory-utilization; --enable-auto-tool-choice is
    accepted (auto is always on)."""
    from typer.testing import CliRunner

    import lmkit.serve.api_server as api_server
    from lmkit.cli.main import app, serve_model_first

    seen = {}
    monkeypatch.setattr(api_server, "run_api_server", lambda model, engine, server, **kw: seen.update(
        model=model, engine=engine, server=server))
    args = ["serve", "some/model", "--max-model-len", "320", "--served-model-name", "alias", "--api-key", "k1",
            "--max-num-seqs", "3", "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.5",
            "--enable-auto-tool-choice"]
    result = CliRunner().invoke(app, serve_model_first(args))
    assert result.exit_code == 0, result.output
    engine, server = seen["engine"], seen["server"]
    assert seen["model"] == "some/model" and server.model_name == "alias" and server.gate.api_keys == ("k1",)
    assert (engine.session_len, engine.max_batch_size, engine.max_prefill_token_num,
            engine.cache_max_entry_count) == (320, 3, 256, 0.5)


def test_serve_model_starts_the_api_server(tiny_llama):
    """`lmkit serve MODEL` starts the api_server (as `vllm serve MODEL`), here with vLLM's flag names."""
    port = free_port()
    proc = lmkit_subprocess("serve", str(tiny_llama[0]), "--port", str(port), "--num-threads", "1", "--dtype",
                            "float32", "--max-model-len", "320", "--served-model-name", "alias", "--api-key", "k1",
                            "--cache-max-entry-count", "64")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=proc)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("alias", 320)]
        r = httpx.post(f"{url}/v1/completions", json={"model": "alias", "prompt": "x" * 400, "max_tokens": 2},
                       headers={"Authorization": "Bearer k1"}, timeout=30)
        assert r.status_code == 400 and "320" in r.text, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
