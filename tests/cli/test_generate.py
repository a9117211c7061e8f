"""The `lmkit generate` command end to end on the tiny model: figures on stderr, --dtype reaching the engine, a
missing model reported clearly."""

from __future__ import annotations

import subprocess
import sys


def test_cli_generate_on_tiny_model(tiny_llama):
    run = subprocess.run([sys.executable, "-m", "lmkit", "generate", str(tiny_llama[0]), "ab",
                          "--max-new-tokens", "5"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "tokens" in run.stderr and "tok/s decode" in run.stderr


def test_cli_generate_dtype(tiny_llama):
    """--dtype reaches the engine: bfloat16 runs where the CPU has AVX512_BF16 and is refused with the reason
    elsewhere; an unknown dtype names the choices."""
    from lmkit import _engine

    def generate(*extra):
        return subprocess.run([sys.executable, "-m", "lmkit", "generate", str(tiny_llama[0]), "ab",
                               "--max-new-tokens", "3", *extra], capture_output=True, text=True, timeout=120)

    run = generate("--dtype", "bfloat16")
    if _engine.cpu_bf16_available():
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode != 0 and "AVX512_BF16" in run.stderr
    run = generate("--dtype", "float16")
    assert run.returncode != 0 and "dtype must be auto, float32 or bfloat16" in run.stderr


def test_cli_reports_bad_model_clearly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lmkit", "generate", str(tmp_path / "missing"), "ab"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "does not exist" in run.stderr
