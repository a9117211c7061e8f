"""The CPUs this process may use, so that the engine's default thread count fits where it runs: the affinity
mask (taskset, a cpuset, Kubernetes' static CPU manager) and the cgroup CPU quota (a pod's ``cpu: 2`` on a
64-core node, ``docker run --cpus 1.5``). A team of more threads than the quota allows is throttled as a whole,
and a spinning barrier then waits for threads that the scheduler has parked.

    threads = min(CPUs in the affinity mask, ceil(lowest quota / period of the cgroup and its ancestors)), >= 1

A fractional quota rounds up: the quota is shared by the whole cgroup, so two threads under 1.5 CPUs still get
1.5 CPUs of work done per period (both run, then both wait), where one thread would get 1.0.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from lmkit.cgroups import CGROUP_ROOT, PROC, limit_files


@dataclass(frozen=True)
class CpuBudget:
    """How many threads this process should run, and why."""

    num_threads: int
    num_affinity_cpus: int
    quota_cpus: float | None  # the lowest cgroup CPU quota, in CPUs (None: no quota)
    quota_source: str | None  # the file it came from

    def describe(self) -> str:
        why = f"{self.num_affinity_cpus} CPUs in the affinity mask"
        if self.quota_cpus is not None:
            why += f", cgroup CPU quota {self.quota_cpus:g} ({self.quota_source})"
        return f"{self.num_threads} thread{'s' * (self.num_threads > 1)} ({why})"


def affinity_cpu_count() -> int:
    """The CPUs in this process's affinity mask (the machine's outside Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_quota(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> tuple[float, str] | None:
    """(CPUs, file) of the lowest CPU quota of this process's cgroup and its ancestors: v2 ``cpu.max``
    ("QUOTA PERIOD", "max PERIOD" for none), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 for none).
    None without a quota (or a cgroup file system)."""
    best: tuple[float, str] | None = None
    for path in limit_files(proc / "self" / "cgroup", cgroup_root, "cpu.max", "cpu", "cpu.cfs_quota_us"):
        cpus = _read_quota(path)
        if cpus is not None and (best is None or cpus < best[0]):
            best = (cpus, str(path))
    return best


def _read_quota(path: Path) -> float | None:
    try:
        text = path.read_text().split()
        if path.name == "cpu.max":
            quota, period = text[0], text[1] if len(text) > 1 else "100000"
        else:
            quota, period = text[0], (path.parent / "cpu.cfs_period_us").read_text().split()[0]
    except (OSError, IndexError):
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota at this level
        return None
    return q / p if q > 0 and p > 0 else None


def cpu_budget(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> CpuBudget:
    """The threads this process should run by default (module doc), with the facts behind the number."""
    affinity = affinity_cpu_count()
    quota = cpu_quota(proc, cgroup_root)
    threads = affinity if quota is None else min(affinity, math.ceil(quota[0] - 1e-9))
    return CpuBudget(max(1, threads), affinity, None if quota is None else quota[0],
                     None if quota is None else quota[1])


def usable_cpu_count() -> int:
    """The threads this process should run by default: its affinity mask, capped by its cgroup's CPU quota."""
    return cpu_budget().num_threads
