"""Every tiny model and checkpoint the tests build, in one place: random HF models of each architecture saved
with a small byte-level tokenizer (or a chat family's tokens and template), the quantized checkpoint writers, and
a ShareGPT file. A model builder called twice with the same arguments in one session builds once: the first call
writes into a cache folder keyed by a hash of the arguments, every call copies that folder to its destination and
reads the HF reference back from the copy, and leaves torch's global RNG as the build left it (so that a test
drawing random numbers after a build sees the same ones on a cache hit)."""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tests.helpers import all_recurrent

TINY_VOCAB = 300  # 256 byte tokens + specials + spare rows
TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"


# ---- the per-config cache

_cache_root: Path | None = None
_built: dict[str, tuple[Path, object]] = {}  # key -> (cache folder, torch RNG state right after the build)


class _Uncacheable(TypeError):
    pass


def _plain(value):
    """``value`` as JSON-able data for a cache key; a lambda or local function cannot be named: not cached."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__qualname__, **fields}
    if callable(value) and "<" not in getattr(value, "__qualname__", "<"):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (tuple, set, frozenset)):
        return list(value) if isinstance(value, tuple) else sorted(value)
    raise _Uncacheable(repr(value))


def _cache_key(*parts) -> str | None:
    try:
        text = json.dumps(parts, sort_keys=True, default=_plain)
    except _Uncacheable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _build_cached(key: str | None, folder: Path, build: Callable[[Path], None]) -> None:
    """Makes ``folder`` hold what ``build(folder)`` writes, built once per ``key`` in this session (None: not
    cached, built in place). Afterwards torch's global RNG is in the state the build left it in."""
    if key is None:
        build(folder)
        return
    global _cache_root
    if _cache_root is None:
        _cache_root = Path(tempfile.mkdtemp(prefix="lmkit-test-models-"))
        atexit.register(shutil.rmtree, _cache_root, True)
    if key not in _built:
        cached = _cache_root / key
        try:
            build(cached)
        except BaseException:
            shutil.rmtree(cached, ignore_errors=True)
            raise
        _built[key] = (cached, torch.get_rng_state())
    cached, rng_state = _built[key]
    shutil.copytree(cached, folder, dirs_exist_ok=True)
    torch.set_rng_state(rng_state)


# ---- the byte tokenizer and the plain tiny models (Llama, Mistral, Qwen2)

def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: every UTF-8 byte is a token; ids 256.. are specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token=None)
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(folder))


def make_tiny_model(folder: Path, arch: str = "llama", *, dtype: str = "float32", seed: int = 0,
                    max_shard_size: str | None = None, **overrides):
    """Builds a random tiny model of ``arch`` (llama | mistral | qwen2), saves it with the byte tokenizer
    into ``folder`` and returns the fp32 HF model (eval mode) that reads the saved weights."""
    import transformers

    cls = _TINY_CLASSES[arch]
    key = _cache_key("make_tiny_model", arch, dtype, seed, max_shard_size, overrides)
    _build_cached(key, folder, lambda out: _write_tiny_model(out, arch, dtype, seed, max_shard_size, overrides))
    # The reference reads back exactly what the engine reads, upcast to fp32.
    ref = getattr(transformers, cls[1]).from_pretrained(str(folder), dtype=torch.float32).eval()
    return ref


_TINY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def _write_tiny_model(folder: Path, arch: str, dtype: str, seed: int, max_shard_size: str | None,
                      overrides: dict) -> None:
    import transformers

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    base.update(overrides)
    cls = _TINY_CLASSES[arch]
    config = getattr(transformers, cls[0])(**base)
    torch.manual_seed(seed)
    model = getattr(transformers, cls[1])(config).eval()
    with torch.no_grad():  # larger than default init so that logits are not flat
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(torch_dtype).save_pretrained(str(folder), **kwargs)
    write_byte_tokenizer(folder)


