"""The Python face of the C++ engine.

- ``Engine``: one model loaded into lmkit._engine with its tokenizer; thread-safe ``submit``/``cancel``
  with a callback that runs on the engine's callback thread.
- ``AsyncEngine``: asyncio streaming on top: ``async for r in engine.generate(prompt, gen_config)``,
  ``await engine.abort(request_id)``. Outputs cross from the callback thread with
  ``loop.call_soon_threadsafe``, one wakeup per burst of outputs (no polling). ``pipeline()`` is built on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from contextlib import nullcontext
from pathlib import Path
from typing import AsyncIterator, Callable, Hashable, Union

import numpy as np

from lmkit.config import EngineConfig
from lmkit.cpus import CpuBinding, cpu_budget, plan_binding
from lmkit.embedding import PoolingConfig
from lmkit.env import cache_dir, cpu_isa_cap
from lmkit.messages import GenerationConfig, Response
from lmkit.metrics import EngineMetrics, LatencyRecorder
from lmkit.kv_store import store_identity
from lmkit.model_path import resolve_model
from lmkit.kv_policy import load_kv_policy
from lmkit.memory import CudaPoolSizer, KVPool, log_cuda_kv_pool, reserve_kv_pool
from lmkit.models import ModelSpec, load_model_spec
from lmkit.models.fp8 import dense_sources as fp8_dense_sources
from lmkit.outputs import CompletionState
from lmkit.structured import GrammarCache, StructuredOutput
from lmkit.tokenizer import Tokenizer

log = logging.getLogger("lmkit")

Messages = list[dict]
Prompt = Union[str, Messages, list[int]]  # text, one conversation, or token ids


def _import_extension():
    from lmkit._ext import _engine  # raises ImportError naming the fix when the extension is not built

    return _engine


def _resolve_device(config: EngineConfig, _engine) -> tuple[str, str]:
    """(device, why): cpu or cuda, and for ``auto`` the reason it chose the CPU ("" otherwise). ``auto`` is CUDA
    where the extension has the CUDA backend, a GPU is usable and the settings are not the CPU backend's
    (dtype other than auto, speculative ngram / suffix / mtp, quantization); Engine falls back to the CPU as well
    when the CUDA backend refuses the model at load or it does not fit. ``cuda`` raises ValueError naming what is
    missing."""
    device = config.device
    if device == "cpu":
        return "cpu", ""
    if not _engine.cuda.is_built:
        why = ("lmkit._engine was built without the CUDA backend (no CUDA toolkit at install time, or "
               "LMKIT_CUDA=OFF)")
    elif not _engine.cuda.is_available():
        why = "no CUDA GPU is usable here (no driver or no device)"
    elif device == "auto" and config.dtype != "auto":
        why = f"dtype={config.dtype!r} is the CPU backend's"
    elif device == "auto" and config.speculative in ("ngram", "suffix", "mtp"):
        why = f"speculative={config.speculative!r} runs on the CPU backend"
    elif device == "auto" and config.kv_cache_dir is not None:
        why = "kv_cache_dir (the disk store) runs on the CPU backend"
    elif device == "auto" and config.quantization != "none":
        why = f"quantization={config.quantization!r} runs on the CPU backend"
    else:
        _load_cublas(_engine)
        return "cuda", ""
    if device == "cuda":
        fix = "reinstall with nvcc on PATH, or use device='cpu'" if not _engine.cuda.is_built else "use device='cpu'"
        raise ValueError(f"device='cuda' but {why}; {fix}")
    return "cpu", why


def _cuda_refusal(e: Exception) -> str | None:
    """The reason in a CUDA backend's refusal of a model at load (an op or weight format without kernels, not
    enough device memory), or None for any other error: device='auto' falls back to the CPU for these."""
    text = str(e)
    refused = isinstance(e, ValueError) and any(k in text for k in ("device='cuda'", "by the CUDA backend",
                                                                     "of GPU memory"))
    no_memory = isinstance(e, RuntimeError) and "lmkit (CUDA): cannot allocate" in text
    return text if refused or no_memory else None


def _load_cublas(_engine) -> None:
    """cuBLAS for the dense GEMMs: the system's, else the nvidia-cublas wheel's (PyTorch's dependency); without
    either the engine uses its own tensor-core GEMM."""
    if _engine.cuda.dense_gemm_backend() == "cublas":
        return
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.cublas")
    except ModuleNotFoundError:
        return
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(folder, "lib").glob("libcublas.so*"), reverse=True):
            if _engine.cuda.load_cublas(str(lib)):
                return


def _shut_down(cpp, reservation) -> None:
    """Stops a C++ engine and deletes its memory reservation (lmkit/memory.py). Holds no Engine reference."""
    try:
        cpp.shutdown()
    finally:
        if reservation is not None:
            reservation.remove()


def first_id_outside(ids: list[int], vocab_size: int) -> int | None:
    """The position of the first token id outside [0, vocab_size), None when all are inside (min and max first:
    a prompt that is fine costs two C-speed passes, also where the server checks it on its event loop)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)


