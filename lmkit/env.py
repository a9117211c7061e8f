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


def api_keys() -> tuple[str, ...]:
    """``LMKIT_API_KEYS``: Bearer tokens the servers accept when none are given on their command line (or in a
    Ray Serve application's args), comma-separated; so a container takes them from a secret without putting
    them in its arguments."""
    return tuple(k.strip() for k in os.environ.get("LMKIT_API_KEYS", "").split(",") if k.strip())


def cuda_build_mode() -> str:
    """``LMKIT_CUDA``: ON, OFF or AUTO (default) for building the CUDA backend (read by setup.py)."""
    return os.environ.get("LMKIT_CUDA", "AUTO").upper()


def cuda_archs() -> str | None:
    """``LMKIT_CUDA_ARCHS``: semicolon-separated CUDA architectures for the build (read by setup.py)."""
    return os.environ.get("LMKIT_CUDA_ARCHS") or None


def build_jobs() -> int:
    """``LMKIT_BUILD_JOBS``: parallel compile jobs for the extension build (default: all cores)."""
    return int(os.environ.get("LMKIT_BUILD_JOBS") or os.cpu_count() or 1)


def build_tests() -> bool:
    """``LMKIT_BUILD_TESTS``: ON (or 1) also builds the C++ unit tests beside the extension, in the same CMake
    build, for ``ctest`` (tests/kernels/test_csrc.py runs it; read by setup.py). Default OFF."""
    return os.environ.get("LMKIT_BUILD_TESTS", "OFF").upper() in ("ON", "1", "TRUE", "YES")


def runtime_dir() -> Path:
    """``LMKIT_RUNTIME_DIR``: where each engine records the memory it holds (weights + KV pool), so that the
    lmkit processes of one user on one host size their KV pools from what the others left (lmkit/memory.py).

    Default: ``/dev/shm/lmkit-<uid>`` (memory-backed, emptied at boot), or ``<temp dir>/lmkit-<uid>`` where
    /dev/shm is not writable. One fixed place, whatever the session's environment (a login shell and a
    service of the same user must find each other's records).
    """
    value = os.environ.get("LMKIT_RUNTIME_DIR")
    if value:
        return Path(value).expanduser()
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"lmkit-{os.getuid()}"


CPU_ISAS = ("avx512", "avx2", "generic")


def cpu_isa_cap() -> str | None:
    """``LMKIT_CPU_ISA``: avx512, avx2 or generic caps the CPU kernels' instruction set (read by the C++ engine
    when it picks its first kernel; checked here first), as oneDNN's ``ONEDNN_MAX_CPU_ISA`` does: an AVX-512
    machine then runs, and measures, what an AVX2-only CPU runs (no VNNI, no AVX512_BF16, no AMX). Unset: the
    CPU's best. Raises ValueError naming the choices for any other value."""
    value = os.environ.get("LMKIT_CPU_ISA")
    if value is not None and value not in CPU_ISAS:
        raise ValueError(f"LMKIT_CPU_ISA={value!r}: use one of {', '.join(CPU_ISAS)} (or unset it for the CPU's best)")
    return value