# make_tiny_model's arguments (besides the folder) per checkpoint variant the loader accepts (test_logits, the CUDA engine)
TINY_CASES = {
    "llama": dict(arch="llama"),
    "llama-tied-bf16": dict(arch="llama", dtype="bfloat16", tie_word_embeddings=True),
    "llama-fp16-sharded-mha": dict(arch="llama", dtype="float16", num_key_value_heads=4, max_shard_size="100KB"),
    "llama3-rope-scaling": dict(arch="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-linear-rope-head-dim": dict(arch="llama", head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=24, num_key_value_heads=1),
    "qwen2-bias": dict(arch="qwen2", num_key_value_heads=1, rope_theta=1000000.0),
    "qwen2-fp16-tied": dict(arch="qwen2", dtype="float16", tie_word_embeddings=True),
}


# ---- one tiny model per architecture variant (issue 22) and mixture of experts (issue 23): build_case

TOKEN_IDS = dict(bos_token_id=256, eos_token_id=257, pad_token_id=None)  # the byte tokenizer's specials


def _gemma3_hub_layout(cfg: dict) -> dict:
    """Gemma 3 as its hub config.json has it (transformers 4.5x): rope_theta + rope_local_base_freq +
    rope_scaling (linear 8 on the global layers, as Gemma-3-4B) and sliding_window_pattern, no layer_types."""
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    return {**cfg, "rope_theta": rope["full_attention"]["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6}


def _phi4_mini_hub_layout(cfg: dict) -> dict:
    """Phi-4-mini as its hub config.json has it: top-level rope_theta and partial_rotary_factor, rope_scaling
    {type: longrope, short_factor, long_factor}, original_max_position_embeddings beside it, and a
    sliding_window far beyond any sequence (262144)."""
    rope = cfg.pop("rope_parameters")
    return {**cfg, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
            "rope_scaling": {"type": "longrope", "short_factor": rope["short_factor"],
                             "long_factor": rope["long_factor"]}, "sliding_window": 262144}


@dataclass(frozen=True)
class Case:
    """One tiny model: a transformers config class and its arguments (TOKEN_IDS and max_position_embeddings
    512 unless given)."""

    config_class: str
    kwargs: dict
    seed: int
    new: bool = True  # needs the engine of issue 22
    norm_offset: float = 0.0  # Gemma's RMSNorms scale by (1 + w): w is drawn around 0, not 1
    plain_norms: tuple = ()  # names of the norms that scale by w where the others take (1 + w) (drawn around 1)
    unit_scores: bool = False  # softmax scale 1 (Gemma 4): q/k norm weights around head_dim**-0.25, so that q . k
    #                            has unit variance as 1/sqrt(head_dim)-scaled models' scores do
    attn_implementation: str | None = None  # "eager" for Gemma 2 (SDPA has no soft-capping)
    hub_layout: Callable[[dict], dict] | None = None  # rewrites config.json after save_pretrained
    expect: dict = field(default_factory=dict)  # attribute -> value HF's config must have after reading the folder


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4)
QWEN3_5 = dict(SMALL, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
QWEN3_5_MOE = {**{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}, "num_experts": 6,
               "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 56}

GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}

ARCH_CASES: dict[str, Case] = {
    # ---- what the engine runs before issue 22 (must keep passing)
    "llama31_rope": Case("LlamaConfig", dict(SMALL, num_hidden_layers=2, num_key_value_heads=2,
                                             rope_parameters=LLAMA3_ROPE), seed=21, new=False),
    "llama32_tied": Case("LlamaConfig", dict(SMALL, num_hidden_layers=3, num_key_value_heads=1,
                                             tie_word_embeddings=True,
                                             rope_parameters={**LLAMA3_ROPE, "factor": 32.0}), seed=2, new=False),
    "mistral_window": Case("MistralConfig", dict(vocab_size=301, hidden_size=48, intermediate_size=99,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                 sliding_window=13), seed=3, new=False),
    "mistral_nemo_headdim": Case("MistralConfig", dict(SMALL, num_hidden_layers=2, num_key_value_heads=2,
                                                       head_dim=24, sliding_window=None,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                                 seed=4, new=False),
    "qwen2": Case("Qwen2Config", dict(vocab_size=384, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}), seed=5, new=False),
    # ---- issue 22
    "qwen2_window": Case("Qwen2Config", dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                                             sliding_window=20, max_window_layers=1), seed=6,
                         expect={"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
    "qwen3": Case("Qwen3Config", dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=24,
                                      tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}), seed=7),
    "qwen3_mha_untied": Case("Qwen3Config", dict(vocab_size=317, hidden_size=80, intermediate_size=130,
                                                 num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5,
                                                 head_dim=16, tie_word_embeddings=False), seed=20),
    "gemma2": Case("Gemma2Config", dict(SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                        query_pre_attn_scalar=24, sliding_window=20, attn_logit_softcapping=4.0,
                                        final_logit_softcapping=5.0), seed=9, norm_offset=1.0,
                   attn_implementation="eager",
                   expect={"layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma2_untied_defaults": Case("Gemma2Config", dict(vocab_size=301, hidden_size=48, intermediate_size=100,
                                                        num_hidden_layers=3, num_attention_heads=2,
                                                        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                                                        sliding_window=13, tie_word_embeddings=False), seed=22,
                                   norm_offset=1.0, attn_implementation="eager",
                                   expect={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": Case("Gemma3TextConfig", dict(SMALL, num_hidden_layers=6, num_key_value_heads=1, head_dim=16,
                                            query_pre_attn_scalar=24, sliding_window=20,
                                            layer_types=["sliding_attention"] * 5 + ["full_attention"]),
                   seed=11, norm_offset=1.0),
    "gemma3_hub_config": Case("Gemma3TextConfig", dict(vocab_size=300, hidden_size=96, intermediate_size=160,
                                                       num_hidden_layers=7, num_attention_heads=3,
                                                       num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                                                       sliding_window=13),
                              seed=12, norm_offset=1.0, hub_layout=_gemma3_hub_layout,
                              expect={"layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                                      "rope_parameters": {
                                          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    "phi3": Case("Phi3Config", dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, sliding_window=20), seed=20),
    "phi3_longrope_partial": Case(
        "Phi3Config", dict(vocab_size=320, hidden_size=96, intermediate_size=150, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                           # original context >= session_len: the short factors, as HF uses below it
                           # (LongRoPE's long factors are checked against torch in tests/lite/test_archs.py)
                           max_position_embeddings=4096, original_max_position_embeddings=512,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                            "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
                                            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}),
        seed=21, hub_layout=_phi4_mini_hub_layout,
        expect={"sliding_window": 262144, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512, "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    "smollm3": Case("SmolLM3Config", dict(SMALL, num_hidden_layers=4, num_key_value_heads=1), seed=15,
                    expect={"no_rope_layers": [1, 1, 1, 0]}),
    "smollm3_explicit_nope_untied": Case("SmolLM3Config", dict(vocab_size=300, hidden_size=48, intermediate_size=80,
                                                               num_hidden_layers=5, num_attention_heads=4,
                                                               num_key_value_heads=2, tie_word_embeddings=False,
                                                               no_rope_layers=[0, 1, 1, 0, 1]), seed=16),
    # ---- mixture of experts (issue 23): some experts idle in a step, several rows sharing one
    "qwen3_moe": Case("Qwen3MoeConfig", dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                             norm_topk_prob=True, mlp_only_layers=[1]), seed=40,
                      expect={"mlp_only_layers": [1]}),
    "qwen3_moe_top1_sparse_step": Case("Qwen3MoeConfig", dict(vocab_size=300, hidden_size=48, intermediate_size=72,
                                                              num_hidden_layers=4, num_attention_heads=4,
                                                              num_key_value_heads=4, num_experts=4,
                                                              num_experts_per_tok=1, moe_intermediate_size=24,
                                                              decoder_sparse_step=2, tie_word_embeddings=True),
                                       seed=32),
    "mixtral_window": Case("MixtralConfig", dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=20), seed=40),
    "olmoe": Case("OlmoeConfig", dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, num_experts=8,
                                      num_experts_per_tok=3), seed=40),
    # ---- hybrids of recurrent (Gated DeltaNet) and attention layers (issue 62): the default 3:1 pattern, then
    # every layer of one kind; key heads shared by two value heads, k and v head dims apart
    "qwen3_5": Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=4), seed=50, norm_offset=1.0,
                    plain_norms=("linear_attn.norm",),
                    expect={"layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "qwen3_5_all_linear": Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=2,
                                                         layer_types=["linear_attention"] * 2),
                               seed=53, norm_offset=1.0, plain_norms=("linear_attn.norm",)),
    "qwen3_5_all_full_tied": Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=2, tie_word_embeddings=True,
                                                            layer_types=["full_attention"] * 2),
                                  seed=52, norm_offset=1.0, plain_norms=("linear_attn.norm",)),
    # every MLP a mixture of experts with a gated shared expert (no intermediate_size); Qwen3-Next: its fused,
    # key-head-grouped input projections, a dense layer (mlp_only_layers) and top-k without renormalizing
    "qwen3_5_moe": Case("Qwen3_5MoeTextConfig", dict(QWEN3_5_MOE, num_hidden_layers=4), seed=56, norm_offset=1.0,
                        plain_norms=("linear_attn.norm",), expect={"shared_expert_intermediate_size": 56}),
    "qwen3_next": Case("Qwen3NextConfig", dict(QWEN3_5_MOE, num_hidden_layers=4, intermediate_size=88,
                                               mlp_only_layers=[1], norm_topk_prob=False), seed=59, norm_offset=1.0,
                       plain_norms=("linear_attn.norm",), expect={"mlp_only_layers": [1], "norm_topk_prob": False}),
    # gpt-oss (issue 62): attention sinks, q/k/v/o biases, alternating windows, yarn RoPE; every MLP 4 biased experts
    # (top 2) with the clamped SwiGLU, its limit low enough that the clamps cut
    "gpt_oss": Case("GptOssConfig", dict(SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=20,
                                         swiglu_limit=1.5, rope_parameters=GPT_OSS_ROPE),
                    seed=60, attn_implementation="eager",
                    expect={"layer_types": ["sliding_attention", "full_attention"] * 2}),
    # Gemma 4 (issue 62): global layers of the real models' head_dim 512 beside narrow sliding ones, proportional RoPE
    # (a quarter of the global layers' angles rotate), plain-w norms, a weightless value norm, a stored scalar per layer, the final soft-cap; then
    # its attention_k_eq_v form (the global layers' values are their keys, one KV head) alternating, untied
    "gemma4": Case("Gemma4TextConfig", dict(SMALL, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                                            global_head_dim=512, hidden_size_per_layer_input=0, sliding_window=20,
                                            final_logit_softcapping=8.0), seed=70, unit_scores=True,
                   expect={"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "gemma4_k_eq_v": Case("Gemma4TextConfig", dict(SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                                   global_head_dim=32, num_global_key_value_heads=1,
                                                   attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                                   sliding_window=20, tie_word_embeddings=False,
                                                   layer_types=["sliding_attention", "full_attention"] * 2),
                          seed=77, unit_scores=True),
    # the 26B-A4B's form: every layer's dense MLP beside 4 routed experts (top 2), the router on its own scaled norm
    "gemma4_moe": Case("Gemma4TextConfig", dict(SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                                global_head_dim=32, hidden_size_per_layer_input=0, sliding_window=20,
                                                enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                moe_intermediate_size=24, final_logit_softcapping=8.0,
                                                layer_types=["sliding_attention", "full_attention"] * 2),
                       seed=80, unit_scores=True),
    # the E-models' form (E2B, E4B): per-layer embeddings of 32 per layer; the last two layers read the KV caches of
    # layers 2 (sliding) and 3 (global) and have MLPs twice as wide; image tokens bidirectional as shipped (text causal)
    "gemma4_e": Case("Gemma4TextConfig", dict(SMALL, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                                              global_head_dim=32, hidden_size_per_layer_input=32,
                                              vocab_size_per_layer_input=320, num_kv_shared_layers=2,
                                              use_double_wide_mlp=True, sliding_window=20,
                                              use_bidirectional_attention="vision",
                                              final_logit_softcapping=8.0,
                                              layer_types=["sliding_attention", "full_attention"] * 3),
                     seed=82, unit_scores=True),
}


