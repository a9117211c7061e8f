"""Shared fixtures and hooks: tiny random HF models (tests/factories.py) with their HF fp32 references, the bundled
SmolLM2, GPU tests skipped without a GPU, and a check that every engine gives all its KV blocks back."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import assert_blocks_free, cuda_usable

# The engines of this test session (and the servers it starts as subprocesses, which inherit this) size
# their KV pools against each other only, not against lmkit servers that happen to run on the host.
os.environ["LMKIT_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="lmkit-test-runtime-")
# Under `-n 2` two workers share the cores: torch's reference computations take one thread each (a team of two
# per worker would only spin against the other worker). lmkit's engines are not affected (their own threads).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Seconds each test file took (setup, call and teardown of its tests), heaviest first: the order files are
# handed to the workers, so that no worker is left alone with a long file at the end. Refresh it with
# LMKIT_TEST_DURATIONS_OUT=tests/file_durations.json python -m pytest tests -q -n 2
FILE_DURATIONS = Path(__file__).with_name("file_durations.json")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not cuda_usable():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and an engine built with the CUDA backend")
        for item in gpu_items:
            item.add_marker(skip)
    heaviest_files_first(items)


def heaviest_files_first(items) -> None:
    """Longest first: with --dist loadfile the workers take whole files in collection order. A file missing from
    FILE_DURATIONS goes before the known ones (a new file may be a heavy one: begun last, it would keep one worker
    busy while the other waits; begun first, a light one costs nothing); the tests of a file keep their order."""
    try:
        seconds = json.loads(FILE_DURATIONS.read_text())
    except (OSError, ValueError):
        return

    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(file_of(item), i)
    items.sort(key=lambda item: (-seconds.get(file_of(item), math.inf), first[file_of(item)]))


_file_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    if os.environ.get("LMKIT_TEST_DURATIONS_OUT"):
        _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("LMKIT_TEST_DURATIONS_OUT")
    if out and not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        ranked = sorted(_file_seconds.items(), key=lambda kv: -kv[1])
        Path(out).write_text(json.dumps({f: round(s, 1) for f, s in ranked}, indent=1) + "\n")


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
