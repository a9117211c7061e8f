"""Builds the C++ unit tests (block manager, scheduler, CPU kernels against their references) and
runs them under ctest (with the kernel micro-benchmark's smoke run), then the torch GEMM comparison."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_ctest_passes():
    build = ROOT / "build" / "ctest"
    generator = ["-GNinja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *generator, "-DLMKIT_PYTHON=OFF",
                    "-DLMKIT_BUILD_TESTS=ON", "-DLMKIT_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True, text=True)
    built = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    run = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "100% tests passed" in run.stdout
    # the kernel benchmark's torch comparison, against the binary ctest just built and ran
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