# ---- long contexts (issue 66): the rope scalings of the 128k-token families, past their pretraining lengths
LONG_BASE = dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072)
LLAMA3_128K_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LONG_CONTEXT_CASES: dict[str, Case] = {
    # Llama 3.1 / 3.2: llama3 scaling of an 8k pretraining to 128k
    "llama3": Case("LlamaConfig", dict(LONG_BASE, tie_word_embeddings=True, rope_parameters=LLAMA3_128K_ROPE),
                   seed=31),
    # Qwen3 (and Qwen2.5) as their cards enable 128k: yarn, factor 4 over 32k, its attention factor 1.139
    "qwen3_yarn": Case("Qwen3Config", dict(LONG_BASE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}),
        seed=32),
    # Phi-3.5 / Phi-4-mini: LongRoPE's long factors past a 4k pretraining, a partial rotary dim
    "phi3_longrope": Case("Phi3Config", dict(LONG_BASE, original_max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.2, 1.4, 1.8, 2.5], "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
        seed=33, expect={"original_max_position_embeddings": 4096}),
}
# the 128k session's model: one layer with one head of 32 (attention over 131k keys is what that test costs)
LONGEST_CONTEXT_CASES: dict[str, Case] = {
    "llama3_one_head": Case("LlamaConfig", dict(LONG_BASE, num_hidden_layers=1, num_attention_heads=1,
                                                num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                                                rope_parameters=LLAMA3_128K_ROPE), seed=34),
}


