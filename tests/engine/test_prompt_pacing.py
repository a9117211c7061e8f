"""Prompt pacing (EngineConfig.decode_slowdown, csrc/engine/prompt_pacer.h): a request that decodes keeps getting
tokens while a long prompt is computed beside it, where unpaced the prompt is one step that stalls it; a short
request that arrives during the long prompt starts before the prompt ends; and pacing changes when tokens come,
never which (fp32: the kernels are batch-invariant, and a prompt computed in chunks is the prompt computed whole).
The C++ tests hold the policy to exact plans (test_scheduler) and the pacer to a simulated step cost
(test_prompt_pacer); this runs it on the real engine and its timings: SmolLM2, a 1,800-token prompt."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from lmkit import AsyncEngine, EngineConfig, GenerationConfig
from tests.helpers import assert_blocks_free

LONG = 1800


def run(model: str, slowdown: float) -> dict:
    engine = AsyncEngine(model, EngineConfig(dtype="float32", session_len=LONG + 64, cache_max_entry_count=96,
                                             decode_slowdown=slowdown))
    rng = np.random.default_rng(5)
    long_ids = rng.integers(100, 40_000, LONG).tolist()
    decoder_ids = rng.integers(100, 40_000, 12).tolist()
    short_ids = rng.integers(100, 40_000, 8).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)

    async def main() -> dict:
        stamps: list[float] = []
        tokens: list[int] = []
        started = asyncio.Event()

        async def decoder():
            async for out in engine.generate(decoder_ids, GenerationConfig(max_new_tokens=300, **greedy)):
                stamps.extend([time.perf_counter()] * len(out.token_ids))
                tokens.extend(out.token_ids)
                if len(tokens) >= 5:
                    started.set()

        async def first_token(ids: list[int]) -> tuple[int, float]:
            async for out in engine.generate(ids, GenerationConfig(max_new_tokens=1, **greedy)):
                if out.token_ids:
                    return out.token_ids[0], time.perf_counter()
            raise AssertionError("no token")

        task = asyncio.create_task(decoder())
        await started.wait()
        submitted = time.perf_counter()
        long_task = asyncio.create_task(first_token(long_ids))
        await asyncio.sleep(0.05)  # the long prompt is being computed
        short_token, short_done = await first_token(short_ids)
        long_token, long_done = await long_task
        await task
        during = sum(1 for t in stamps if submitted < t < long_done)
        return {"tokens": tokens, "during": during, "long": long_token, "short": short_token,
                "short_first": short_done < long_done}

    try:
        result = asyncio.run(main())
        assert_blocks_free(engine.engine)
        return result
    finally:
        engine.close()


@pytest.mark.slow
def test_decodes_go_on_beside_a_long_prompt_and_a_short_request_goes_first(smollm2_path):
    paced, unpaced = run(smollm2_path, EngineConfig().decode_slowdown), run(smollm2_path, 0)
    # Unpaced the 1,800 tokens are one step: the decoder gets at most the tokens of the steps around it.
    assert unpaced["during"] <= 3, unpaced["during"]
    assert not unpaced["short_first"]
    # Paced it decodes at about half its speed meanwhile (~100+ tokens on 2 Zen 5 cores), and the short request,
    # sent 50 ms after the long prompt, is answered before it.
    assert paced["during"] >= 20, paced["during"]
    assert paced["short_first"]
    for key in ("tokens", "long", "short"):
        assert paced[key] == unpaced[key], key

