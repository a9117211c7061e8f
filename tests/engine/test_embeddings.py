"""Embeddings: the engine pools a prompt's final hidden states (last, mean, first token) without generating, and
the vectors equal HF's fp64 last_hidden_state pooled the same way; batching, chunking and prefix caching leave
them unchanged; a model's sentence-transformers files choose the pooling; no block or slot outlives a request."""

from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
import pytest
import torch

from lmkit import EngineConfig
from lmkit.embedding import PoolingConfig, PoolingConfigError
from lmkit.engine import AsyncEngine, Engine
from tests.factories import build_case

PROMPTS = ["hello world", "a much longer text, " * 15, "x"]


def hf_pooled(ref, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    """HF's final hidden states (after the final norm) of ``ids`` in float64, pooled and normalized."""
    model = copy.deepcopy(ref.model).to(torch.float64)  # the fixture's reference stays fp32
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].numpy()
    v = {"last": h[-1], "mean": h.mean(0), "first": h[0]}[pooling]
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "qwen3_5"])
def case(request, tmp_path_factory):
    """A model folder of a family and HF's model of it: Qwen3 (Qwen3-Embedding's), Gemma 3 (embedding scale,
    1 + w norms, sliding windows), Qwen3.5 (Gated DeltaNet state)."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_case(request.param, folder)


@pytest.fixture(scope="module")
def engine(case):
    e = Engine(case[0], EngineConfig(dtype="float32", num_threads=2, session_len=512, max_prefill_token_num=64))
    yield e
    e.close()


@pytest.mark.parametrize("pooling,normalize", [("last", True), ("mean", False), ("first", True)])
def test_pooled_vectors_equal_hf_fp64(case, engine, pooling, normalize):
    engine._pooling = PoolingConfig(pooling, normalize)
    try:
        vectors = engine.embed(PROMPTS)
    finally:
        engine._pooling = None
    for prompt, got in zip(PROMPTS, vectors):
        want = hf_pooled(case[1], engine.encode(prompt), pooling, normalize)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.abs(got - want).max() <= 2e-5 * max(1.0, np.abs(want).max()), (prompt, pooling)
    free = engine.metrics()
    assert free.num_free_blocks == engine.num_total_blocks and free.num_running == free.num_waiting == 0


def test_batching_chunking_and_prefix_cache_leave_vectors_unchanged(case):
    """One prompt embedded alone, among others, beside a long generation, in 16-token chunks, and again with its
    prefix cached: the same bits (fp32)."""
    from lmkit import GenerationConfig

    config = dict(dtype="float32", num_threads=2, session_len=512)
    alone = Engine(case[0], EngineConfig(**config))
    try:
        expected = [alone.embed([p])[0] for p in PROMPTS]
        gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
        request, outputs = alone.submit_to_queue(alone.encode("a running generation"), gen)
        together = alone.embed(PROMPTS)
        while not outputs.get().finished:
            pass
    finally:
        alone.close()
    for want, got in zip(expected, together):
        assert np.array_equal(want, got)
    chunked = Engine(case[0], EngineConfig(**config, max_prefill_token_num=16, enable_prefix_caching=True))
    try:
        for _ in range(2):  # the second time the long prompt's prefix comes from the cache
            for want, got in zip(expected, chunked.embed(PROMPTS)):
                assert np.array_equal(want, got)
        assert chunked.metrics().num_prefix_hit_tokens > 0
    finally:
        chunked.close()


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    """modules.json with a mean Pooling module and no Normalize module: mean pooling, not normalized; a Dense
    module or a max pooling is refused by name."""
    folder = tmp_path / "model"
    ref = build_case("qwen3", folder)
    (folder / "1_Pooling").mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 96, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert PoolingConfig.of_model(folder) == PoolingConfig("mean", normalize=False)
    engine = Engine(folder, EngineConfig(dtype="float32", num_threads=2, session_len=256))
    try:
        got = engine.embed(["some words"])[0]
        want = hf_pooled(ref, engine.encode("some words"), "mean", False)
        assert np.abs(got - want).max() <= 2e-5 * max(1.0, np.abs(want).max())
    finally:
        engine.close()
    (folder / "modules.json").write_text(json.dumps(modules + [
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert PoolingConfig.of_model(folder) == PoolingConfig("mean", normalize=True)
    (folder / "modules.json").write_text(json.dumps(modules + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(PoolingConfigError, match="Dense"):
        PoolingConfig.of_model(folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        PoolingConfig.of_model(folder)
    assert PoolingConfig.of_model(tmp_path / "no-such-folder") == PoolingConfig("last", True)


def test_dimensions_truncate_then_normalize(engine):
    full = engine.embed(["truncate me"])[0]
    short = engine.embed(["truncate me"], dimensions=8)[0]
    assert short.shape == (8,) and np.isclose(np.linalg.norm(short), 1.0, atol=1e-6)
    assert np.allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)


def test_cancelled_embeddings_hold_no_blocks(engine):
    """An async embedding cancelled while its prompts run cancels them (64-token steps: most are never
    computed): every block and slot is free after."""
    before = engine.metrics().num_prompt_tokens

    async def cancel_midway():
        loop = asyncio.get_running_loop()
        task = loop.create_task(AsyncEngine(engine=engine).embed([engine.encode("y" * 400)] * 6))
        while engine.metrics().num_prompt_tokens == before:  # cancelled once the engine is at work on them
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    for _ in range(200):
        m = engine.metrics()
        if m.num_running == m.num_waiting == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    m = engine.metrics()
    assert m.num_free_blocks == engine.num_total_blocks and m.num_running == m.num_waiting == 0
    assert m.num_free_state_slots == m.num_total_state_slots
    assert 0 < m.num_prompt_tokens - before < 6 * 400
    assert len(engine.embed(["still works"])) == 1
