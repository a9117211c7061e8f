"""The api_server keeps its Python threads off the engine's CPUs (EngineConfig.cpu_binding='auto'): a real server
process on a mask with a CPU to spare, its threads read back from /proc while it answers a request."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from lmkit import cpus
from tests.serve.harness import free_port, lmkit_subprocess, wait_healthy


def _threads(pid: int) -> dict[str, set[str]]:
    """Thread name -> the Cpus_allowed_list values of the threads of that name."""
    out: dict[str, set[str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        out.setdefault(name, set()).add(next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list")))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs in the affinity mask")
def test_api_server_threads_leave_the_engine_cpus(tiny_llama):
    mask = sorted(os.sched_getaffinity(0))
    engine_cpu, others = str(mask[-1]), cpus.format_cpu_list(mask[:-1])
    port = free_port()
    proc = lmkit_subprocess("serve", "api_server", str(tiny_llama[0]), "--port", str(port), "--num-threads", "1",
                            "--dtype", "float32", "--cache-max-entry-count", "64")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=proc)
        r = httpx.post(f"{url}/v1/completions", json={"model": tiny_llama[0].name, "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        threads = _threads(proc.pid)
        assert threads.pop("lmkit-engine") == {engine_cpu}
        assert len(threads) >= 3, threads  # the event loop, the callback thread, the server's pool ...
        for name, allowed in threads.items():
            assert allowed == {others}, (name, allowed)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
