"""Another build of lmkit measured beside this one: the ``--baseline PKGDIR[:LABEL]`` of bench_peers.py and
profile_throughput.py (old and new builds interleaved on the same machine, for "no regression" figures).

PKGDIR is a folder that holds an importable ``lmkit`` package laid out as setup.py installs it: a tree's
``lmkit/``, its ``serve/`` as ``lmkit/serve``, its ``lite/`` as ``lmkit/lite``, and the ``_engine*.so`` built
from that tree in ``lmkit/``. A benchmark runs its baseline rows in worker processes whose PYTHONPATH puts
PKGDIR first (ahead of the editable install of this tree, whose finder comes after sys.path), and each worker
reports the ``lmkit.__file__`` it imported, which must lie under PKGDIR.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HOW_TO_MAKE = ("mkdir -p PKGDIR && cp -r TREE/lmkit PKGDIR/lmkit && cp -r TREE/serve PKGDIR/lmkit/serve && "
               "cp -r TREE/lite PKGDIR/lmkit/lite && cp BUILD/_engine*.so PKGDIR/lmkit/")


@dataclass(frozen=True)
class Baseline:
    pkg_dir: Path  # holds lmkit/ (with serve/, lite/ and _engine*.so inside)
    label: str  # the rows' suffix: "lmkit fp (LABEL)"

    @classmethod
    def parse(cls, spec: str) -> Baseline:
        """``PKGDIR`` or ``PKGDIR:LABEL`` (LABEL defaults to PKGDIR's name); raises ValueError naming the fix
        when PKGDIR holds no importable lmkit with its extension."""
        path, sep, label = spec.rpartition(":")
        if not sep or "/" in label:  # no label (or a ':' inside the path)
            path, label = spec, ""
        pkg_dir = Path(path).expanduser().resolve()
        if not (pkg_dir / "lmkit" / "__init__.py").is_file():
            raise ValueError(f"--baseline {spec}: {pkg_dir}/lmkit/__init__.py is missing; make it with\n  {HOW_TO_MAKE}")
        if not any((pkg_dir / "lmkit").glob("_engine*.so")):
            raise ValueError(f"--baseline {spec}: no _engine*.so in {pkg_dir}/lmkit (copy the one built from that tree)")
        return cls(pkg_dir, label or pkg_dir.name)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with PKGDIR first on PYTHONPATH."""
        rest = base.get("PYTHONPATH")
        return dict(base, PYTHONPATH=str(self.pkg_dir) + (os.pathsep + rest if rest else ""))

    def check(self, location: str | None) -> str | None:
        """None when a worker's lmkit (``lmkit_location()``) is this baseline's, else the error for its row."""
        if location and Path(location).resolve().is_relative_to(self.pkg_dir):
            return None
        return f"the worker imported lmkit from {location}, not from {self.pkg_dir}"

    def row_name(self, name: str) -> str:
        return f"{name} ({self.label})"


def lmkit_location() -> str:
    """Where the running process imported lmkit from (its package folder), for the tables' footnotes."""
    import lmkit

    return str(Path(lmkit.__file__).resolve().parent)
