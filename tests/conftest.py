"""Shared fixtures and hooks: tiny random HF models (tests/factories.py) with their HF fp32 references, the bundled
SmolLM2, GPU tests skipped without a GPU, and a check that every engine gives all its KV blocks back."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.helpers import assert_blocks_free, cuda_usable

# The engines of this test session (and the servers it starts as subprocesses, which inherit this) size
# their KV pools against each other only, not against lmkit servers that happen to run on the host.
os.environ["LMKIT_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="lmkit-test-runtime-")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not cuda_usable():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and an engine built with the CUDA backend")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.factories import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, make_tiny_model(folder, "llama")


@pytest.fixture(scope="session")
def tiny_llama_pipe(tiny_llama):
    from lmkit import EngineConfig, pipeline

    with pipeline(tiny_llama[0], EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=128,
                                              max_batch_size=16,
                                              cache_block_seq_len=16)) as pipe:
        yield pipe


@pytest.fixture(autouse=True)
def _every_engine_gives_blocks_back():
    """After every test, every live engine must be idle with all KV blocks free."""
    yield
    from lmkit.engine import Engine

    for engine in Engine.live_engines():
        assert_blocks_free(engine)


@pytest.fixture(scope="session")
def smollm2_path():
    """The bundled SmolLM2-135M-Instruct as an HF folder (converted once into LMKIT_CACHE)."""
    from lmkit.model_path import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_pipe(smollm2_path):
    """One SmolLM2 pipeline for the tests that need real text."""
    from lmkit import EngineConfig, pipeline

    with pipeline(smollm2_path, EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=256, max_batch_size=8,
                                             session_len=2048)) as pipe:
        yield pipe
