"""pipeline(): batch and streaming generation over the engine, for scripts and notebooks."""

from __future__ import annotations

import functools
import queue
from pathlib import Path
from typing import Iterator, Union

import numpy as np

from lmkit.config import EngineConfig
from lmkit.engine import Engine
from lmkit.messages import GenerationConfig, Response
from lmkit.tokenizer import IncrementalDetokenizer

Messages = list[dict]
Prompt = Union[str, Messages, list[int]]  # text, one conversation, or token ids
Prompts = Union[Prompt, list[Prompt]]


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
        "or a list of those; got " + type(prompts).__name__
        + ("" if prompts else " (empty)")
    )


def _put_indexed(outputs: queue.SimpleQueue, index: int, out) -> None:
    outputs.put((index, out))


class Pipeline:
    """Generation with one model. Use as a context manager, or call close()."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a string (with the tokenizer's special tokens), of chat messages (chat template),
        or token ids as given."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and prompt:
            return self.tokenizer.apply_chat_template(prompt)
        raise ValueError(f"a prompt must be a non-empty string, list of chat messages or token ids, got {prompt!r}")

    def _submit_all(self, prompts: list[Prompt], gen_config: GenerationConfig):
        """Encodes every prompt first (so a bad one fails before anything runs), then submits all.
        Returns (token ids per prompt, request ids, one queue receiving (index, RequestOutput))."""
        encoded = [self.encode(p) for p in prompts]
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        request_ids: list[int] = []
        try:
            for i, ids in enumerate(encoded):
                request_ids.append(self.engine.submit(ids, gen_config, functools.partial(_put_indexed, outputs, i)))
        except BaseException:
            for rid in request_ids:
                self.engine.cancel(rid)
            raise
        return encoded, request_ids, outputs

    def _outputs(self, items: list[Prompt], gen_config: GenerationConfig):
        """Yields (index, prompt ids, RequestOutput) as the engine produces them, until every request has
        finished. Leaving early cancels what is still running."""
        encoded, request_ids, outputs = self._submit_all(items, gen_config)
        pending = set(range(len(items)))
        try:
            while pending:
                i, out = outputs.get()
                if out.finished:
                    pending.discard(i)
                yield i, encoded[i], out
        finally:
            for i in pending:
                self.engine.cancel(request_ids[i])

    def stream_infer(self, prompts: Prompts, gen_config: GenerationConfig | None = None) -> Iterator[Response]:
        """Yields incremental Responses (text and token_ids since the previous one of that index) as tokens
        arrive, for every prompt; the last one of each index has finish_reason set. Leaving the loop early
        cancels what is still running."""
        gen_config = gen_config or GenerationConfig()
        items, _ = _normalize(prompts)
        detoks = [IncrementalDetokenizer(self.tokenizer, gen_config.skip_special_tokens) for _ in items]
        counts = [0] * len(items)
        for i, ids, out in self._outputs(items, gen_config):
            counts[i] += len(out.token_ids)
            yield Response(
                text=detoks[i].add(out.token_ids, final=out.finished), token_ids=list(out.token_ids),
                input_token_len=len(ids), generate_token_len=counts[i],
                finish_reason=(out.finish_reason or None) if out.finished else None,
                index=i, error=out.error or None, logits=out.logits,
            )

    def __call__(self, prompts: Prompts, gen_config: GenerationConfig | None = None) -> Response | list[Response]:
        """Generates for one prompt (returns a Response) or a batch (returns a list, in input order)."""
        gen_config = gen_config or GenerationConfig()
        items, single = _normalize(prompts)
        token_ids: list[list[int]] = [[] for _ in items]
        logits: list[list[np.ndarray]] = [[] for _ in items]
        responses: list[Response | None] = [None] * len(items)
        for i, ids, out in self._outputs(items, gen_config):
            token_ids[i].extend(out.token_ids)
            if out.logits is not None:
                logits[i].append(out.logits)
            if out.finished:
                responses[i] = Response(
                    text=self.tokenizer.decode(token_ids[i], skip_special_tokens=gen_config.skip_special_tokens),
                    token_ids=token_ids[i], input_token_len=len(ids), generate_token_len=len(token_ids[i]),
                    finish_reason=out.finish_reason, index=i, error=out.error or None,
                    logits=np.concatenate(logits[i]) if logits[i] else None,
                )
        return responses[0] if single else responses

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(model: str | Path | None = None, engine_config: EngineConfig | None = None,
             chat_template: str | None = None) -> Pipeline:
    """A generation pipeline for an HF model folder, or the bundled SmolLM2-135M-Instruct when
    ``model`` is None or "smollm2"."""
    return Pipeline(Engine(model, engine_config, chat_template=chat_template))
