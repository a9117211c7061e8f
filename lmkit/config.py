"""EngineConfig: how the engine runs a model. Typed, validated once, then read-only."""

from __future__ import annotations

import os
import typing
import warnings
from dataclasses import dataclass
from typing import Literal

from lmkit.cpus import CpuBinding, parse_cpu_list, usable_cpu_count


SUFFIX_STORE_TOKENS = 1 << 16
"""speculative='suffix': tokens of recently finished answers kept for draft lookup (the oldest dropped first)."""

AUTO_MEMORY_FRACTION = 0.8
"""The share of memory lmkit engines may take together when cache_max_entry_count is None (auto)."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Measured values (such as the number of KV blocks) are engine state, not config."""

    device: Literal["cpu", "cuda", "auto"] = "auto"
    """Where to run: cpu, cuda, or auto (the GPU where usable, else the CPU, logging why). auto falls back to the CPU
    without a CUDA build or GPU, for dtype other than auto or speculative ngram / suffix / mtp, and for a model the CUDA
    backend refuses at load or that does not fit (csrc/kernels/cuda/README.md)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype. auto: on the CPU bfloat16 where the CPU has AVX512_BF16 (below), else float32 with the KV
    cache at quant_policy 0 in bfloat16 (half the bytes attention reads and twice the tokens, as llama.cpp's fp16
    cache; a bf16 value widens to float32 by a shift on any CPU); the choice is logged at start; the CUDA backend
    computes in float16 (bfloat16 when the checkpoint is bf16). float32: the CPU backend computes in float32
    whatever the stored weight dtype, K/V included (the exact path). bfloat16 (CPUs with
    AVX512_BF16: Intel Cooper Lake / Sapphire Rapids, AMD Zen 4 and later): dense linear layers round weights
    (once, at load) and activations to bfloat16 and sum products in float32 (vdpbf16ps), up to twice the
    speed of compute-bound steps (prefill, large batches), on AMX tiles where the CPU has AMX-BF16 (Sapphire
    Rapids and later: several times that); the KV cache at quant_policy 0 is bfloat16 too (half the bytes
    of float32, so twice the tokens; float32 for an odd cache_block_seq_len or head_dim, or head_dim > 256);
    norms, attention arithmetic and sampling stay float32. Logits then
    differ from float32 by ~1e-2 relative, as in any bf16 engine (SmolLM2's perplexity by less than 0.2%:
    benchmark/results/cpu-speed.md)."""
    max_batch_size: int = 64
    """Requests running at once at most; more wait in FCFS order."""
    session_len: int | None = None
    """Tokens per request at most (prompt + output). Default: the model's max_position_embeddings."""
    cache_block_seq_len: int = 64
    """Tokens per KV cache block."""
    cache_max_entry_count: float | None = None
    """KV pool size. None (auto): the blocks max_batch_size sequences of session_len tokens can use, at most half
    of the memory the lmkit engines of this host may still take (CPU: 0.8 of the total, or of the cgroup's limit
    when lower, less this engine's weights and what the other live engines hold), so that another engine can
    start beside it; on CUDA 0.8 of the GPU memory free after the weights. A number > 1: that many blocks. A
    fraction (0, 1]: CPU: that fraction of the total less the weights and the other engines' share, all of it;
    CUDA: of the free GPU memory. An engine that cannot get one sequence's blocks fails at start, naming the
    numbers; the size chosen, and why, is logged at start (logger "lmkit")."""
    max_prefill_token_num: int = 8192
    """Prompt tokens processed per step at most; longer prompts are split into chunks."""
    decode_slowdown: float = 1.75
    """Prompt pacing: while requests decode, a step's prompt tokens are sized from measured step times so that
    decodes keep at least 1 / decode_slowdown of their speed beside a long prompt (1.75: 57%); a request's first
    chunk, and a prompt whose rest is at most 0.25 s of work, go at once; with nothing decoding a step takes about
    0.1 s of prompt tokens (at least 128), so a request arriving during a long prompt waits one short step, and a
    short prompt goes before a long one. Always within max_prefill_token_num. 0: no pacing (each step takes up to
    max_prefill_token_num prompt tokens, first come first served)."""
    quant_policy: Literal[0, 4, 8] = 0
    """KV cache precision of every layer: 0 full precision (on the CPU bfloat16, or float32 with dtype float32; on
    CUDA the activation dtype), 8 int8, 4 int4."""
    kv_policy: str | None = None
    """Per-layer KV precision file (kv_policy.json from `lmkit lite calibrate`); overrides quant_policy."""
    int8_activations: bool = True
    """Quantized checkpoints (int4: AWQ, GPTQ, compressed-tensors, GGUF Q4_0/Q4_1/Q4_K; int8: GGUF Q5_0/Q8_0/Q5_K/Q6_K):
    quantize activations to int8 and use integer dot products, in decode (per 32 values; AVX2 / AVX-512 VNNI,
    llama.cpp's approach) and prefill (int4 groups of 64/128: x per weight group on AVX-512 VNNI and on AMX-INT8
    tiles; otherwise the decode kernels).
    False: fp32 activations, the exact product of the stored weights (2-5x slower prefill)."""
    quantization: Literal["none", "int8"] = "none"
    """Round a float checkpoint's projections to int8 per 32 inputs as it loads (CPU backend). "int8": every
    attention, MLP, expert and Gated DeltaNet projection (llama.cpp's Q8_0 numerics: an fp16 scale max|w| / 127,
    round half to even), and the lm_head too where int8_activations runs: ~half the bytes of bf16 and the int8
    kernels' prefill, for a KL from the float model about Q8_0's (SmolLM2: mean 0.004 on Hamlet). Routers, gates,
    the embedding and per-layer projections stay as stored. "none": the weights as stored. A checkpoint with a
    quantization_config (int4, int8, FP8, FP4, gpt-oss's MXFP4) is refused; GGUF files: their F16/BF16/F32
    tensors only."""
    awq_int8_activations: bool | None = None
    """Deprecated name of int8_activations (which governs every int4 and int8 layer, not AWQ's only); when set, it
    wins, with a DeprecationWarning."""
    enable_prefix_caching: bool = False
    """Reuse the KV blocks of identical prompt prefixes."""
    kv_cache_dir: str | None = None
    """A local directory keeping prefix blocks evicted from the KV pool (CPU backend, with enable_prefix_caching).
    A prompt whose prefix left the pool reads its blocks back instead of recomputing them, also after a restart.
    Several lmkit processes of a host may share it; files of another model, tokenizer, dtype or KV policy are never
    read. Models with recurrent layers are not supported. None: no disk store (docs/configuration.md, "Disk
    store")."""
    kv_cache_disk_gib: float = 16.0
    """Size cap of kv_cache_dir in GiB (all models' files together): beyond it the least recently used files are
    removed."""
    kv_cache_read_mib_per_step: float = 64.0
    """KV read back from kv_cache_dir per step at most while other requests run (MiB): a long prefix on disk is read
    over several steps, theirs going on in between, instead of holding them up for the whole read (a 16k-token
    prefix took 1-2.6 s on 2 cores). Alone, a request reads all of it at once. 0: no cap."""
    num_threads: int | None = None
    """CPU threads for the kernels. Default: the CPUs this process may use: its affinity mask, capped by its
    cgroup's CPU quota rounded up (a container's --cpus, a pod's cpu limit; lmkit/cpus.py), and by the CPUs
    of an explicit cpu_binding."""
    cpu_binding: str = "auto"
    """Which CPUs the engine's threads run on. auto: where the affinity mask has more CPUs than num_threads,
    the engine thread and its kernel team on num_threads CPUs (one per core, from the end of the mask) and the
    process's other threads (its callback thread; in the api_server the event loop and tokenizer threads too)
    on the rest, so that Python work never takes a core from a step; otherwise no pinning. off: no pinning. A
    CPU list such as '4-7': the engine's threads on those CPUs (within the affinity mask), the rest for the
    others. The choice is logged at start (logger "lmkit")."""
    cuda_graphs: bool = True
    """CUDA backend: replay decode steps (every row one token, up to 256 rows) as CUDA graphs, one launch
    instead of hundreds. False: launch every kernel, every step."""
    speculative: Literal["auto", "ngram", "suffix", "mtp", "draft", "off"] = "auto"
    """Speculative decoding: drafts verified in one step. ngram: drafts from the request's prediction and its own
    prompt and output (the last tokens looked up where they occurred before); suffix: also from recently finished
    answers (what a request is proposed then depends on what ran before it); mtp: one draft a step from the model's
    multi-token-prediction head (Qwen3.5/3.6, Qwen3-Next ship one; its layer's K/V take one more layer of the KV
    pool), and the request's prediction where it gives one; draft: drafts decoded greedily by draft_model, a smaller
    model with the same tokenizer (and the request's prediction where it gives one); off, and auto for now: one token a
    step (auto turns ngram on once its speed-ups hold in every run: docs/configuration.md). Greedy and seeded
    output is the same token for token as without it, sampled output keeps its
    distribution; each proposer's drafts follow its acceptance and what a step's rows cost. Hybrids (Qwen3.5,
    Qwen3-Next) roll their recurrent state back to per-draft checkpoints, and a grammar's drafts are sampled
    under its mask after the drafts before them (docs/configuration.md, "Speculative decoding")."""
    draft_model: str | os.PathLike | None = None
    """speculative='draft': the draft model (a folder, a .gguf file, a hub id or a bundled name as for the model; an
    attention-only model whose tokenizer is the model's), run by the same engine with a KV pool of its own (as many
    blocks as the model's, counted in the memory budget). Given with speculative='auto', it means 'draft'."""
    num_speculative_tokens: int = 8
    """Draft tokens one request carries into a step at most (speculative decoding)."""
    speculative_adaptive: bool = True
    """Verify a draft only while it pays: the engine times steps of 1 to 64 rows at start-up and takes a draft
    while it raises a step's expected tokens per second, given each proposer's acceptance (so drafts fade out
    where rows cost as much as steps: many streams, few cores). False: every proposal is verified, up to
    num_speculative_tokens (to measure a fixed draft length)."""

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        if self.awq_int8_activations is not None:
            warnings.warn("EngineConfig(awq_int8_activations=...) is deprecated: use int8_activations",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "int8_activations", bool(self.awq_int8_activations))
            object.__setattr__(self, "awq_int8_activations", None)
        check(self.device in ("cpu", "cuda", "auto"), f"device must be cpu, cuda or auto, got {self.device!r}")
        check(self.dtype in ("auto", "float32", "bfloat16"),
              f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        check(not (self.device == "cuda" and self.dtype != "auto"),
              f"dtype={self.dtype!r} is the CPU backend's; the CUDA backend computes in float16 (bfloat16 for "
              "bf16 checkpoints): use dtype='auto' with device='cuda'")
        check(isinstance(self.max_batch_size, int) and self.max_batch_size >= 1,
              f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        check(self.session_len is None or (isinstance(self.session_len, int) and self.session_len > 1),
              f"session_len must be an integer > 1, got {self.session_len!r}")
        check(isinstance(self.cache_block_seq_len, int) and self.cache_block_seq_len >= 1,
              f"cache_block_seq_len must be an integer >= 1, got {self.cache_block_seq_len!r}")
        check(self.cache_max_entry_count is None or self.cache_max_entry_count > 0,
              f"cache_max_entry_count must be > 0 (a fraction of memory, or a block count > 1), "
              f"got {self.cache_max_entry_count!r}")
        check(isinstance(self.max_prefill_token_num, int) and self.max_prefill_token_num >= 1,
              f"max_prefill_token_num must be an integer >= 1, got {self.max_prefill_token_num!r}")
        check(isinstance(self.decode_slowdown, (int, float)) and not isinstance(self.decode_slowdown, bool)
              and (self.decode_slowdown == 0 or 1 < self.decode_slowdown < float("inf")),
              f"decode_slowdown must be 0 (no pacing) or a number > 1, got {self.decode_slowdown!r}")
        check(self.quant_policy in (0, 4, 8), f"quant_policy must be 0, 4 or 8, got {self.quant_policy!r}")
        check(self.quantization in ("none", "int8"), f"quantization must be none or int8, got {self.quantization!r}")
        check(not (self.device == "cuda" and self.quantization != "none"),
              f"quantization={self.quantization!r} runs on the CPU backend; on the GPU use a quantized checkpoint "
              "(lmkit lite awq) or leave quantization='none'")
        check(self.kv_policy is None or isinstance(self.kv_policy, (str, os.PathLike)),
              f"kv_policy must be a path to a kv_policy.json file, got {self.kv_policy!r}")
        check(self.speculative in ("auto", "ngram", "suffix", "mtp", "draft", "off"),
              f"speculative must be auto, ngram, suffix, mtp, draft or off, got {self.speculative!r}")
        check(self.draft_model is None or (isinstance(self.draft_model, (str, os.PathLike))
                                           and str(self.draft_model) != ""),
              f"draft_model must be a model (a path, a hub id or a bundled name), got {self.draft_model!r}")
        if self.draft_model is not None and self.speculative == "auto":
            object.__setattr__(self, "speculative", "draft")
        check(self.speculative != "draft" or self.draft_model is not None,
              "speculative='draft' needs draft_model: a smaller model with the same tokenizer (e.g. "
              "draft_model='Qwen/Qwen3-0.6B' for a Qwen3 model)")
        check(self.draft_model is None or self.speculative == "draft",
              f"draft_model is given but speculative={self.speculative!r}: use speculative='draft' (or leave it "
              "auto) to draft with it, or leave draft_model out")
        check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 64,
              f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")
        check(not (self.device == "cuda" and self.speculative in ("ngram", "suffix", "mtp", "draft")),
              f"speculative={self.speculative!r} runs on the CPU backend; the CUDA backend does not verify draft "
              "tokens yet: use speculative='auto' or 'off' with device='cuda'")
        check(self.kv_cache_dir is None or (isinstance(self.kv_cache_dir, (str, os.PathLike))
                                            and str(self.kv_cache_dir) != ""),
              f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
        check(isinstance(self.kv_cache_disk_gib, (int, float)) and not isinstance(self.kv_cache_disk_gib, bool)
              and 0 < self.kv_cache_disk_gib < float("inf"),
              f"kv_cache_disk_gib must be a number > 0, got {self.kv_cache_disk_gib!r}")
        check(isinstance(self.kv_cache_read_mib_per_step, (int, float))
              and not isinstance(self.kv_cache_read_mib_per_step, bool)
              and 0 <= self.kv_cache_read_mib_per_step < float("inf"),
              f"kv_cache_read_mib_per_step must be a number >= 0, got {self.kv_cache_read_mib_per_step!r}")
        check(self.kv_cache_dir is None or self.enable_prefix_caching,
              "kv_cache_dir keeps evicted prefix-cache blocks: it needs enable_prefix_caching=True")
        check(not (self.kv_cache_dir is not None and self.device == "cuda"),
              "kv_cache_dir (the disk store) runs on the CPU backend; the CUDA backend has no host tier yet: leave "
              "kv_cache_dir unset with device='cuda'")
        check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
              f"num_threads must be an integer >= 1, got {self.num_threads!r}")
        try:
            self.binding_cpus
        except ValueError as e:
            raise ValueError(f"cpu_binding must be auto, off or a CPU list such as '4-7': {e}") from None

    @property
    def binding_cpus(self) -> list[int] | None:
        """The CPUs of an explicit cpu_binding list (None for auto and off)."""
        return None if self.cpu_binding in ("auto", "off") else parse_cpu_list(self.cpu_binding)

    @property
    def resolved_num_threads(self) -> int:
        """num_threads, or the CPUs this process may use (affinity mask, cgroup CPU quota: lmkit/cpus.py)."""
        if self.num_threads:
            return self.num_threads
        listed = self.binding_cpus
        return usable_cpu_count() if listed is None else min(usable_cpu_count(), len(listed))

    def resolved_dtype(self, device: str) -> str:
        """The compute dtype on a resolved device: dtype, with auto on the CPU bfloat16 where the CPU has
        AVX512_BF16 and float32 elsewhere; auto stays auto on CUDA (the backend picks)."""
        if self.dtype != "auto" or device != "cpu":
            return self.dtype
        from lmkit._ext import _engine

        return "bfloat16" if _engine.cpu_bf16_available() else "float32"

    def resolved_kv_bf16(self, device: str) -> bool:
        """Whether the CPU backend keeps a full-precision KV cache in bfloat16 (where its layout allows): with
        bfloat16 compute, and with dtype auto where the CPU computes in float32; dtype float32 keeps it float32."""
        return device == "cpu" and (self.dtype == "auto" or self.resolved_dtype(device) == "bfloat16")

    def speculates(self, device: str) -> bool:
        """Whether the engine verifies draft tokens on a resolved device (auto: not yet); raises ValueError for an
        explicit ngram / suffix it cannot run."""
        if self.speculative in ("off", "auto"):  # auto: off until its figures hold run after run
            return False
        if device != "cpu":
            raise ValueError(f"speculative={self.speculative!r} needs the CPU backend: use speculative='off'")
        return True

    def to_engine_config(self, device: str, kv_layer_bits: list[int] | None = None,
                         binding: CpuBinding | None = None, num_threads: int | None = None, num_layers: int = 0,
                         speculative: bool = False, kv_cache_identity: str = ""):
        """The lmkit._engine.EngineConfig for this config on a resolved device (kv_layer_bits: the
        checked per-layer policy, see lmkit.kv_policy; binding: where the CPU engine's threads run; num_threads:
        resolved_num_threads when the caller has it already; num_layers: the model's, for a uniform
        quant_policy; kv_cache_identity: what the disk store's blocks mean, lmkit.kv_store.store_identity). The KV
        precision's user spellings (quant_policy, kv_policy.json's bits, both 0 / 8 / 4) become the engine's one
        encoding, a KVQuant per layer, here and nowhere else."""
        from lmkit._ext import _engine

        c = _engine.EngineConfig()
        c.device = device
        c.max_batch_size = self.max_batch_size
        c.session_len = self.session_len or 0
        c.block_size_tokens = self.cache_block_seq_len
        c.max_prefill_token_num = self.max_prefill_token_num
        c.decode_slowdown = float(self.decode_slowdown)
        if not kv_layer_bits and self.quant_policy:
            assert num_layers > 0, "quant_policy 8 / 4 needs the model's num_layers"
            kv_layer_bits = [self.quant_policy] * num_layers
        c.kv_quant = [_engine.KVQuant(int(bits)) for bits in kv_layer_bits or ()]
        c.enable_prefix_caching = self.enable_prefix_caching
        c.int8_activations = bool(self.int8_activations)
        c.bf16_linear = self.resolved_dtype(device) == "bfloat16"
        c.bf16_kv = self.resolved_kv_bf16(device)
        c.int8_weights = self.quantization == "int8"
        c.cuda_graphs = bool(self.cuda_graphs)
        c.num_threads = num_threads or self.resolved_num_threads
        c.speculative.enabled = speculative
        c.speculative.max_draft_tokens = self.num_speculative_tokens
        c.speculative.adaptive = bool(self.speculative_adaptive)
        c.speculative.answer_store_tokens = SUFFIX_STORE_TOKENS if self.speculative == "suffix" else 0
        c.speculative.mtp = self.speculative == "mtp"
        c.speculative.draft_model = speculative and self.speculative == "draft"
        if self.kv_cache_dir is not None:
            c.kv_cache_dir = os.path.abspath(os.fspath(self.kv_cache_dir))
            c.kv_cache_disk_bytes = int(self.kv_cache_disk_gib * 2**30)
            c.kv_cache_read_bytes_per_step = int(self.kv_cache_read_mib_per_step * 2**20)
            c.kv_cache_identity = kv_cache_identity
        if binding is not None and binding.pinned:
            c.engine_cpus = list(binding.engine_cpus)
            c.callback_cpus = list(binding.other_cpus)
        return c

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name -> its docstring (the contract; field_help() gives the --help form)."""
        return field_docs(cls)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Field name -> its --help text (see field_help())."""
        return field_help(cls)


def field_help(cls: type) -> dict[str, str]:
    """Field name -> the --help text of a dataclass field: help_text() of its docstring, naming the choices of a
    Literal field when that text does not name them all."""
    hints = typing.get_type_hints(cls)
    texts = {}
    for name, doc in field_docs(cls).items():
        text = help_text(doc)
        choices = [str(c) for c in typing.get_args(hints[name])] if typing.get_origin(hints[name]) is Literal else []
        if choices and not all(c in text for c in choices):
            text = f"{text.rstrip('.')} ({' | '.join(choices)})."
        texts[name] = text
    return texts


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under the field, for a dataclass defined at a module's top level."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


_ABBREVIATIONS = frozenset({"e.g.", "i.e.", "etc.", "vs.", "cf."})


def help_text(doc: str, max_chars: int = 160) -> str:
    """The --help form of a field's docstring: its first sentence, then the next ones while the text stays within
    ``max_chars``, whitespace collapsed. The docstring stays the contract; --help gives its gist in a few lines.

    A sentence ends at a word ending in . ! or ? outside parentheses (not an abbreviation such as "e.g.").
    """
    sentences, current, depth = [], [], 0
    for word in doc.split():
        current.append(word)
        depth = max(0, depth + word.count("(") - word.count(")"))
        if depth == 0 and word[-1] in ".!?" and word.lstrip("(").lower() not in _ABBREVIATIONS:
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    text = sentences[0] if sentences else ""
    for sentence in sentences[1:]:
        if len(text) + 1 + len(sentence) > max_chars:
            break
        text += " " + sentence
    return text

