"""Where this process's cgroup limits live (v2 unified hierarchy, or a v1 controller's own), for the memory
limit (memory.py) and the CPU quota (cpus.py)."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def limit_files(self_cgroup: Path, root: Path, v2_name: str, v1_controller: str, v1_name: str) -> list[Path]:
    """The files named ``v2_name`` (v2) or ``v1_name`` under the v1 ``v1_controller`` of this process's cgroup and
    of its ancestors, the process's own first (existing or not). In a container the listed path may be the
    host's; walking up to the root also finds the container's own."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = ["0::/"]
    files = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, name = root, v2_name
        elif v1_controller in controllers.split(","):
            base, name = root / controllers, v1_name
            if not base.exists():  # mounted under the controller's own name (memory, cpu) instead of cpu,cpuacct
                base = root / v1_controller
        else:
            continue
        parts = [p for p in path.split("/") if p]
        files += [base.joinpath(*parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files
