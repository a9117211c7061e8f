"""The C++ unit tests under ctest, in the CMake build that the install made (the README's test command installs
with LMKIT_BUILD_TESTS=ON, which builds them beside lmkit._engine): nothing is compiled here. The engine's units
(block manager, scheduler, batch, checks, MoE routing, thread pool) answer in a second; the CPU kernels against
their double-precision references on every ISA of this CPU, the kernel micro-benchmark's smoke run and the torch
GEMM comparison against that benchmark's binary take minutes (slow)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = "test_cpu_kernels|bench_cpu_kernels_smoke"
"""The ctest names of the slow half (the rest are the engine's units)."""


def engine_build() -> Path:
    """The CMake build lmkit._engine came from, holding the C++ unit tests (or failing with how to get them)."""
    from lmkit import _engine

    build = Path(_engine.build_dir)
    assert (build / "CTestTestfile.cmake").exists() and (build / "test_cpu_kernels").exists(), (
        f"the build of lmkit._engine ({build}) holds no C++ unit tests: install with "
        "LMKIT_BUILD_TESTS=ON pip install -e '.[test]' (the README's test command); the rebuild adds only the tests")
    return build


def ctest(build: Path, *args: str) -> str:
    ctest_bin = shutil.which("ctest")
    assert ctest_bin, "ctest is not on PATH: the test extra installs cmake, which brings it"
    run = subprocess.run([ctest_bin, "--test-dir", str(build), "--output-on-failure", *args], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "100% tests passed" in run.stdout, run.stdout[-2000:]
    return run.stdout


def test_ctest_engine_units_pass():
    out = ctest(engine_build(), "-E", KERNEL_TESTS)
    for name in ("test_block_manager", "test_scheduler", "test_batch", "test_moe", "test_thread_pool",
                 "test_speculative", "test_draft_model"):
        assert name in out, f"{name} did not run: {out[-2000:]}"


@pytest.mark.slow
def test_ctest_cpu_kernels_and_benchmark_smoke_pass():
    build = engine_build()
    jobs = str(max(1, min(4, len(os.sched_getaffinity(0)))))  # one test per ISA, side by side
    out = ctest(build, "-R", KERNEL_TESTS, "-j", jobs)
    for name in ("test_cpu_kernels_generic", "test_cpu_kernels_avx2", "test_cpu_kernels_avx512",
                 "bench_cpu_kernels_smoke"):
        assert name in out, f"{name} did not run: {out[-2000:]}"
    # the kernel benchmark's torch comparison, against the binary ctest just ran
    run = subprocess.run([sys.executable, str(ROOT / "benchmark" / "kernels" / "compare_gemm.py"), "--smoke",
                          "--threads", "1"], capture_output=True, text=True, env={**os.environ, "LMKIT_BENCH_BUILD": str(build)},
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "torch f32" in run.stdout and "[512 x 576] x [1536 x 576]^T" in run.stdout, run.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on PATH")
def test_cuda_backend_compiles_where_a_toolkit_is():
    """With nvcc present, the install compiled every CUDA source (at least for sm_80 and sm_90a), so CUDA code
    cannot rot on machines without a GPU; the module still imports and reports no device here."""
    from lmkit import _engine, env

    if env.cuda_build_mode() == "OFF":
        pytest.skip("LMKIT_CUDA=OFF at install time")
    assert _engine.cuda.is_built, "nvcc is on PATH but lmkit._engine was built without the CUDA backend"
    archs = _engine.cuda.archs.split(",")
    assert {"80", "90a"} <= set(archs), archs
    assert isinstance(_engine.cuda.is_available(), bool)
