"""The default thread count fits where the engine runs: the affinity mask (os.sched_setaffinity, checked in a
child process so this one keeps its CPUs) and the cgroup CPU quota (faked cgroup files, v2 and v1); the engine's
threads and the others are kept apart (cpu_binding: plans on faked sysfs topologies, and a real engine's threads
read back from /proc in a child process)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from lmkit import cpus


def fake_cgroup(tmp_path, self_cgroup: str):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(self_cgroup)
    return proc, root


def test_v2_quota_lowest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc, root = fake_cgroup(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cpus.cpu_quota(proc, root) is None  # no cgroup files: no quota
    (root / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (root / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("max 100000\n")
    assert cpus.cpu_quota(proc, root) is None  # "max": none at that level
    (root / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5 / cpu: 1500m
    assert cpus.cpu_quota(proc, root) == (1.5, str(root / "kubepods" / "pod1" / "cpu.max"))
    (root / "kubepods" / "cpu.max").write_text("400000 100000\n")  # a looser ancestor does not win
    assert cpus.cpu_quota(proc, root)[0] == 1.5
    (root / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("50000 100000\n")
    assert cpus.cpu_quota(proc, root)[0] == 0.5


def test_v1_quota_with_its_period(tmp_path):
    proc, root = fake_cgroup(tmp_path, "7:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n")
    base = root / "cpu,cpuacct"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text("-1\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.cpu_quota(proc, root) is None  # -1: no quota
    (base / "cpu.cfs_quota_us").write_text("200000\n")
    (base / "cpu.cfs_period_us").write_text("50000\n")
    assert cpus.cpu_quota(proc, root) == (4.0, str(base / "cpu.cfs_quota_us"))


@pytest.mark.parametrize("quota, expect", [(None, None), (0.5, 1), (1.0, 1), (1.5, 2), (2.0, 2), (1000.0, None)])
def test_threads_are_the_affinity_capped_by_the_quota(tmp_path, quota, expect):
    proc, root = fake_cgroup(tmp_path, "0::/\n")
    root.mkdir()
    if quota is not None:
        (root / "cpu.max").write_text(f"{int(quota * 100000)} 100000\n")
    budget = cpus.cpu_budget(proc, root)
    affinity = len(os.sched_getaffinity(0))
    assert budget.num_affinity_cpus == affinity
    assert budget.num_threads == (affinity if expect is None else min(affinity, expect))
    assert budget.quota_cpus == quota
    assert budget.describe().startswith(f"{budget.num_threads} thread")


def test_affinity_mask_sets_the_engine_default():
    """A child pinned to one CPU resolves EngineConfig's default num_threads to 1 (or to the quota, if lower)."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from lmkit import EngineConfig; print(EngineConfig().resolved_num_threads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    quota = cpus.cpu_quota()
    whole = subprocess.run([sys.executable, "-c", "from lmkit import EngineConfig; "
                            "print(EngineConfig().resolved_num_threads)"], capture_output=True, text=True,
                           check=True).stdout
    affinity = len(os.sched_getaffinity(0))
    assert int(whole) == (affinity if quota is None else max(1, min(affinity, math.ceil(quota[0] - 1e-9))))


def test_dtype_auto_is_bf16_exactly_where_the_cpu_has_it_and_says_so(tiny_llama, caplog):
    """dtype='auto' computes in bfloat16 on CPUs with AVX512_BF16 and in float32 elsewhere, with a bf16 KV cache
    either way (dtype float32 keeps fp32 K/V); the start-up log names the choice and why; explicit dtypes are
    kept; CUDA keeps auto (its backend picks)."""
    import logging

    from lmkit import EngineConfig
    from lmkit._ext import _engine
    from lmkit.engine import Engine

    expect = "bfloat16" if _engine.cpu_bf16_available() else "float32"
    assert EngineConfig().resolved_dtype("cpu") == expect
    assert EngineConfig(dtype="float32").resolved_dtype("cpu") == "float32"
    assert EngineConfig(device="cuda").resolved_dtype("cuda") == "auto"
    assert EngineConfig().resolved_kv_bf16("cpu") and not EngineConfig().resolved_kv_bf16("cuda")
    assert not EngineConfig(dtype="float32").resolved_kv_bf16("cpu")
    with caplog.at_level(logging.INFO, logger="lmkit"):
        engine = Engine(tiny_llama[0], EngineConfig(device="cpu", cache_max_entry_count=32, num_threads=1))
        engine.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU backend:"))
    kv = "" if expect == "bfloat16" else " and bfloat16 KV"
    why = ("LMKIT_CPU_ISA=" + os.environ["LMKIT_CPU_ISA"] + " caps the kernels" if expect == "float32" and
           os.environ.get("LMKIT_CPU_ISA") in ("avx2", "generic") else
           f"this CPU has {'' if expect == 'bfloat16' else 'no '}AVX512_BF16")
    assert f"{expect} compute{kv} (dtype='auto': {why})" in line, line


