"""Fixtures of the lite tests: tiny random models and calibration settings small enough to run in seconds."""

from __future__ import annotations

import pytest

from tests.factories import make_tiny_model
from tests.helpers import TINY_CALIB


@pytest.fixture(scope="session")
def lite_tiny_llama(tmp_path_factory):
    """A tiny random Llama (GQA, untied) with group-size-friendly shapes: hidden 64, intermediate 128."""
    folder = tmp_path_factory.mktemp("lite-llama")
    make_tiny_model(folder, "llama", intermediate_size=128)
    return folder


@pytest.fixture(scope="session")
def lite_tiny_qwen2(tmp_path_factory):
    """A tiny random Qwen2 (q/k/v biases, tied embeddings), stored in bfloat16."""
    folder = tmp_path_factory.mktemp("lite-qwen2")
    make_tiny_model(folder, "qwen2", intermediate_size=128, tie_word_embeddings=True, dtype="bfloat16")
    return folder


@pytest.fixture(scope="module")
def both_formats(lite_tiny_llama, tmp_path_factory):
    """lite_tiny_llama quantized once by AWQ (g32) into each format: (AutoAWQ folder, compressed-tensors folder)."""
    from lmkit.lite.awq import quantize_awq
    from lmkit.lite.config import AwqConfig

    out = tmp_path_factory.mktemp("formats")
    for fmt in ("autoawq", "compressed-tensors"):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=out / fmt, w_group_size=32, format=fmt, **TINY_CALIB))
    return out / "autoawq", out / "compressed-tensors"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models are all small ops: one thread is faster, and immune to OpenMP barriers stalling on a
    shared machine (see lmkit.lite.threads)."""
    from lmkit.lite.threads import torch_threads

    with torch_threads(1):
        yield
