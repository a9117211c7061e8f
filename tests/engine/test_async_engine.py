"""AsyncEngine: streaming with asyncio, abort by request id, many concurrent requests, a closed event
loop ending its requests, and the metrics object."""

from __future__ import annotations

import asyncio
import random

import pytest

from lmkit import AsyncEngine, GenerationConfig
from tests.helpers import assert_blocks_free, run_with_random_cancellations


@pytest.fixture()
def async_engine(tiny_llama_pipe):
    return AsyncEngine(engine=tiny_llama_pipe.engine)


def test_generate_streams_and_matches_pipeline(async_engine, tiny_llama_pipe):
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    expected = tiny_llama_pipe([9, 8, 7], gen)

    async def run():
        parts = [r async for r in async_engine.generate([9, 8, 7], gen, request_id="a")]
        return parts

    parts = asyncio.run(run())
    assert [t for p in parts for t in p.token_ids] == expected.token_ids
    assert "".join(p.text for p in parts) == expected.text
    assert parts[-1].finish_reason == "length" and parts[-1].generate_token_len == 16


def test_abort_and_concurrency(async_engine):
    """Twelve short requests beside a long one, then an abort of the long one: it ends "cancelled" with fewer
    tokens than asked. The abort races the long request's end (1000 tokens of the tiny model take ~10 ms on a
    fast core, less than a busy event loop may take to hand the short requests' outputs over), so a round whose
    long request ended by length first (all 1000 tokens, which is also correct) runs again, until an abort lands
    (20 rounds at most)."""
    async def run():
        gen = GenerationConfig(max_new_tokens=1000, ignore_eos=True)
        short = GenerationConfig(max_new_tokens=8, ignore_eos=True)
        got = {}

        async def consume(name, prompt, g):
            got[name] = [r async for r in async_engine.generate(prompt, g, request_id=name)]

        tasks = [asyncio.create_task(consume(f"r{i}", [i + 1, 2, 3], short)) for i in range(12)]
        long_task = asyncio.create_task(consume("long", [1, 2], gen))
        await asyncio.gather(*tasks)
        await async_engine.abort("long")
        await long_task
        await async_engine.abort("unknown")  # ignored
        return got

    for _ in range(20):
        got = asyncio.run(run())
        assert all(got[f"r{i}"][-1].finish_reason == "length" for i in range(12))
        last = got["long"][-1]
        if last.finish_reason == "cancelled":
            assert last.generate_token_len < 1000
            break
        assert last.finish_reason == "length" and last.generate_token_len == 1000, last
    else:
        raise AssertionError("no abort landed before the long request's end in 20 rounds")


def test_duplicate_request_id_is_refused(async_engine):
    async def run():
        gen = GenerationConfig(max_new_tokens=300, ignore_eos=True)
        first = async_engine.generate([1, 2], gen, request_id="same")
        await first.__anext__()
        with pytest.raises(ValueError, match="already running"):
            async for _ in async_engine.generate([1, 2], gen, request_id="same"):
                pass
        await first.aclose()

    asyncio.run(run())


def test_closed_event_loop_ends_its_requests(async_engine):
    loop = asyncio.new_event_loop()
    gen = GenerationConfig(max_new_tokens=2000, ignore_eos=True)

    async def start():
        agen = async_engine.generate([4, 5, 6], gen)
        await agen.__anext__()
        return agen

    agen = loop.run_until_complete(start())
    loop.close()  # mid-stream: the next output finds the loop closed and cancels the request
    assert_blocks_free(async_engine.engine, timeout_s=10)
    del agen


def test_thousand_requests_random_cancellations(tiny_llama_pipe):
    engine = tiny_llama_pipe.engine
    finished = run_with_random_cancellations(engine, random.Random(1000), 1000, 40)
    assert finished >= 1000  # every completion of every request ended once
    assert_blocks_free(engine)
    m = engine.metrics()
    assert m.num_running == 0 and m.num_waiting == 0
    assert tiny_llama_pipe([3, 4, 5], GenerationConfig(max_new_tokens=4, ignore_eos=True)).finish_reason == "length"


def test_metrics_report_latency_and_usage(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    before = pipe.engine.metrics()
    pipe([[1, 2, 3]] * 4, GenerationConfig(max_new_tokens=10, ignore_eos=True))
    m = pipe.engine.metrics()
    assert m.num_generated_tokens - before.num_generated_tokens == 40
    assert m.num_finished_requests - before.num_finished_requests == 4
    assert len(m.ttft_s) >= 4 and all(t > 0 for t in m.ttft_s[-4:])
    assert len(m.inter_token_s) >= 36 and all(t >= 0 for t in m.inter_token_s)
    assert 0.0 <= m.kv_usage <= 1.0 and m.prefix_hit_rate == 0.0
