"""The default thread count fits where the engine runs: the affinity mask (os.sched_setaffinity, checked in a
child process so this one keeps its CPUs) and the cgroup CPU quota (faked cgroup files, v2 and v1)."""

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
    """dtype='auto' computes in bfloat16 on CPUs with AVX512_BF16 and in float32 elsewhere; the start-up log
    names the choice and why; explicit dtypes are kept; CUDA keeps auto (its backend picks)."""
    import logging

    from lmkit import EngineConfig
    from lmkit._ext import _engine
    from lmkit.engine import Engine

    expect = "bfloat16" if _engine.cpu_bf16_available() else "float32"
    assert EngineConfig().resolved_dtype("cpu") == expect
    assert EngineConfig(dtype="float32").resolved_dtype("cpu") == "float32"
    assert EngineConfig(device="cuda").resolved_dtype("cuda") == "auto"
    with caplog.at_level(logging.INFO, logger="lmkit"):
        engine = Engine(tiny_llama[0], EngineConfig(device="cpu", cache_max_entry_count=32, num_threads=1))
        engine.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU backend:"))
    assert f"{expect} compute (dtype='auto': this CPU has {'' if expect == 'bfloat16' else 'no '}AVX512_BF16)" in line