def _init_weights(model, norm_offset: float, plain_norms: tuple = (), unit_scores: bool = False) -> None:
    """Wider than HF's init so that the logits are not flat: matrices N(0, 1/fan_in), biases N(0, 0.01),
    norm weights around 1 (Gemma: around 0, its norms scale by 1 + w; ``plain_norms`` around 1 in any case;
    ``unit_scores``: q/k norms around head_dim**-0.25, see Case)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's router: scales around 1
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif unit_scores and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(p.shape[-1] ** -0.25 * (1.0 + 0.1 * torch.randn_like(p)))
            elif any(n in name for n in plain_norms):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 - norm_offset + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scalars (stored, not parameters)
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))


def _matches(value, want) -> bool:
    if isinstance(want, dict):
        return isinstance(value, dict) and all(_matches(value.get(k), v) for k, v in want.items())
    return value == want

def build_case(name: str, folder, cases: dict[str, Case] | None = None) -> "torch.nn.Module":
    """Saves the case's random model (fp32 safetensors, byte tokenizer) into ``folder`` and returns HF's
    fp32 model read back from it: the reference reads exactly the files the engine reads. ``cases``: where
    ``name`` is (ARCH_CASES unless given)."""
    from transformers import AutoModelForCausalLM

    case = (ARCH_CASES if cases is None else cases)[name]
    attn = {"attn_implementation": case.attn_implementation} if case.attn_implementation else {}
    _build_cached(_cache_key("build_case", name, case), Path(folder), lambda out: _write_case(case, out))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **attn).eval()
    for key, want in case.expect.items():
        got = getattr(ref.config, key)
        assert _matches(got, want), f"{name}: HF reads {key}={got!r} from the folder, the case means {want!r}"
    ref.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, as the engine with ignore_eos
    return without_cache_unless_attention(ref)


def without_cache_unless_attention(ref):
    """A model whose every layer is recurrent runs without HF's cache, which needs an attention layer
    (transformers 5.24; tests.helpers.hf_greedy generates by full forwards for it)."""
    if all_recurrent(ref.config):
        ref.config.use_cache = False
    return ref


def _write_case(case: Case, folder: Path) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, case.config_class)(**{"max_position_embeddings": 512, **TOKEN_IDS, **case.kwargs})
    torch.manual_seed(case.seed)
    attn = {"attn_implementation": case.attn_implementation} if case.attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn).eval()
    _init_weights(model, case.norm_offset, case.plain_norms, case.unit_scores)
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    if case.hub_layout is not None:
        path = folder / "config.json"
        path.write_text(json.dumps(case.hub_layout(json.loads(path.read_text())), indent=2))


# ---- lmkit lite's architecture cases (issue 22 shapes for AWQ and KV calibration): make_arch_model

LITE_BASE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
                 pad_token_id=0, tie_word_embeddings=False)
LITE_WINDOWS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
# name -> (config class, model class, overrides, whether the v -> o group folds, storage dtype)
LITE_ARCH_CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, False, "float32"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, tie_word_embeddings=True), False, "bfloat16"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=16, query_pre_attn_scalar=24, layer_types=LITE_WINDOWS,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1000000.0}}), False, "float32"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4), True, "float32"),
    "phi4": ("Phi3Config", "Phi3ForCausalLM",
             dict(original_max_position_embeddings=32,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0],
                                   "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]}), False, "float32"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(tie_word_embeddings=True), False, "float32"),
}


def make_arch_model(folder: Path, case: str, seed: int = 0):
    """A random tiny model of ``case`` saved with the byte tokenizer into ``folder``; returns its HF class."""
    import transformers

    _build_cached(_cache_key("make_arch_model", case, LITE_ARCH_CASES[case], seed), folder,
                  lambda out: _write_arch_model(out, case, seed))
    return getattr(transformers, LITE_ARCH_CASES[case][1])


def _write_arch_model(folder: Path, case: str, seed: int) -> None:
    import transformers

    config_class, model_class, overrides, _, dtype = LITE_ARCH_CASES[case]
    config = getattr(transformers, config_class)(**{**LITE_BASE, **overrides})
    config.architectures = [model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    offset = 0.0 if case.startswith("gemma") else 1.0  # Gemma norms scale by 1 + w
    with torch.no_grad():  # larger than default init so that logits are not flat
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(offset + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    folder.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(str(folder))
    write_byte_tokenizer(folder)


# ---- mixture-of-experts models for lite (and the server): make_moe_model

MOE_BASE = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, pad_token_id=0,
                tie_word_embeddings=False)
# name -> (config class, overrides, expert linear names in the checkpoint, sparse block in the checkpoint)
MOE_CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         intermediate_size=128, mlp_only_layers=[1], norm_topk_prob=True),
                  ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                ("w1", "w3", "w2"), "block_sparse_moe"),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64), None, "mlp"),
}


def make_moe_model(folder: Path, config_class: str, overrides: dict, seed: int = 0, router=None):
    """A random tiny model saved with the byte tokenizer; ``router(layer_index, weight)`` may rewrite a sparse
    layer's router weight in place (such a build is not cached). Returns the fp32 model (eval mode)."""
    if router is not None:
        return _write_moe_model(folder, config_class, overrides, seed, router)
    import transformers

    _build_cached(_cache_key("make_moe_model", config_class, overrides, seed), folder,
                  lambda out: _write_moe_model(out, config_class, overrides, seed, None))
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _write_moe_model(folder: Path, config_class: str, overrides: dict, seed: int, router):
    import transformers

    config = getattr(transformers, config_class)(**{**MOE_BASE, **overrides})
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
        if router is not None:
            for i, layer in enumerate(model.model.layers):
                if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k"):
                    router(i, layer.mlp.gate.weight)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    return model


# ---- tiny models that speak the real families' chat formats: make_family_model
# The byte tokenizer plus each family's special and added tokens, and the family's own chat template
# (tests/fixtures/chat_templates, verbatim copies).

_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special: tuple[str, ...]
    """Special tokens (left out of decoded text)."""
    added: tuple[str, ...]
    """Added tokens that are text (Qwen's <tool_call>, <think>)."""
    bos: str | None
    eos: str
    tool_parser: str | None
    reasoning: str | None = None


