"""Fixtures of the lite tests: tiny random models and calibration settings small enough to run in seconds."""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_model

# 8 windows of 64 tokens of pydoc text; scores on 4 of them
TINY_CALIB = dict(calib_dataset="pydoc", calib_samples=8, calib_seqlen=64, search_samples=4)


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


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models are all small ops: one thread is faster, and immune to OpenMP barriers stalling on a
    shared machine (see lmkit.lite.threads)."""
    from lmkit.lite.threads import torch_threads

    with torch_threads(1):
        yield
