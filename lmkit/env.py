"""Every environment variable lmkit reads, in one place (prefix ``LMKIT_``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``LMKIT_CACHE``: where converted models (the bundled default) are kept.

    Default: ``$XDG_CACHE_HOME/lmkit`` or ``~/.cache/lmkit``.
    """
    value = os.environ.get("LMKIT_CACHE")
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmkit"


def cuda_build_mode() -> str:
    """``LMKIT_CUDA``: ON, OFF or AUTO (default) for building the CUDA backend (read by setup.py)."""
    return os.environ.get("LMKIT_CUDA", "AUTO").upper()


def cuda_archs() -> str | None:
    """``LMKIT_CUDA_ARCHS``: semicolon-separated CUDA architectures for the build (read by setup.py)."""
    return os.environ.get("LMKIT_CUDA_ARCHS") or None


def build_jobs() -> int:
    """``LMKIT_BUILD_JOBS``: parallel compile jobs for the extension build (default: all cores)."""
    return int(os.environ.get("LMKIT_BUILD_JOBS") or os.cpu_count() or 1)