FAMILIES = {f.name: f for f in (
    Family("qwen2.5", "qwen2.5.jinja", _CHATML, ("<tool_call>", "</tool_call>"), None, "<|im_end|>", "hermes"),
    Family("qwen3", "qwen3.jinja", _CHATML, ("<tool_call>", "</tool_call>", "<think>", "</think>"), None,
           "<|im_end|>", "hermes", "qwen3"),
    Family("llama3.1", "llama3.1.jinja", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                          "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (),
           "<|begin_of_text|>", "<|eot_id|>", "llama3_json"),
    Family("mistral", "mistral.jinja", ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), (),
           "<s>", "</s>", "mistral"),
    Family("qwen3_coder", "qwen3_coder.jinja", _CHATML, ("<tool_call>", "</tool_call>"), None, "<|im_end|>",
           "qwen3_coder"),
    Family("gpt_oss", "gpt_oss.jinja", ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                        "<|constrain|>", "<|return|>", "<|call|>"), (),
           None, "<|return|>", "openai", "openai_gptoss"),
    Family("gemma4", "gemma4.jinja", ("<bos>", "<eos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
                                      "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                                      "<tool_response|>", '<|"|>'), (),
           "<bos>", "<turn|>", "gemma4", "gemma4"),
    Family("deepseek_r1", "deepseek_r1_distill.jinja",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"), ("<think>", "</think>"),
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", None, "deepseek_r1"),
)}


def make_family_model(folder: Path, family: Family, seed: int = 0) -> Path:
    """A tiny llama-shaped model with ``family``'s tokens and chat template, saved into ``folder``."""
    _build_cached(_cache_key("make_family_model", family, seed), folder,
                  lambda out: _write_family_model(out, family, seed))
    return folder


def _write_family_model(folder: Path, family: Family, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": list(family.special)})
    fast.add_tokens(list(family.added))
    fast.eos_token = family.eos
    if family.bos:
        fast.bos_token = family.bos
    fast.chat_template = (TEMPLATES / family.template).read_text()
    vocab = len(fast)
    make_tiny_model(folder, "llama", seed=seed, vocab_size=vocab + (-vocab) % 8,
                    bos_token_id=fast.convert_tokens_to_ids(family.bos) if family.bos else None,
                    eos_token_id=fast.convert_tokens_to_ids(family.eos))
    for f in folder.glob("*token*"):  # the byte tokenizer make_tiny_model wrote
        f.unlink()
    fast.save_pretrained(str(folder))


# ---- checkpoint writers: an fp32 folder -> a quantized checkpoint (and, for the int4 formats, a folder of the
# dequantized weights for the reference). Not cached: what they write depends on the source folder's files.

def rtn_checkpoint(src: Path, out: Path, group_size: int) -> Path:
    """lmkit lite's round-to-nearest AWQ checkpoint of ``src`` (the GEMM format of DESIGN.md section 4)."""
    from lmkit.lite.awq import quantize_awq
    from lmkit.lite.config import AwqConfig

    quantize_awq(src, AwqConfig(work_dir=out, w_group_size=group_size, format="autoawq", calib_samples=0))
    return out


LINEAR_ROLES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                "down_proj", "per_layer_input_gate", "per_layer_projection")


def linear_keys(folder: Path, group: int, out_multiple: int = 1) -> set[str]:
    """Checkpoint keys of the linears (not the router, embeddings or lm_head) whose inputs fit ``group``
    (0: per channel, needs in_features % 32 == 0) and whose outputs are a multiple of ``out_multiple``; the
    others stay dense, as an ignore list keeps them."""
    from safetensors import safe_open

    from lmkit.models import get_architecture

    cfg = json.loads((folder / "config.json").read_text())
    arch = get_architecture(cfg["architectures"][0])
    n = cfg["num_hidden_layers"]
    e = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    keys = set()
    for role, key in arch.key_map.items():
        if role.rsplit(".", 1)[-1] not in LINEAR_ROLES:
            continue
        for i in range(n):
            for j in range(e) if "{e}" in key else [None]:
                k = key.format(i=i) if j is None else key.replace("{e}", str(j)).format(i=i)
                keys.add(k)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        present = set(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in keys & present}
    # 2-D only: the experts stored together ([E, ...], gpt-oss's, Qwen3.5-MoE's) stay as they are
    return {k for k, shape in shapes.items() if len(shape) == 2 and shape[1] % (group or 32) == 0 and
            shape[0] % out_multiple == 0}


def quantized_linears(tensors: dict, keys: set[str], packed: dict, ref: dict):
    """(name, weight) of the tensors in ``keys``; every other tensor goes into ``packed`` and ``ref`` as it is."""
    for name, w in tensors.items():
        if name in keys:
            yield name, w
        else:
            packed[name] = ref[name] = w


