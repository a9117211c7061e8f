"""CPU limits for benchmark processes: a cgroup with a CPU quota (a Kubernetes `cpu: 500m` limit) and a CPU
pinning, applied in a child before it execs so that it and every process it starts (a Ray node's raylet,
agents and workers) stay inside.

Needs write access to the cgroup file system (root in a container): cgroup v2 ``cpu.max``, else the v1 cpu
controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, period 100 ms. Where there is none,
``QuotaGroup.create`` returns None and says why.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

PERIOD_US = 100_000
CGROUP_V2, CGROUP_V1_CPU = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")


class QuotaGroup:
    """One fresh cgroup limited to a number of CPUs (fractions allowed); ``remove()`` once its processes are
    gone."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, cpus: float, name: str) -> "QuotaGroup | None":
        """A cgroup ``lmkit-bench-<pid>-<name>`` limited to ``cpus`` CPUs, or None (and a message on stderr)
        where this process may not create one."""
        if cpus <= 0:
            raise ValueError(f"a CPU quota must be positive, not {cpus}")
        quota_us = max(1000, int(cpus * PERIOD_US))  # the kernel's least quota is 1 ms
        if (CGROUP_V2 / "cgroup.controllers").exists():
            root, limits = CGROUP_V2, {"cpu.max": f"{quota_us} {PERIOD_US}"}
        elif (CGROUP_V1_CPU / "cgroup.procs").exists():
            root, limits = CGROUP_V1_CPU, {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota_us)}
        else:
            print(f"cpu_limits: no cgroup file system here; no {cpus}-CPU quota for {name}", file=sys.stderr)
            return None
        path = root / f"lmkit-bench-{os.getpid()}-{name}"
        try:
            path.mkdir(exist_ok=True)
            for file, value in limits.items():
                (path / file).write_text(value + "\n")
        except OSError as error:
            print(f"cpu_limits: cannot set up {path} ({error}); no quota for {name}", file=sys.stderr)
            return None
        return cls(path)

    def enter(self) -> None:
        """Moves the calling process into the group."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def remove(self) -> None:
        """Deletes the group (the kernel refuses while a process is inside: then it is left, and said so)."""
        try:
            self.path.rmdir()
        except OSError as error:
            print(f"cpu_limits: {self.path} left in place ({error})", file=sys.stderr)


def quota_groups(cpus: float, names: list[str]) -> list[QuotaGroup]:
    """One group of ``cpus`` CPUs per name (a benchmark's --node-quota); exits naming the cause where a group
    cannot be made, after removing those already made."""
    groups = []
    for name in names:
        group = QuotaGroup.create(cpus, name)
        if group is None:
            for made in groups:
                made.remove()
            raise SystemExit("--node-quota needs a writable cgroup file system (root in a container)")
        groups.append(group)
    return groups


def confine(cpus: set[int] | None = None, group: QuotaGroup | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to ``cpus`` and moves it into ``group`` (either may be None)."""
    if not cpus and group is None:
        return None

    def preexec() -> None:
        if group is not None:
            group.enter()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return preexec
