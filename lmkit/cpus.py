"""The CPUs this process may use, so that the engine's default thread count fits where it runs: the affinity
mask (taskset, a cpuset, Kubernetes' static CPU manager) and the cgroup CPU quota (a pod's ``cpu: 2`` on a
64-core node, ``docker run --cpus 1.5``). A team of more threads than the quota allows is throttled as a whole,
and a spinning barrier then waits for threads that the scheduler has parked.

    threads = min(CPUs in the affinity mask, ceil(lowest quota / period of the cgroup and its ancestors)), >= 1

A fractional quota rounds up: the quota is shared by the whole cgroup, so two threads under 1.5 CPUs still get
1.5 CPUs of work done per period (both run, then both wait), where one thread would get 1.0.

Where the mask holds more CPUs than the engine runs threads (a pod's ``cpu: 2`` on a 64-core node, or
``num_threads`` below the machine's CPUs), the engine's threads and the process's other threads are kept apart
(``EngineConfig.cpu_binding``, plan_binding): the engine thread and its kernel team on ``num_threads`` CPUs, one
per physical core, taken from the end of the mask (CPU 0 serves most interrupts); the engine's callback thread
and, in the api_server, every other thread of the process (the event loop, tokenizer threads, the thread pool:
move_other_threads) on the rest, CPUs that share no core with the engine's where there are such. A Python thread
that tokenizes or encodes JSON then never takes a core from a decode step, whose team waits for its slowest
thread. The CPU sets are masks the scheduler balances within, not one CPU per thread, so a busy neighbour on one
CPU of the engine's set still leaves the others.
"""

from __future__ import annotations

import math
import os
import re
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


def affinity_cpus() -> set[int]:
    """The CPUs in this process's affinity mask (the machine's outside Linux)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def affinity_cpu_count() -> int:
    """How many CPUs affinity_cpus() holds."""
    return len(affinity_cpus())


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


SYSFS_CPU = Path("/sys/devices/system/cpu")
ENGINE_THREAD_NAMES = ("lmkit-engine", "lmkit-worker")  # csrc/core/threads.h: the engine loop and its kernel team
_CPU_LIST = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8] (the kernel's cpulist format, as taskset -c and Cpus_allowed_list); raises
    ValueError naming the form."""
    if not isinstance(text, str) or not _CPU_LIST.match(text):
        raise ValueError(f"{text!r} is not a CPU list: give CPU numbers and ranges such as '0-3,8'")
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"CPU range {part!r} runs backwards: write it low-high")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _core_key(cpu: int, sysfs: Path) -> tuple:
    """(package, core) of a CPU: its SMT siblings share it (the CPU itself where sysfs does not tell)."""
    topo = sysfs / f"cpu{cpu}" / "topology"
    try:
        return (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
    except (OSError, ValueError):
        return ("cpu", cpu)


@dataclass(frozen=True)
class CpuBinding:
    """Where the engine's threads and the process's other threads run (empty tuples: not pinned)."""

    engine_cpus: tuple[int, ...]
    other_cpus: tuple[int, ...]
    why: str

    @property
    def pinned(self) -> bool:
        return bool(self.engine_cpus)

    def describe(self) -> str:
        if not self.pinned:
            return f"threads not pinned ({self.why})"
        rest = f", other threads on CPUs {format_cpu_list(self.other_cpus)}" if self.other_cpus else ""
        return f"engine threads on CPUs {format_cpu_list(self.engine_cpus)}{rest} ({self.why})"


def plan_binding(num_threads: int, spec: str = "auto", affinity=None, sysfs: Path = SYSFS_CPU) -> CpuBinding:
    """Where to run an engine of ``num_threads`` threads (module doc). ``spec``: "auto" (pin when the affinity
    mask has more CPUs than threads), "off", or a CPU list for the engine's threads (within the mask; the
    rest of the mask takes the other threads)."""
    allowed = sorted(affinity if affinity is not None else affinity_cpus())
    if spec == "off":
        return CpuBinding((), (), "cpu_binding='off'")
    if spec == "auto":
        if len(allowed) <= num_threads:
            return CpuBinding((), (), f"the {len(allowed)} CPUs of the affinity mask all run engine threads")
        by_core: dict[tuple, list[int]] = {}
        for cpu in reversed(allowed):  # from the end of the mask
            by_core.setdefault(_core_key(cpu, sysfs), []).append(cpu)
        # one CPU per core first, then the cores' second threads, ...
        order = [cpus[i] for i in range(max(map(len, by_core.values()))) for cpus in by_core.values() if i < len(cpus)]
        engine = sorted(order[:num_threads])
        why = f"{num_threads} of the {len(allowed)} CPUs of the affinity mask"
    else:
        engine = parse_cpu_list(spec)
        outside = [c for c in engine if c not in allowed]
        if outside:
            raise ValueError(f"cpu_binding={spec!r} names CPUs {format_cpu_list(outside)}, outside this process's "
                             f"affinity mask {format_cpu_list(allowed)}: name CPUs within it, or use 'auto'")
        why = f"cpu_binding={spec!r}"
    engine_cores = {_core_key(c, sysfs) for c in engine}
    others = [c for c in allowed if c not in engine]
    apart = [c for c in others if _core_key(c, sysfs) not in engine_cores]
    return CpuBinding(tuple(engine), tuple(apart or others), why)


def move_other_threads(binding: CpuBinding, proc: Path = PROC) -> int:
    """Moves every thread of this process but the engine's own (by name, ENGINE_THREAD_NAMES) onto the binding's
    other CPUs: the calling thread too, so that the threads it starts later follow. Returns how many moved; 0
    when the binding pins nothing or leaves no other CPUs. Threads that end meanwhile are skipped."""
    if not binding.pinned or not binding.other_cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    moved = 0
    for task in sorted((proc / "self" / "task").iterdir()):
        try:
            name = (task / "comm").read_text().strip()
            if name.startswith(ENGINE_THREAD_NAMES):
                continue
            os.sched_setaffinity(int(task.name), binding.other_cpus)
            moved += 1
        except (OSError, ValueError):  # the thread ended, or the OS refused: leave it
            continue
    return moved