def copy_folder(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> None:
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"))
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def write_with_compressor(src: Path, out: Path, scheme, compressor, fmt: str, group: int, scale_dtype) -> Path:
    """``out``/int4 (the quantized folder, whatever its bits): ``src``'s linears quantized under ``scheme`` with
    qparams from compressed-tensors' calculate_qparams and written by its ``compressor``, config ``format`` ``fmt``;
    ``out``/ref: the same compressor's decompression in fp32. group 0: per channel."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    args = scheme.weights
    tensors = load_file(str(src / "model.safetensors"))
    packed, ref = {}, {}
    for name, w in quantized_linears(tensors, linear_keys(src, group), packed, ref):
        n, k = w.shape
        g = group or k
        grouped = w.reshape(n, k // g, g)
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        sd = compressor.compress({"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zp}, scheme)
        assert args.num_bits != 8 or sd["weight"].dtype == torch.int8
        base = name[: -len("weight")]
        for part, t in sd.items():
            packed[base + part] = t
        ref[name] = compressor.decompress({**sd, "weight_scale": sd["weight_scale"].float()}, scheme)["weight"].float()
    ignore = sorted(name[: -len(".weight")] for name, t in packed.items()
                    if name.endswith(".weight") and t.ndim == 2 and t.is_floating_point())
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=ignore).model_dump()
    qc["quant_method"] = "compressed-tensors"
    copy_folder(src, out / "int4", packed, qc)
    copy_folder(src, out / "ref", ref, None)
    return out


def write_compressed_tensors(src: Path, out: Path, *, group: int, symmetric: bool,
                             scale_dtype=torch.bfloat16) -> Path:
    """compressed-tensors pack-quantized int4 (what llm-compressor's W4A16 presets write), by the library's own
    PackedQuantizationCompressor: ``out``/int4 and its decompression ``out``/ref. group 0: per-channel."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if group == 0 else "group"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group or None)
    return write_with_compressor(src, out, QuantizationScheme(targets=["Linear"], weights=args),
                                 PackedQuantizationCompressor, "pack-quantized", group, scale_dtype)


def write_compressed_tensors_int8(src: Path, out: Path, *, group: int = 0, activations: bool = True,
                                  scale_dtype=torch.bfloat16, fmt: str = "int-quantized") -> Path:
    """compressed-tensors int8 weights, symmetric, per channel (group 0) or per group, with int8 dynamic per-token
    activations when ``activations`` (W8A8, as llm-compressor's SmoothQuant/GPTQ W8A8 presets write it) or none
    (W8A16), by the library's own IntQuantizationCompressor: ``out``/int4 and its decompression ``out``/ref."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if group == 0 else "group"
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=strategy, group_size=group or None)
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts if activations else None)
    return write_with_compressor(src, out, scheme, IntQuantizationCompressor, fmt, group, scale_dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; 8..15 the same negated (OCP MX spec)


def fp4_reference(packed: torch.Tensor, scale: torch.Tensor, block: int, global_scale=None) -> torch.Tensor:
    """float32 weight [N, K] of an FP4 tensor decoded in float64 from the format's definition: e2m1 codes two a byte
    (value 2j in byte j's low nibble), times its block's scale (NVFP4: an E4M3 scale decoded by torch's float8_e4m3fn,
    divided by the global scale; MXFP4: an e8m0 exponent, 2^(e - 127))."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    if scale.dtype == torch.uint8:
        s = torch.pow(torch.tensor(2.0, dtype=torch.float64), scale.to(torch.float64) - 127)
    else:
        s = scale.to(torch.float64) / float(global_scale)
    return (table[codes] * s.repeat_interleave(block, dim=1)).float()


def write_compressed_tensors_fp4(src: Path, out: Path, *, fmt: str = "nvfp4", activations: bool = False,
                                 fused_global: bool = True) -> Path:
    """compressed-tensors FP4 weights as llm-compressor's presets write them (``fmt`` nvfp4: NVFP4A16, or NVFP4 with
    ``activations``, E4M3 scales per 16 inputs under a per-tensor global scale, the least of q/k/v's and of
    gate/up's for each of them unless not ``fused_global`` (llm-compressor's update_fused_layer_weight_global_scales),
    with an input_global_scale per linear as its calibration leaves one; mxfp4: MXFP4A16 / MXFP4, e8m0 scales per
    32), qparams from
    compressed-tensors' own generate_gparam and calculate_qparams, written by its NVFP4 / MXFP4 packed compressor:
    ``out``/fp4, and ``out``/ref: fp32 weights decoded in float64 (fp4_reference). The router, embeddings and lm_head
    stay dense (``ignore``)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file

    nv = fmt == "nvfp4"
    scheme = preset_name_to_scheme(("NVFP4" if nv else "MXFP4") + ("" if activations else "A16"), ["Linear"])
    compressor = NVFP4PackedCompressor if nv else MXFP4PackedCompressor
    block = scheme.weights.group_size
    tensors = load_file(str(src / "model.safetensors"))
    keys = linear_keys(src, 32)

    def global_scale(name: str) -> torch.Tensor:
        groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if fused_global else ()
        head, leaf = name[: -len(".weight")].rsplit(".", 1)
        group = next((g for g in groups if leaf in g), (leaf,))
        members = [tensors[m].float() for m in (f"{head}.{g}.weight" for g in group) if m in keys]
        return torch.min(torch.cat([generate_gparam(m.amin(), m.amax()) for m in members])).reshape([1])

    packed, ref = {}, {}
    for name, w in quantized_linears(tensors, keys, packed, ref):
        n, k = w.shape
        wf = w.float()
        grouped = wf.reshape(n, k // block, block)
        gscale = global_scale(name) if nv else None
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights, global_scale=gscale)
        sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        if nv:
            sd["weight_global_scale"] = gscale
        sd = compressor.compress(sd, scheme)
        if nv and activations:
            sd["input_global_scale"] = torch.tensor([448.0 * 6.0 / 4.0])
        base = name[: -len("weight")]
        for part, t in sd.items():
            packed[base + part] = t.contiguous()
        ref[name] = fp4_reference(sd["weight_packed"], sd["weight_scale"], block, gscale)
    ignore = sorted(name[: -len(".weight")] for name, t in packed.items()
                    if name.endswith(".weight") and t.ndim == 2 and t.is_floating_point())
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=f"{fmt}-pack-quantized",
                            quantization_status="compressed", ignore=ignore).model_dump()
    qc["quant_method"] = "compressed-tensors"
    copy_folder(src, out / "fp4", packed, qc)
    copy_folder(src, out / "ref", ref, None)
    return out


def as_int32_words(words: np.ndarray) -> torch.Tensor:
    """int64 values taken modulo 2^32 as int32 (the bit patterns a checkpoint stores)."""
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """int32 [rows / 8, cols] holding q [rows, cols] (0..15): row 8r + i at bits 4i of word [r, c]."""
    q = q.to(torch.int64).numpy().reshape(q.shape[0] // 8, 8, q.shape[1])
    return as_int32_words(sum(q[:, i] << (4 * i) for i in range(8)))


def write_gptq(src: Path, out: Path, *, group: int, symmetric: bool, act_order: bool, checkpoint_format: str,
               seed: int = 0) -> Path:
    """``out``/int4 in GPTQ's layout (min/max rounding per group; act-order: a random input order whose
    consecutive runs of ``group`` inputs form the groups, as GPTQ's desc_act makes them) and ``out``/ref."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    packed, ref = {}, {}
    keys = linear_keys(src, group, out_multiple=8)  # qzeros pack 8 outputs per int32
    for name, w in quantized_linears(tensors, keys, packed, ref):
        n, k = w.shape
        g = group or k
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // g  # input order[j] is in group j // g
        wg = w.t()  # [k, n]
        lo = torch.stack([wg[g_idx == i].amin(0) for i in range(k // g)]).clamp(max=0)  # [G, n]
        hi = torch.stack([wg[g_idx == i].amax(0) for i in range(k // g)]).clamp(min=0)
        if symmetric:
            scale = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-8)
            zero = torch.full_like(scale, 8.0)
        else:
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            zero = torch.clamp(torch.round(-lo / scale), 0, 15)
        scale = scale.half()
        s32 = scale.float()
        q = torch.clamp(torch.round(wg / s32[g_idx.long()]) + zero[g_idx.long()], 0, 15).to(torch.int64)  # [k, n]
        zeros_words = pack_along_rows(zero.t().to(torch.int64)).t().contiguous()  # [G, n / 8]
        if checkpoint_format == "gptq":  # v1 stores zero - 1: GPTQModel's v2 -> v1 subtracts 0x11111111
            zeros_words = as_int32_words(zeros_words.numpy().astype(np.int64) - 0x11111111)
        base = name[: -len("weight")]
        packed[base + "qweight"] = pack_along_rows(q)
        packed[base + "qzeros"] = zeros_words
        packed[base + "scales"] = scale
        packed[base + "g_idx"] = g_idx
        ref[name] = ((q.float() - zero[g_idx.long()]) * s32[g_idx.long()]).t().contiguous()
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "desc_act": act_order, "sym": symmetric,
          "checkpoint_format": checkpoint_format, "true_sequential": True, "damp_percent": 0.01}
    copy_folder(src, out / "int4", packed, qc)
    copy_folder(src, out / "ref", ref, None)
    return out


# ---- data files

def write_sharegpt_file(path: Path, num_valid: int = 6) -> list[tuple[str, str]]:
    """A small file in ShareGPT's schema (what --dataset reads): ``num_valid`` two-turn conversations of
    pydoc text, plus ones the loader must skip (one turn, a 1-word prompt, a turn without a value).
    Returns the valid (prompt, answer) pairs."""
    import pydoc_data.topics as topics

    words = " ".join(topics.topics.values()).split()
    valid = [(" ".join(words[40 * i:40 * i + 20 + 3 * i]), " ".join(words[40 * i + 25:40 * i + 33]))
             for i in range(num_valid)]
    convs = [{"id": f"ok{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a},
                                                 {"from": "human", "value": "and then?"}]}
             for i, (q, a) in enumerate(valid)]
    convs += [{"id": "one-turn", "conversations": [{"from": "human", "value": " ".join(words[:30])}]},
              {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": valid[0][1]}]},
              {"id": "no-value", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x y z w v"}]}]
    path.write_text(json.dumps(convs))
    return valid


# ---- the multimodal checkpoints vendors ship (the text model under model.language_model, a vision tower beside)

QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=16)


def write_qwen3_5_multimodal(folder: Path, config_class: str, text: dict, seed: int):
    """A Qwen3_5(Moe)ForConditionalGeneration checkpoint of ``config_class`` (Qwen3_5Config, Qwen3_5MoeConfig) with
    the MTP tensor Qwen's checkpoints carry (transformers drops it on load); returns its fp32 HF model."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = getattr(transformers, config_class)(text_config=text, vision_config=QWEN3_5_VISION)
    model_class = getattr(transformers, config_class.replace("Config", "ForConditionalGeneration"))
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _init_weights(model, 1.0, ("linear_attn.norm",))
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return model_class.from_pretrained(str(folder), dtype=torch.float32).eval()


def _gemma4_hub_layout(text: dict) -> dict:
    """text_config as the hub's files have it: the global layers' shape as global_head_dim (and
    num_global_key_value_heads), no per_layer_config."""
    per_layer = text.pop("per_layer_config")
    (global_shape,) = {json.dumps(v, sort_keys=True) for v in per_layer.values()}
    shape = json.loads(global_shape)
    text["global_head_dim"] = shape["head_dim"]
    if "num_key_value_heads" in shape:
        text["num_global_key_value_heads"] = shape["num_key_value_heads"]
    return text


def write_gemma4_multimodal(folder: Path, case: str, seed: int):
    """A Gemma4ForConditionalGeneration checkpoint whose text model is ARCH_CASES[case]'s, its text_config in the hub's
    layout (_gemma4_hub_layout); returns its fp32 HF model."""
    import transformers

    text = dict(ARCH_CASES[case].kwargs, max_position_embeddings=512, **{**TOKEN_IDS, "pad_token_id": 0})
    config = transformers.Gemma4Config(text_config=text, vision_config=GEMMA4_VISION)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    _init_weights(model, 0.0, unit_scores=True)
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"] = _gemma4_hub_layout(cfg["text_config"])
    path.write_text(json.dumps(cfg, indent=2))
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


def fuse_qwen3_5_experts(folder: Path, num_layers: int, num_experts: int) -> dict:
    """Rewrites a Qwen3_5MoeForConditionalGeneration checkpoint's per-expert tensors (what transformers saves) as the
    two stacked tensors per layer Qwen ships (mlp.experts.gate_up_proj [E, 2I, H]: each expert's gate rows then its up
    rows; mlp.experts.down_proj [E, H, I]); returns the tensors written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for i in range(num_layers):
        p = f"model.language_model.layers.{i}.mlp.experts"
        take = lambda name: [tensors.pop(f"{p}.{e}.{name}.weight") for e in range(num_experts)]  # noqa: E731
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(take("gate_proj"),
                                                                                      take("up_proj"))])
        tensors[f"{p}.down_proj"] = torch.stack(take("down_proj"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _fp8_scale_shape(strategy: str, shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of weight one FP8 scale covers."""
    n, k = shape
    return (n, k) if strategy == "tensor" else (1, k) if strategy == "channel" else block


def _fp8_block_amax(w: torch.Tensor, cover: tuple[int, int]) -> torch.Tensor:
    """max |w| per ``cover`` block [ceil(N / bn), ceil(K / bk)] (partial blocks at the edges)."""
    n, k = w.shape
    bn, bk = cover
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype)
    padded[:n, :k] = w.abs()
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))


def fp8_reference(q: torch.Tensor, scales: torch.Tensor, cover: tuple[int, int]) -> torch.Tensor:
    """float32 weight of an FP8 E4M3 tensor (decoded by torch's float8_e4m3fn) times its scales, in float64."""
    n, k = q.shape
    bn, bk = cover
    s = scales.to(torch.float64).reshape(-(-n // bn), -(-k // bk))
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.to(torch.float64) * full).float()


def write_compressed_tensors_fp8(src: Path, out: Path, *, strategy: str = "channel", activations: bool = True,
                                 block: tuple[int, int] = (128, 128), scale_dtype=torch.float32) -> Path:
    """compressed-tensors FP8 E4M3 weights (llm-compressor's FP8_DYNAMIC with ``activations``, its FP8 weight-only
    scheme without), scales per ``strategy`` (tensor, channel, block) from compressed-tensors' calculate_qparams,
    compressed by its own Float/NaiveQuantizationCompressor: ``out``/fp8, and ``out``/ref: fp32 weights decoded
    through torch's float8_e4m3fn times the scales in float64. The router, embeddings and lm_head stay dense
    (``ignore``)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor, \
        NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                            block_structure=list(block) if strategy == "block" else None)
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts if activations else None)
    compressor = FloatQuantizationCompressor if activations else NaiveQuantizationCompressor
    tensors = load_file(str(src / "model.safetensors"))
    packed, ref = {}, {}
    for name, w in quantized_linears(tensors, linear_keys(src, 1), packed, ref):
        cover = _fp8_scale_shape(strategy, tuple(w.shape), block)
        amax = _fp8_block_amax(w.float(), cover)
        scale, zp = calculate_qparams(-amax, amax, args)
        if strategy == "tensor":
            scale, zp = scale.reshape(1), zp.reshape(1)
        elif strategy == "channel":
            scale, zp = scale.reshape(-1, 1), zp.reshape(-1, 1)
        scale = scale.to(scale_dtype)
        sd = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        assert sd["weight"].dtype == torch.float8_e4m3fn, sd["weight"].dtype
        base = name[: -len("weight")]
        for part, t in sd.items():
            packed[base + part] = t.contiguous()
        ref[name] = fp8_reference(sd["weight"], sd["weight_scale"], cover)
    ignore = sorted(name[: -len(".weight")] for name, t in packed.items()
                    if name.endswith(".weight") and t.ndim == 2 and t.is_floating_point()
                    and t.dtype != torch.float8_e4m3fn)
    fmt = "float-quantized" if activations else "naive-quantized"
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=ignore).model_dump()
    qc["quant_method"] = "compressed-tensors"
    copy_folder(src, out / "fp8", packed, qc)
    copy_folder(src, out / "ref", ref, None)
    return out


def write_fp8_block_vendor(src: Path, out: Path, *, block: tuple[int, int] = (128, 128),
                           keep_dense: tuple[str, ...] = ()) -> Path:
    """The vendor FP8 form (Qwen3-*-FP8, DeepSeek-V3; transformers' FineGrainedFP8), written by hand: per linear an
    F8_E4M3 ``weight`` (w / scale rounded by torch's cast to float8_e4m3fn) and an fp32 ``weight_scale_inv`` per
    ``block`` (amax / 448: a multiplier despite its name), config ``quant_method: fp8`` with
    ``weight_block_size``; linears whose name contains one of ``keep_dense`` stay bf16 as
    ``modules_to_not_convert``. ``out``/fp8 and ``out``/ref (fp32 dequantized in float64)."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    packed, ref = {}, {}
    dense = []
    for name, w in quantized_linears(tensors, linear_keys(src, 1), packed, ref):
        if any(d in name for d in keep_dense):
            packed[name] = w.to(torch.bfloat16)
            ref[name] = packed[name].float()
            dense.append(name[: -len(".weight")])
            continue
        n, k = w.shape
        bn, bk = block
        scale = _fp8_block_amax(w.float(), block) / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        packed[name] = q
        packed[name[: -len("weight")] + "weight_scale_inv"] = scale.float().contiguous()
        ref[name] = fp8_reference(q, scale, block)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": sorted(dense) or None}
    copy_folder(src, out / "fp8", packed, qc)
    copy_folder(src, out / "ref", ref, None)
    return out


def add_mtp_head(folder, seed: int = 0) -> dict[str, torch.Tensor]:
    """Writes a one-layer MTP head into checkpoint ``folder`` (config mtp_num_hidden_layers = 1, in text_config when
    the checkpoint has one): mtp.fc [H, 2H], the three norms [H], and mtp.layers.0.* shaped as the model's last
    full-attention layer's tensors, random bf16. Returns the mtp.* tensors written."""
    from safetensors.torch import load_file, save_file

    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    path.write_text(json.dumps(cfg, indent=2))
    shard = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(shard)).items() if not k.startswith("mtp.")}
    prefix = "model.language_model.layers." if "text_config" in cfg else "model.layers."
    last = max(i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    H = text["hidden_size"]
    mtp = {"mtp.fc.weight": rand(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": rand(H),
           "mtp.pre_fc_norm_hidden.weight": rand(H), "mtp.norm.weight": rand(H)}
    for name, t in tensors.items():
        if name.startswith(f"{prefix}{last}."):
            mtp["mtp.layers.0." + name[len(f"{prefix}{last}."):]] = rand(*t.shape)
    assert any(".self_attn.q_proj." in k for k in mtp) and any(".mlp." in k for k in mtp), sorted(mtp)
    save_file({**tensors, **mtp}, str(shard), metadata={"format": "pt"})
    return mtp