class Engine:
    """A model folder running in lmkit._engine.

    ``submit`` may be called from any thread; ``on_output(RequestOutput)`` runs on the engine's callback
    thread and must be quick (put into a queue). Every completion ends with exactly one finished output.
    """

    _live: "weakref.WeakSet[Engine]" = weakref.WeakSet()

    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None,
                 chat_template: str | None = None):
        _engine = _import_extension()
        self.config = engine_config or EngineConfig()
        self.model_path = resolve_model(model)
        self.spec: ModelSpec = load_model_spec(self.model_path)
        self.tokenizer = Tokenizer(self.model_path, chat_template=chat_template)
        sources = {role: entry.as_source() for role, entry in self.spec.sources.items()}
        kv_layer_bits = None
        if self.config.kv_policy is not None:
            kv_layer_bits = load_kv_policy(self.config.kv_policy, self.spec.num_layers, self.spec.num_kv_heads,
                                           self.spec.head_dim)
        if self.spec.quant is not None:
            log.info("weights: %s", self.spec.quant.describe())
            if self.config.quantization != "none":
                raise ValueError(f"quantization={self.config.quantization!r} rounds a float checkpoint's weights at "
                                 f"load, and {self.model_path} is quantized already ({self.spec.quant.describe()}): "
                                 "leave quantization='none'")
        elif self.config.quantization != "none" and self.spec.config.get("quantization_config"):
            raise ValueError(f"quantization={self.config.quantization!r} rounds a float checkpoint's weights at "
                             f"load, and {self.model_path} declares a quantization_config (quant_method "
                             f"{self.spec.config['quantization_config'].get('quant_method')!r}): leave "
                             "quantization='none'")
        elif self.config.quantization == "int8":
            log.info("weights: rounded to int8 per 32 inputs at load (quantization='int8')")
        device, why = _resolve_device(self.config, _engine)
        if why:
            log.info("device='auto': the CPU backend, since %s", why)
        try:
            sizer = self._start(device, _engine, sources, kv_layer_bits)
        except (ValueError, RuntimeError) as e:
            why = _cuda_refusal(e) if device == "cuda" and self.config.device == "auto" else None
            if why is None:
                raise
            log.warning("device='auto': the CPU backend, since the CUDA backend refused the model: %s", why)
            sizer = self._start("cpu", _engine, sources, kv_layer_bits)
        self.kv_pool: KVPool | None = sizer.kv_pool if sizer else None
        """How the KV pool was sized, with the numbers of the start-up line (CPU engines; None on CUDA)."""
        if sizer is None:
            log_cuda_kv_pool(self._cpp, self.config.cache_max_entry_count)

        self._grammars: GrammarCache | None = None
        self._pooling: PoolingConfig | None = None
        self._grammars_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self._cpp, sizer.reservation if sizer else None)
        self.latency = LatencyRecorder()
        Engine._live.add(self)

    def _start(self, device: str, _engine, sources: dict, kv_layer_bits: list[int] | None):
        """Makes self._cpp on a resolved device; returns the CPU pool's sizer (None on CUDA)."""
        self.device = device
        # CPU: the pool is sized in lmkit/memory.py against the host's memory and the other lmkit engines',
        # and this engine's reservation is recorded until close(); CUDA: the backend sizes it from free GPU memory.
        if self.device == "cpu":
            n = self.config.resolved_num_threads
            threads = (f"{n} thread{'s' * (n > 1)} (num_threads)" if self.config.num_threads else
                       f"{n} thread{'s' * (n > 1)} (the CPUs of cpu_binding)"
                       if self.config.binding_cpus is not None else cpu_budget().describe())
            dtype = self.config.resolved_dtype("cpu")
            capped, why = cpu_isa_cap(), ""
            if self.config.dtype == "auto":
                why = (" (dtype='auto': this CPU has AVX512_BF16)" if dtype == "bfloat16" else
                       f" (dtype='auto': LMKIT_CPU_ISA={capped} caps the kernels)" if capped in ("avx2", "generic")
                       else " (dtype='auto': this CPU has no AVX512_BF16)")
            kv = " and bfloat16 KV" if dtype == "float32" and self.config.resolved_kv_bf16("cpu") else ""
            log.info("CPU backend: %s, %s kernels, %s compute%s%s", threads, _engine.cpu_isa(), dtype, kv, why)
            # raises ValueError naming them when an explicit list has CPUs outside the affinity mask
            self.cpu_binding: CpuBinding | None = plan_binding(n, self.config.cpu_binding)
            """Where the engine's threads run (lmkit.cpus.CpuBinding; None on CUDA)."""
            log.info("CPU backend: %s", self.cpu_binding.describe())
        else:
            n, self.cpu_binding = None, None
        self.speculative: bool = self.config.speculates(self.device)
        """Whether the engine verifies draft tokens (EngineConfig.speculative, resolved)."""
        if self.speculative and self.config.speculative == "mtp":
            if not self.spec.mtp_num_layers:
                raise ValueError(f"speculative='mtp' needs a model with a multi-token-prediction head (config "
                                 f"mtp_num_hidden_layers > 0 and its mtp.* tensors: Qwen3.5/3.6, Qwen3-Next); "
                                 f"{self.spec.architecture.name} here has none: use speculative='ngram'")
            log.info("speculative decoding: the model's MTP head, one draft token a request and step")
        elif self.speculative and self.config.speculative != "draft":
            log.info("speculative decoding: n-gram and answer lookup, up to %d draft tokens a request",
                     self.config.num_speculative_tokens)
        draft = self._draft_model() if self.speculative and self.config.speculative == "draft" else None
        sizing = reserve_kv_pool(self.config, self.spec, self.speculative, draft[0] if draft else None) \
            if self.device == "cpu" else nullcontext()
        # FP8 weights: decoded once into the dense dtype the backend computes in (lmkit/models/fp8.py)
        dense = "BF16" if self.device != "cpu" or self.config.resolved_dtype("cpu") == "bfloat16" else "F32"
        quant = self.spec.quant
        fp8 = fp8_dense_sources(sources, self.spec.sources, quant.fp8_scales, dense, cache_dir() / "fp8") \
            if quant is not None and quant.layout == "fp8" else nullcontext(sources)
        identity = ""
        if self.config.kv_cache_dir is not None:
            identity = store_identity(self.spec, self.config, self.device, kv_layer_bits, _engine.cpu_isa())
            log.info("KV disk store: %s, up to %g GiB", self.config.kv_cache_dir, self.config.kv_cache_disk_gib)
        with fp8 as sources, sizing as sizer:  # decoded before the runtime folder's lock is taken
            size_pools = sizer if sizer is not None else CudaPoolSizer(self.config)
            session_len = self.config.session_len or self.spec.max_position_embeddings
            self._cpp = _engine.Engine(
                self.config.to_engine_config(self.device, kv_layer_bits, self.cpu_binding, n, self.spec.num_layers,
                                             self.speculative, identity),
                self.spec.to_engine_config(session_len=session_len),
                sources,
                self.spec.eos_token_ids, size_pools=size_pools,
                draft_model=draft[0].to_engine_config(session_len=session_len) if draft else None,
                draft_sources=draft[1] if draft else None,
            )
        if self._cpp.mtp_num_layers:
            n_mtp = self._cpp.mtp_num_layers
            use = "drafting (speculative='mtp')" if self.config.speculative == "mtp" else \
                "unused: speculative='mtp' drafts with it"
            log.info("MTP head: %d layer%s loaded, %.1f MiB (%s)", n_mtp, "s" * (n_mtp > 1),
                     self._cpp.mtp_weight_bytes / 2**20, use)
        return sizer

    def _draft_model(self) -> tuple[ModelSpec, dict]:
        """speculative='draft': the draft model's spec and weight sources, checked against the model's tokenizer."""
        path = resolve_model(self.config.draft_model)
        spec = load_model_spec(path)
        if spec.quant is not None and spec.quant.layout == "fp8":
            raise ValueError(f"the draft model {path} has FP8 weights, which a draft model cannot load yet: draft "
                             "with a bf16, AWQ/GPTQ int4 or GGUF model")
        mine, theirs = self.tokenizer.vocab(), Tokenizer(path).vocab()
        if mine != theirs:
            differ = sum(1 for text, i in mine.items() if theirs.get(text) != i) + len(theirs.keys() - mine.keys())
            raise ValueError(f"the draft model {path} has another tokenizer than {self.model_path} ({differ} of "
                             f"{len(mine)} tokens differ in id or are missing): speculative='draft' needs a draft "
                             "model with the same tokenizer (the same family's smaller model)")
        log.info("speculative decoding: draft model %s (%s, %d layers), up to %d draft tokens a request", path,
                 spec.architecture.name, spec.num_layers, self.config.num_speculative_tokens)
        return spec, {role: entry.as_source() for role, entry in spec.sources.items()}

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

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V, quantization parameters included)."""
        return self._cpp.kv_bytes_per_block

    @property
    def linear_weight_bytes(self) -> int:
        """Bytes of weights every decode step reads (all linear layers and the lm_head, as packed)."""
        return self._cpp.linear_weight_bytes

    @property
    def mtp_num_layers(self) -> int:
        """Decoder layers of the model's multi-token-prediction head the engine holds (0: none); loaded beside the
        model for speculative decoding, run by no step yet."""
        return self._cpp.mtp_num_layers

    @property
    def mtp_weight_bytes(self) -> int:
        """Bytes of the MTP head's tensors as stored (mapped, not packed; not in linear_weight_bytes, which counts
        what every decode step reads)."""
        return self._cpp.mtp_weight_bytes

    @property
    def generation_defaults(self) -> dict:
        """The GenerationConfig fields the model's generation_config.json sets (temperature, top_p, ...; see
        lmkit.models.read_generation_defaults): what a request that leaves a field out gets."""
        return dict(self.spec.generation_defaults)

    def default_generation_config(self, **overrides) -> GenerationConfig:
        """A GenerationConfig of the model's generation_defaults with ``overrides`` (GenerationConfig fields) on
        top; an override of None keeps the model's value, temperature=0 means greedy, and a temperature > 0
        without do_sample samples (ModelSpec.generation_config). Raises ValueError for an invalid value."""
        return self.spec.generation_config(**overrides)

    @staticmethod
    def now() -> float:
        """The engine's clock (seconds), as stamped on every output."""
        return _import_extension().now()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a string (with the tokenizer's special tokens), of chat messages (chat template),
        or token ids as given."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab_size = self.spec.vocab_size
            bad = first_id_outside(prompt, vocab_size)
            if bad is not None:
                raise ValueError(f"token id {prompt[bad]} at position {bad} is outside the vocabulary "
                                 f"[0, {vocab_size}) of this model")
            return list(prompt)
        if isinstance(prompt, list) and prompt:
            return self.tokenizer.apply_chat_template(prompt)
        raise ValueError(f"a prompt must be a non-empty string, list of chat messages or token ids, got {prompt!r}")

    @property
    def grammars(self) -> GrammarCache:
        """This model's compiled structured-output constraints (lmkit.structured)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.tokenizer.to_json(), self.spec.vocab_size, self.spec.eos_token_ids)
            return self._grammars

    def compile_grammar(self, constraint: StructuredOutput):
        """``constraint`` compiled for this model (cached); StructuredOutputError (a ValueError) naming what is
        wrong with it. Takes milliseconds to seconds on a cache miss: call it off the event loop."""
        return self.grammars.compile(constraint)

    def cached_grammar(self, constraint: StructuredOutput):
        """``constraint`` compiled when the cache holds it (its refusal raised as compile_grammar raises it), else
        None. Costs a hash of its text: what a caller checks before queueing a compile."""
        return self.grammars.cached(constraint)

    def submit(self, prompt_ids: list[int], gen_config: GenerationConfig,
               on_output: Callable[[object], None], grammar=None) -> int:
        """Queues one request; returns its id. Raises ValueError for an impossible request. ``grammar``: the
        compiled ``gen_config.structured_output`` where the caller has it (compile_grammar), else it is
        compiled here."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        gen_config.check_limits(self.spec.vocab_size, self.config.max_batch_size)
        params = gen_config.to_sampling_params()
        if isinstance(gen_config.prediction, str):
            params.prediction = self.prediction_ids(gen_config.prediction)
        if gen_config.structured_output is not None:
            params.grammar = grammar if grammar is not None else self.compile_grammar(gen_config.structured_output)
        request_id = next(self._ids)
        self._cpp.submit(request_id, list(prompt_ids), params, on_output)
        return request_id

    @property
    def pooling(self) -> PoolingConfig:
        """How this model's embeddings pool and normalize (its sentence-transformers files; lmkit.embedding).
        Raises PoolingConfigError for files that ask for what lmkit does not compute."""
        if self._pooling is None:
            self._pooling = PoolingConfig.of_model(self.model_path)
        return self._pooling

    def submit_embedding(self, prompt_ids: list[int], on_output: Callable[[object], None],
                         pooling: str | None = None) -> int:
        """Queues one prompt to be computed without generating; its one (finished) output carries ``embedding``,
        the final hidden states pooled (``pooling``: last | mean | first, default the model's) and not yet
        normalized (PoolingConfig.finish). Returns the request id. Raises ValueError for an impossible prompt."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        if not prompt_ids:
            raise ValueError("an embedding needs at least one token")
        params = _import_extension().SamplingParams()
        params.max_new_tokens = 0
        params.speculate = False
        params.pooling = pooling or self.pooling.pooling
        request_id = next(self._ids)
        self._cpp.submit(request_id, list(prompt_ids), params, on_output)
        return request_id

    def embed(self, prompts: list[Prompt], dimensions: int | None = None) -> list[np.ndarray]:
        """One embedding (float32, the model's pooling and normalization; its first ``dimensions`` values) per
        prompt: text, chat messages or token ids, computed together. Raises ValueError for an impossible prompt,
        RuntimeError when the engine fails one (the others are then cancelled)."""
        ids = [self.encode(p) for p in prompts]
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        in_engine: dict[int, int] = {}  # request id -> prompt index
        vectors: list = [None] * len(ids)
        try:
            for i, p in enumerate(ids):
                in_engine[self.submit_embedding(p, outputs.put)] = i
            while in_engine:
                out = outputs.get()
                index = in_engine.pop(out.request_id)
                if out.embedding is None:
                    raise RuntimeError(f"embedding {index} failed: {out.error or out.finish_reason}")
                vectors[index] = self.pooling.finish(out.embedding, dimensions)
        finally:
            for request_id in in_engine:
                self.cancel(request_id)
        return vectors

    def prediction_ids(self, text: str) -> list[int]:
        """A predicted output's token ids (GenerationConfig.prediction), none when the engine does not speculate;
        ValueError for text that is not valid Unicode. Callers on an event loop tokenize here beforehand, off it."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text and self.speculative else []

    def submit_to_queue(self, prompt_ids: list[int], gen_config: GenerationConfig) -> tuple[int, "queue.SimpleQueue"]:
        """submit() whose outputs land in the returned thread-safe queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        return self.submit(prompt_ids, gen_config, q.put), q

    def cancel(self, request_id: int, sample_index: int = -1) -> None:
        """Ends a request, or one of its completions (its last output says 'cancelled'); unknown ids are ignored."""
        self._cpp.cancel(request_id, sample_index)

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's counters and recent latencies."""
        return EngineMetrics.from_engine(self._cpp.metrics(), self.latency)

    def flush_kv_store(self) -> None:
        """Writes the KV pool's cached blocks not yet in the disk store (kv_cache_dir) and waits until they are on
        disk; a no-op without one. The engine does this by itself when idle and when it shuts down."""
        self._cpp.flush_kv_store()

    def check_integrity(self) -> None:
        """Raises RuntimeError if KV blocks are not conserved (free + cached + active == total, owners exact)."""
        self._cpp.check_integrity()

    def close(self) -> None:
        """Stops the engine (unfinished requests end as cancelled) and deletes its memory reservation, so
        that engines started later may use that memory. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()


class _LoopBridge:
    """Hands engine outputs from the callback thread to one asyncio loop with one wakeup per burst (the
    engine delivers a step's outputs together), not one ``call_soon_threadsafe`` per token."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopBridge]" = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # the registry's key: a strong reference would keep it forever
        self._lock = threading.Lock()
        self._pending: list[tuple["RequestStream", object]] = []
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_LoopBridge":
        with cls._registry_lock:
            bridge = cls._by_loop.get(loop)
            if bridge is None:
                bridge = cls._by_loop[loop] = cls(loop)
            return bridge

    def post(self, stream: "RequestStream", out) -> None:  # engine callback thread
        loop = self._loop()
        with self._lock:
            self._pending.append((stream, out))
            if self._scheduled and loop is not None and not loop.is_closed():
                return  # a drain is due; it takes this output too
            self._scheduled = True
        try:
            if loop is None:
                raise RuntimeError("event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will read these requests any more
            for dropped, _ in self._take():
                dropped.engine.cancel(dropped.request_id)

    def _take(self) -> list:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        return items

    def _drain(self) -> None:  # the loop's thread
        for stream, out in self._take():
            stream._queue.put_nowait(out)


class RequestStream:
    """One submitted request seen from asyncio: iterate it for Response deltas of all its completions."""

    def __init__(self, engine: Engine, prompt_ids: list[int], gen_config: GenerationConfig, index: int,
                 loop: asyncio.AbstractEventLoop, grammar=None):
        self.engine = engine
        self.gen_config = gen_config
        self._bridge = _LoopBridge.of(loop)
        self._queue: asyncio.Queue = asyncio.Queue()
        submitted_at = engine.now()
        self._states = [CompletionState(engine.tokenizer, gen_config, prompt_ids, index, k, submitted_at)
                        for k in range(gen_config.n)]
        self.request_id = engine.submit(prompt_ids, gen_config, self._on_output, grammar=grammar)

    def _on_output(self, out) -> None:  # engine callback thread
        self._bridge.post(self, out)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self._states)

    @property
    def states(self) -> list[CompletionState]:
        """Each completion's state (its text, tokens and timing so far)."""
        return self._states

    def cancel(self) -> None:
        if not self.finished:
            self.engine.cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[Response]:
        try:
            while not self.finished:
                out = await self._queue.get()
                state = self._states[out.sample_index]
                response = state.process(out)
                if state.stopped_by_string and not out.finished:
                    self.engine.cancel(self.request_id, out.sample_index)
                if state.finished:
                    self.engine.latency.record(state.timing)
                if response is not None:
                    yield response
        finally:
            self.cancel()


class AsyncEngine:
    """Streaming generation for asyncio code. One engine; any number of concurrent requests."""

    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None,
                 chat_template: str | None = None, engine: Engine | None = None):
        self.engine = engine or Engine(model, engine_config, chat_template=chat_template)
        self._streams: dict[Hashable, RequestStream] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def submit(self, prompt: Prompt, gen_config: GenerationConfig | None = None, *, index: int = 0,
               loop: asyncio.AbstractEventLoop | None = None, grammar=None) -> RequestStream:
        """Queues a request now (raising ValueError for a bad one) and returns its stream, to be iterated on
        ``loop`` (default: the running loop). Without ``gen_config``: the model's generation defaults.
        ``grammar``: gen_config.structured_output compiled (Engine.compile_grammar), else compiled here."""
        gen_config = gen_config or self.engine.default_generation_config()
        loop = loop or asyncio.get_running_loop()
        return RequestStream(self.engine, self.engine.encode(prompt), gen_config, index, loop, grammar)

    async def generate(self, prompt: Prompt, gen_config: GenerationConfig | None = None,
                       request_id: Hashable | None = None) -> AsyncIterator[Response]:
        """Streams Response deltas (incremental text and tokens; the last of each completion has
        finish_reason) for one prompt. ``request_id`` names it for abort()."""
        stream = self.submit(prompt, gen_config)
        key = request_id if request_id is not None else ("auto", stream.request_id)
        if key in self._streams:
            stream.cancel()
            raise ValueError(f"request_id {request_id!r} is already running")
        self._streams[key] = stream
        try:
            async for response in stream:
                yield response
        finally:
            self._streams.pop(key, None)

    async def embed(self, prompt_ids: list[list[int]], dimensions: int | None = None,
                    max_in_flight: int | None = None) -> list[np.ndarray]:
        """Engine.embed of token ids for asyncio: the prompts are computed together, at most ``max_in_flight`` in
        the engine at once (default: all; the next goes in as one finishes); cancelling the caller cancels those
        in the engine. Raises ValueError for an impossible prompt, RuntimeError for a failure."""
        engine, loop = self.engine, asyncio.get_running_loop()
        window = max(1, max_in_flight or len(prompt_ids))
        finished: asyncio.Queue = asyncio.Queue()
        in_engine: dict[int, int] = {}  # request id -> prompt index
        vectors: list = [None] * len(prompt_ids)
        following = 0
        try:
            while following < len(prompt_ids) or in_engine:
                while following < len(prompt_ids) and len(in_engine) < window:
                    request_id = engine.submit_embedding(
                        prompt_ids[following], lambda out: loop.call_soon_threadsafe(finished.put_nowait, out))
                    in_engine[request_id] = following
                    following += 1
                out = await finished.get()
                index = in_engine.pop(out.request_id)
                if out.embedding is None:
                    raise RuntimeError(f"the engine failed embedding {index}: {out.error or out.finish_reason}")
                vectors[index] = engine.pooling.finish(out.embedding, dimensions)
        finally:
            for request_id in in_engine:
                engine.cancel(request_id)
        return vectors

    async def abort(self, request_id: Hashable) -> None:
        """Cancels a running generate() by its request_id; unknown ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    def close(self) -> None:
        self.engine.close()