# ---------------------------------------------------------------------------------------------- cpu_binding
def test_cpu_lists_parse_and_print_as_the_kernel_writes_them():
    assert cpus.parse_cpu_list("0-3, 8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert cpus.format_cpu_list([5]) == "5"
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError):
            cpus.parse_cpu_list(bad)


def _fake_topology(root, cores: dict[int, int]):
    """sysfs cpuN/topology with core_id cores[N] in package 0."""
    for cpu, core in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    return root


def test_binding_plan_keeps_engine_and_other_threads_apart(tmp_path):
    """auto: with more CPUs in the mask than threads, the engine takes one CPU per core from the end of the mask
    and the others get the CPUs that share no core with it; no pinning when the threads need every CPU; an
    explicit list must lie within the mask."""
    smt = _fake_topology(tmp_path, {c: c % 4 for c in range(8)})  # 4 cores x 2 threads: siblings c, c + 4
    plan = cpus.plan_binding(2, "auto", affinity=range(8), sysfs=smt)
    assert plan.engine_cpus == (6, 7) and plan.other_cpus == (0, 1, 4, 5)  # not 2, 3: siblings of 6, 7
    plan = cpus.plan_binding(5, "auto", affinity=range(8), sysfs=smt)
    assert plan.engine_cpus == (3, 4, 5, 6, 7) and plan.other_cpus == (0, 1, 2)  # every core, then a second thread
    assert "5 of the 8 CPUs" in plan.describe() and "engine threads on CPUs 3-7" in plan.describe()
    plan = cpus.plan_binding(2, "auto", affinity={2, 5}, sysfs=smt)  # a cpuset of exactly the threads' CPUs
    assert not plan.pinned and "not pinned" in plan.describe()
    assert not cpus.plan_binding(1, "off", affinity=range(8), sysfs=smt).pinned
    plan = cpus.plan_binding(2, "1,5", affinity=range(8), sysfs=smt)
    assert plan.engine_cpus == (1, 5) and plan.other_cpus == (0, 2, 3, 4, 6, 7)  # all share a core with none
    with pytest.raises(ValueError, match="outside this process's affinity mask 0-3"):
        cpus.plan_binding(1, "2-5", affinity=range(4), sysfs=smt)
    # no topology in sysfs: every CPU its own core
    assert cpus.plan_binding(1, "auto", affinity=[0, 1, 2], sysfs=tmp_path / "none").engine_cpus == (2,)


def test_engine_config_checks_cpu_binding():
    from lmkit import EngineConfig

    with pytest.raises(ValueError, match="cpu_binding must be auto, off or a CPU list"):
        EngineConfig(cpu_binding="fast")
    first = min(os.sched_getaffinity(0))
    assert EngineConfig(cpu_binding=str(first)).resolved_num_threads == 1  # the list's CPUs cap the default
    assert EngineConfig(cpu_binding=str(first), num_threads=3).resolved_num_threads == 3


_SHOW_THREADS = """
import json, sys, time
from pathlib import Path
from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit.cpus import move_other_threads

def threads():
    out = []
    for t in sorted(Path("/proc/self/task").iterdir()):
        try:
            status = (t / "status").read_text().splitlines()
            comm = (t / "comm").read_text().strip()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        allowed = next(l.split()[1] for l in status if l.startswith("Cpus_allowed_list"))
        out.append([comm, allowed])
    return out

num_threads, binding = int(sys.argv[2]), sys.argv[3]
with pipeline(sys.argv[1], EngineConfig(dtype="float32", num_threads=num_threads, cpu_binding=binding,
                                        cache_max_entry_count=64)) as pipe:
    pipe("hello", GenerationConfig(max_new_tokens=4))  # steps: the kernel team exists
    # a worker names itself when it first runs; on a busy machine the steps may have run before it did
    deadline = time.monotonic() + 30
    while num_threads > 1 and "lmkit-worker" not in [n for n, _ in threads()] and time.monotonic() < deadline:
        time.sleep(0.02)
    before = threads()
    moved = move_other_threads(pipe.engine.cpu_binding)
    print(json.dumps({"plan": [list(pipe.engine.cpu_binding.engine_cpus), list(pipe.engine.cpu_binding.other_cpus)],
                      "before": before, "after": threads(), "moved": moved}))
"""


