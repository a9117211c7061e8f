"""pipeline(): batch and streaming generation for scripts and notebooks, built on AsyncEngine (an
event loop on a background thread drives the request streams; the caller's thread just waits)."""

from __future__ import annotations

import asyncio
import queue
import threading
from pathlib import Path
from typing import Iterator, Union

import numpy as np

from lmkit.config import EngineConfig
from lmkit.engine import AsyncEngine, Prompt, RequestStream
from lmkit.messages import GenerationConfig, Response

Prompts = Union[Prompt, list[Prompt]]
_DONE = object()


def _normalize(prompts: Prompts) -> tuple[list[Prompt], bool]:
    """(list of prompts, whether a single prompt was given)."""
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts], True  # one conversation
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts], True  # token ids
    if isinstance(prompts, list) and prompts and all(isinstance(p, (str, list)) for p in prompts):
        return list(prompts), False
    raise ValueError(
        "prompts must be a string, chat messages ([{'role': ..., 'content': ...}]), token ids, "
        "or a list of those; got " + type(prompts).__name__ + ("" if prompts else " (empty)")
    )


class _LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmkit-pipeline-loop", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class Pipeline:
    """Generation with one model. Use as a context manager, or call close()."""

    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = async_engine.tokenizer
        self._loop_thread = _LoopThread()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (see Engine.encode)."""
        return self.engine.encode(prompt)

    def _responses(self, prompts: Prompts, gen_config: GenerationConfig | None) -> Iterator[Response]:
        """Submits every prompt (a bad one raises before anything runs), then yields the Response deltas of
        all of them as they arrive. Leaving early cancels what is still running."""
        gen_config = gen_config or self.engine.default_generation_config()
        items, _ = _normalize(prompts)
        encoded = [self.engine.encode(p) for p in items]
        grammar = (self.engine.compile_grammar(gen_config.structured_output)
                   if gen_config.structured_output is not None else None)  # once for all prompts, on this thread
        loop = self._loop_thread.loop
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(encoded):
                streams.append(self.async_engine.submit(ids, gen_config, index=i, loop=loop, grammar=grammar))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        results: queue.SimpleQueue = queue.SimpleQueue()

        async def drain(stream: RequestStream) -> None:
            try:
                async for r in stream:
                    results.put(r)
            finally:
                results.put(_DONE)

        futures = [asyncio.run_coroutine_threadsafe(drain(s), loop) for s in streams]
        remaining = len(streams)
        try:
            while remaining:
                item = results.get()
                if item is _DONE:
                    remaining -= 1
                else:
                    yield item
        finally:
            for s in streams:
                s.cancel()
            for f in futures:
                f.cancel()

    def stream_infer(self, prompts: Prompts, gen_config: GenerationConfig | None = None) -> Iterator[Response]:
        """Yields incremental Responses (text and token_ids since the previous one of that index and
        sample_index) as tokens arrive, for every prompt; the last one of each completion has finish_reason
        set. Leaving the loop early cancels what is still running. Without ``gen_config``: the model's
        generation defaults (Engine.default_generation_config())."""
        return self._responses(prompts, gen_config)

    def __call__(self, prompts: Prompts, gen_config: GenerationConfig | None = None) -> Response | list[Response]:
        """Generates for one prompt (returns a Response) or a batch (returns a list in input order). With
        GenerationConfig.n > 1 every prompt gives n Responses, in (index, sample_index) order, as a list.
        Without ``gen_config``: the model's generation defaults (Engine.default_generation_config())."""
        gen_config = gen_config or self.engine.default_generation_config()
        items, single = _normalize(prompts)
        parts: dict[tuple[int, int], list[Response]] = {}
        for r in self._responses(items, gen_config):
            parts.setdefault((r.index, r.sample_index), []).append(r)
        responses = [_join(parts[key]) for key in sorted(parts)]
        return responses[0] if single and gen_config.n == 1 else responses

    def close(self) -> None:
        self.async_engine.close()
        self._loop_thread.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _join(deltas: list[Response]) -> Response:
    """One Response from the deltas of one completion."""
    last = deltas[-1]
    token_ids = [t for d in deltas for t in d.token_ids]
    logits = [d.logits for d in deltas if d.logits is not None]
    logprobs = [lp for d in deltas if d.logprobs is not None for lp in d.logprobs]
    prompt_logprobs = [lp for d in deltas if d.prompt_logprobs is not None for lp in d.prompt_logprobs]
    return Response(
        text="".join(d.text for d in deltas), token_ids=token_ids, input_token_len=last.input_token_len,
        generate_token_len=len(token_ids), finish_reason=last.finish_reason, index=last.index,
        sample_index=last.sample_index, error=last.error, error_kind=last.error_kind,
        logits=np.concatenate(logits) if logits else None, logprobs=logprobs if logprobs else None,
        prompt_logprobs=prompt_logprobs if prompt_logprobs else None,
    )


def pipeline(model: str | Path | None = None, engine_config: EngineConfig | None = None,
             chat_template: str | None = None) -> Pipeline:
    """A generation pipeline for an HF model folder, or the bundled SmolLM2-135M-Instruct when
    ``model`` is None or "smollm2"."""
    return Pipeline(AsyncEngine(model, engine_config, chat_template=chat_template))
