"""Engine: one model loaded into the C++ engine, with its tokenizer. Thread-safe submit/cancel;
outputs arrive on the engine's callback thread and are handed to the caller's queue."""

from __future__ import annotations

import itertools
import queue
import weakref
from pathlib import Path
from typing import Callable

from lmkit.config import EngineConfig
from lmkit.messages import GenerationConfig
from lmkit.model_path import resolve_model
from lmkit.models import ModelSpec, load_model_spec
from lmkit.tokenizer import Tokenizer


def _import_extension():
    try:
        from lmkit import _engine
    except ImportError as e:
        raise ImportError(
            f"lmkit's C++ engine (lmkit._engine) is not built: {e}. Install with `pip install -e .`"
        ) from None
    return _engine


def _resolve_device(device: str) -> str:
    if device in ("cpu", "auto"):
        return "cpu"  # the CUDA backend is not part of this build yet
    raise ValueError(f"device={device!r} is not available in this build; use device='cpu'")


class Engine:
    """A model folder running in lmkit._engine.

    ``submit`` may be called from any thread; ``on_output(RequestOutput)`` runs on the engine's callback
    thread and must be quick (put into a queue). Every request ends with exactly one finished output.
    """

    _live: "weakref.WeakSet[Engine]" = weakref.WeakSet()

    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None,
                 chat_template: str | None = None):
        _engine = _import_extension()
        self.config = engine_config or EngineConfig()
        self.model_path = resolve_model(model)
        self.spec: ModelSpec = load_model_spec(self.model_path)
        self.tokenizer = Tokenizer(self.model_path, chat_template=chat_template)
        self.device = _resolve_device(self.config.device)
        sources = {role: entry.as_source() for role, entry in self.spec.sources.items()}
        self._cpp = _engine.Engine(
            self.config.to_engine_config(self.device), self.spec.to_engine_config(), sources,
            self.spec.eos_token_ids,
        )
        self._ids = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, self._cpp.shutdown)
        Engine._live.add(self)

    @classmethod
    def live_engines(cls) -> list["Engine"]:
        """Engines created in this process and not closed yet."""
        return [e for e in list(cls._live) if not e._closed]

    @property
    def session_len(self) -> int:
        return self._cpp.session_len

    @property
    def num_total_blocks(self) -> int:
        return self._cpp.num_total_blocks

    def submit(self, prompt_ids: list[int], gen_config: GenerationConfig,
               on_output: Callable[[object], None]) -> int:
        """Queues one request; returns its id. Raises ValueError for an impossible request."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        request_id = next(self._ids)
        self._cpp.submit(request_id, list(prompt_ids), gen_config.to_sampling_params(), on_output)
        return request_id

    def submit_to_queue(self, prompt_ids: list[int], gen_config: GenerationConfig) -> tuple[int, queue.SimpleQueue]:
        """submit() whose outputs land in the returned queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        return self.submit(prompt_ids, gen_config, q.put), q

    def cancel(self, request_id: int) -> None:
        """Ends a request (its last output has finish_reason 'cancelled'); unknown ids are ignored."""
        self._cpp.cancel(request_id)

    def metrics(self):
        return self._cpp.metrics()

    def check_integrity(self) -> None:
        """Raises RuntimeError if KV blocks are not conserved (free + active == total, owners exact)."""
        self._cpp.check_integrity()

    def close(self) -> None:
        """Stops the engine; unfinished requests end as cancelled. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()