def _run_engine_threads(model: str, num_threads: int, binding: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", _SHOW_THREADS, model, str(num_threads), binding],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs in the affinity mask")
def test_engine_threads_run_on_their_cpus_and_the_rest_move_off(tiny_llama):
    """A real engine in a child process: with 1 thread on a mask of 2+ CPUs (auto), the engine thread is on its
    planned CPU, the callback thread and, after move_other_threads (what the api_server does), every other
    thread of the process on the rest; with an explicit list covering two CPUs, the kernel team's worker runs
    there too, and nothing else moves (no CPU is left for it)."""
    mask = sorted(os.sched_getaffinity(0))
    r = _run_engine_threads(str(tiny_llama[0]), 1, "auto")
    engine_cpus, other_cpus = r["plan"]
    assert engine_cpus == [mask[-1]] and other_cpus == mask[:-1]
    engine_list, other_list = cpus.format_cpu_list(engine_cpus), cpus.format_cpu_list(other_cpus)
    before = dict((name, allowed) for name, allowed in r["before"] if name.startswith("lmkit-"))
    assert before["lmkit-engine"] == engine_list and before["lmkit-callback"] == other_list
    assert r["moved"] >= 2  # the main thread and the callback thread at least
    for name, allowed in r["after"]:
        assert allowed == (engine_list if name == "lmkit-engine" else other_list), (name, allowed)

    two = cpus.format_cpu_list(mask[-2:])
    r = _run_engine_threads(str(tiny_llama[0]), 2, two)
    assert r["moved"] == 0 if len(mask) == 2 else r["moved"] >= 2
    names = [name for name, _ in r["after"]]
    assert "lmkit-worker" in names
    for name, allowed in r["after"]:
        if name in ("lmkit-engine", "lmkit-worker"):
            assert allowed == two, (name, allowed)


# ---------------------------------------------------------------------------------------------- LMKIT_CPU_ISA
_CAPPED_RUN = """
import json, sys
from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit._ext import _engine
folder, dtype = sys.argv[1], sys.argv[2]
cfg = EngineConfig(device="cpu", num_threads=1, cache_max_entry_count=32, cache_block_seq_len=16, dtype=dtype)
prompt = [5, 9, 14, 3, 77, 21, 8, 40, 2, 61, 33, 7, 19, 4, 88, 12, 6, 50]
with pipeline(folder, cfg) as pipe:
    r = pipe([prompt], GenerationConfig(max_new_tokens=4, output_logits=True, ignore_eos=True))[0]
print(json.dumps({"isa": _engine.cpu_isa(), "bf16": _engine.cpu_bf16_available(),
                  "amx": _engine.cpu_amx_available(), "amx_int8": _engine.cpu_amx_int8_available(),
                  "dtype": cfg.resolved_dtype("cpu"), "kv_bytes_per_block": pipe.engine.kv_bytes_per_block,
                  "tokens": prompt + r.token_ids, "logits": r.logits.tolist()}))
"""


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_lmkit_cpu_isa_caps_the_kernels(isa, tiny_llama):
    """LMKIT_CPU_ISA=avx2|generic makes the engine run what a CPU with only that ISA runs: that kernel table, no
    AVX512_BF16 (dtype auto -> float32 compute), no AMX, and logits those of HF fp32: to 1e-4 with dtype float32;
    with dtype auto the KV cache is bf16 (half the bytes a block) and the logits within a bf16 cache's distance."""
    import json

    import numpy as np
    import torch

    from lmkit._ext import _engine
    from tests.helpers import rel_err

    if isa == "avx2" and _engine.cpu_isa() == "generic":
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, LMKIT_CPU_ISA=isa)
    runs = {}
    for dtype in ("float32", "auto"):
        out = subprocess.run([sys.executable, "-c", _CAPPED_RUN, str(tiny_llama[0]), dtype], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got = runs[dtype] = json.loads(out.stdout.strip().splitlines()[-1])
        assert (got["isa"], got["bf16"], got["amx"], got["amx_int8"], got["dtype"]) == (isa, False, False, False,
                                                                                          "float32")
        with torch.no_grad():
            expect = tiny_llama[1](torch.tensor([got["tokens"]])).logits[0].numpy()
        err = rel_err(np.array(got["logits"]), expect[:len(got["tokens"]) - 1])
        assert err <= (1e-4 if dtype == "float32" else 1e-2), (dtype, err)
    assert runs["auto"]["kv_bytes_per_block"] * 2 == runs["float32"]["kv_bytes_per_block"]


def test_lmkit_cpu_isa_refuses_an_unknown_value():
    out = subprocess.run([sys.executable, "-c", "import lmkit._ext"], env=dict(os.environ, LMKIT_CPU_ISA="avx3"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "LMKIT_CPU_ISA='avx3': use one of avx512, avx2, generic" in out.stderr
