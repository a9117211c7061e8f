"""What lmkit knows about one HF architecture, and the engine model fields read from its config.json.

One module per architecture (lmkit/models/<arch>.py) fills in one ``Architecture``; lmkit/models/registry.py
lists them by HF name. Shared here: ``ModelFields`` (the engine ModelConfig fields a config.json decides),
``HfConfig`` (config.json over the transformers config class's defaults) and the readers every module uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from lmkit.models.awq_map import AwqMap
from lmkit.models.rope import RopeTable, rope_table, rotary_dim_of, standard_rope_parameters

FAMILIES = ("llama", "gemma")  # the forwards the C++ engine registers by name
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_NONE, ROPE_GLOBAL, ROPE_LOCAL = 0, 1, 2  # layer_rope values


@dataclass(kw_only=True)
class ModelFields:
    """The engine ModelConfig fields that config.json decides (names as in C++ csrc/model/model_config.h)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeTable
    """The global rotary table (inv_freq / attention_scaling; longrope also has its long factors)."""
    rope_local: RopeTable | None = None
    """The second table (Gemma 3 sliding layers); None: unused."""
    rotary_dim: int = 0
    """Rotated dims of a head (partial rotary); 0: head_dim."""
    layer_rope: list[int] = field(default_factory=list)
    """Per layer: 0 no RoPE, 1 the global table, 2 the local one."""
    layer_sliding_window: list[int] = field(default_factory=list)
    """Per layer: 0 full attention, w > 0: a query at p attends keys k with p - k < w."""
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU) | "clamped_swiglu" (gpt-oss, the constants below)
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    norm_weight_offset: float = 0.0  # every RMSNorm scales by (offset + w)
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    attention_sinks: bool = False
    """A learned logit per query head joins each row's softmax (gpt-oss)."""
    has_qk_norm: bool = False
    qk_norm_whole: bool = False
    """The q/k norms are over the whole q / k projection (OLMoE), not per head."""
    num_experts: int = 0
    """Mixture of experts: experts per MoE layer (0: none), the top k each row uses, an expert's MLP size,
    whether the top-k router probabilities are renormalized to sum 1, and which layers are MoE."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    layer_moe: list[int] = field(default_factory=list)
    moe_biases: bool = False
    """The router and the experts' linears have biases (gpt-oss)."""
    experts_interleaved: bool = False
    """The experts' gate and up rows alternate, stored as gpt-oss ships them (MXFP4) or as transformers holds them."""
    shared_expert_intermediate_size: int = 0
    """> 0: each MoE layer also has a shared expert of this width, gated by sigmoid(shared_expert_gate . x)."""
    layer_recurrent: list[int] = field(default_factory=list)
    """Per layer: 1 a recurrent (Gated DeltaNet) layer over a per-sequence state, 0 self-attention; empty: none.
    Its shape: the linear_* fields (key / value heads and head dims, the short convolution's taps)."""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False
    """q_proj holds each head's query and then its gate; the attention output is multiplied by sigmoid(gate)."""
    layer_head_dim: list[int] = field(default_factory=list)
    """Per layer: its head_dim (Gemma 4: global layers are wider); empty: head_dim everywhere."""
    layer_num_kv_heads: list[int] = field(default_factory=list)
    """Per layer: its KV heads; empty: num_kv_heads everywhere."""
    layer_v_from_k: list[int] = field(default_factory=list)
    """Per layer: 1 when it has no v_proj and its values are k_proj's output (Gemma 4's attention_k_eq_v)."""
    has_v_norm: bool = False
    """A weightless RMSNorm on each value head before the cache (Gemma 4)."""
    has_layer_scalar: bool = False
    """Each layer's output (the residual stream) times its stored layer_scalar (Gemma 4)."""
    moe_beside_mlp: bool = False
    """MoE layers run the dense MLP and the experts side by side, each with its own norms (Gemma 4's MoE block)."""
    layer_kv_source: list[int] = field(default_factory=list)
    """Per layer: the layer whose KV cache it reads (itself, or an earlier layer: Gemma 4's cross-layer KV sharing,
    a reading layer has q_proj alone); empty: every layer its own."""
    layer_intermediate_size: list[int] = field(default_factory=list)
    """Per layer: its dense MLP's width (Gemma 4's use_double_wide_mlp); empty: intermediate_size everywhere."""
    per_layer_input_size: int = 0
    """> 0: per-layer embeddings of this width per layer (Gemma 4's E-models: hidden_size_per_layer_input)."""
    mtp_num_layers: int = 0
    """Decoder layers of a multi-token-prediction head (config mtp_num_hidden_layers; checkpoint mtp.*): the engine
    loads them beside the model; speculative="mtp" drafts with them (Engine.mtp_num_layers); 0: none."""

    def check(self) -> None:
        """ValueError when the per-layer lists or the rotary dim do not fit the shape."""
        for name in ("layer_moe", "layer_recurrent", "layer_head_dim", "layer_num_kv_heads", "layer_v_from_k",
                     "layer_kv_source", "layer_intermediate_size"):
            values = getattr(self, name)
            if values and len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for {self.num_layers} layers")
        if any(self.layer_moe) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}]")
        for name in ("layer_rope", "layer_sliding_window"):
            values = getattr(self, name)
            if len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for {self.num_layers} layers")
        if ROPE_LOCAL in self.layer_rope and self.rope_local is None:
            raise ValueError("a layer uses the local rotary table but there is none")
        if not self.layer_head_dim and self.rope.inv_freq.shape != ((self.rotary_dim or self.head_dim) // 2,):
            raise ValueError(f"inv_freq has {self.rope.inv_freq.size} entries for rotary dim "
                             f"{self.rotary_dim or self.head_dim}")


@dataclass(frozen=True)
class KvCalibHooks:
    """What lite's KV calibration (lmkit.lite.kvcalib, kvquant) needs to run the HF model of an architecture
    with fake-quantized K/V. Module paths are attribute paths in the HF causal LM."""

    layers: str = "model.layers"  # the decoder layers
    attention: str = "self_attn"  # in a decoder layer: the attention module (has layer_idx)
    o_proj: str = "o_proj"  # in the attention module: the output projection
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # The HF attention function the fake quantization wraps: a key of transformers' AttentionInterface, or the
    # dotted path of the model's own function (Gemma 2: soft-capped scores, which sdpa refuses), and the key of
    # transformers' AttentionMaskInterface whose masks that function reads (sdpa: boolean, eager: additive).
    attention_function: str = "sdpa"
    attention_mask: str = "sdpa"
    # config field of the final logit soft-cap (logits = cap * tanh(logits / cap) after lm_head); None: none.
    final_logit_softcap: str | None = None


@dataclass(frozen=True, eq=False)
class Architecture:
    """Everything lmkit knows about one HF architecture name."""

    name: str  # HF architecture name (config.json "architectures")
    family: str  # the engine forward: "llama" (pre-norm) or "gemma" (norms before and after each block)
    key_map: Mapping[str, str]
    """Engine role -> HF tensor name; "{i}" is the layer index. Roles absent from a checkpoint are left out."""
    read_config: Callable[["HfConfig"], ModelFields]
    """config.json (over the config class's defaults) -> the engine fields; ValueError naming the field."""
    config_defaults: Mapping[str, object]
    """The transformers config class's defaults of the fields read_config reads (checked in the tests)."""
    awq_map: AwqMap | None
    """None: ``lmkit lite awq`` cannot quantize it yet (mixture-of-experts layers); the engine runs it."""
    kv_calib: KvCalibHooks | None = KvCalibHooks()
    """None: ``lmkit lite calibrate`` cannot calibrate it yet (layers without K/V); a uniform quant_policy works."""
    unused_tensors: tuple[str, ...] = ()
    """Name prefixes of checkpoint tensors outside the text model (a vision tower of a model served for text, Qwen's
    MTP head): lite carries them over as they are; the engine reads those its key map names and leaves the rest."""
    text_prefix: str = "model."
    """Where the text model's tensors live in checkpoints ("model.language_model." in a multimodal one); lite works
    on the text model (its transformers CausalLM of text_config) and writes back under these names."""

    def to_checkpoint(self, name: str) -> str:
        """A text CausalLM's tensor or module name (model.layers.0..., lm_head) as this checkpoint names it."""
        return self.text_prefix + name[len("model."):] if name.startswith("model.") else name

    def from_checkpoint(self, name: str) -> str | None:
        """The text CausalLM's name of a checkpoint tensor; None for one outside the text model (a vision tower)."""
        if name.startswith(self.text_prefix):
            return "model." + name[len(self.text_prefix):]
        if name.startswith("model.") or name.startswith(self.unused_tensors or ("\0",)):
            return None
        return name

    def __post_init__(self):
        assert self.family in FAMILIES, f"{self.name}: family {self.family!r} is not one of {FAMILIES}"
        assert self.awq_map is None or self.awq_map.architecture == self.name, (
            f"{self.name}: AWQ map of {self.awq_map.architecture}")

    def model_fields(self, cfg: dict) -> ModelFields:
        """The engine fields of config.json ``cfg``; ValueError naming the field lmkit cannot serve."""
        fields = self.read_config(HfConfig(cfg, self.config_defaults, self.name))
        fields.check()
        return fields


class HfConfig:
    """config.json over the defaults of the architecture's transformers config class (a key absent from the
    file reads as transformers reads it). Errors name the field."""

    def __init__(self, cfg: dict, defaults: Mapping[str, object], architecture: str):
        self.raw = cfg
        self.defaults = defaults
        self.architecture = architecture

    def get(self, name: str, default=None):
        """The file's value, else the class default, else ``default``."""
        if name in self.raw:
            return self.raw[name]
        return self.defaults.get(name, default)

    def require(self, name: str):
        value = self.get(name)
        if value is None:
            raise ValueError(f"no {name!r} (needed for {self.architecture})")
        return value

    def reject(self, name: str, why: str) -> None:
        """ValueError when the field is set (truthy): lmkit cannot serve it."""
        value = self.get(name)
        if value:
            raise ValueError(f"{name}={value!r} is not supported for {self.architecture}: {why}")

    def error(self, name: str, why: str) -> ValueError:
        return ValueError(f"{name}={self.get(name)!r} is not supported for {self.architecture}: {why}")


def shape_fields(c: HfConfig) -> dict:
    """The shape fields every architecture reads the same way."""
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    return dict(
        vocab_size=int(c.require("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(c.require("intermediate_size")),
        num_layers=int(c.require("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        rms_norm_eps=float(c.require("rms_norm_eps")),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=int(c.require("max_position_embeddings")),
    )


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
SILU = ("silu", "swish")  # HF names of SiLU
GELU_TANH = ("gelu_pytorch_tanh",)


def activation(c: HfConfig, name: str, allowed: tuple[str, ...]) -> str:
    """The engine activation of config field ``name`` (one of ``allowed`` HF names)."""
    value = c.get(name)
    if value not in allowed:
        raise c.error(name, f"the MLP activation must be one of {', '.join(allowed)}")
    return _ACTIVATIONS[value]


def global_rope_parameters(c: HfConfig, default_theta: float = 10000.0) -> dict:
    """The standardized rope parameters of a config with one rope for all layers: rope_scaling (4.x) or
    rope_parameters (5.x) as transformers 5 reads them (rope_scaling, when set, replaces rope_parameters)."""
    return standard_rope_parameters(c.get("rope_scaling") or c.get("rope_parameters"), _with_defaults(c),
                                    default_theta)


def global_rope(c: HfConfig, head_dim: int, default_theta: float = 10000.0) -> tuple[RopeTable, int]:
    """(table, rotary_dim; 0 = head_dim) of a config with one rope for all layers."""
    return rope_of(c, global_rope_parameters(c, default_theta), head_dim)


def layer_type_rope(c: HfConfig, head_dim: int, params: dict | None, theta: float) -> tuple[RopeTable, int]:
    """(table, rotary_dim) of one layer type's rope parameters (rope_parameters keyed by layer type), whose
    rope_theta defaults to ``theta``."""
    return rope_of(c, standard_rope_parameters(params, _with_defaults(c), theta, nested=True), head_dim)


def _with_defaults(c: HfConfig) -> dict:
    return {**c.defaults, **c.raw}


def rope_of(c: HfConfig, params: dict, head_dim: int) -> tuple[RopeTable, int]:
    """(table, rotary_dim; 0 = head_dim) of standardized parameters; ValueError naming what is missing."""
    try:
        table = rope_table(params, head_dim, int(c.require("max_position_embeddings")))
        dim = rotary_dim_of(params, head_dim)
    except KeyError as e:
        raise ValueError(f"{c.architecture}: rope type {params.get('rope_type')!r} needs "
                         f"{e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{c.architecture}: rope_parameters: {e}") from None
    return table, (0 if dim == head_dim else dim)


def layer_types(c: HfConfig, num_layers: int, default: Callable[[int], str]) -> list[str]:
    """config's layer_types, else ``default(i)`` per layer (the config class's rule); ValueError naming the
    field when an entry is not a known attention type or the count is wrong."""
    types = c.raw.get("layer_types") or [default(i) for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise c.error("layer_types", f"need {num_layers} entries of {', '.join(LAYER_TYPES)}")
    return list(types)


def windows_of(types: list[str], window: int | None) -> list[int]:
    """Per layer: ``window`` on sliding_attention layers (when set), 0 on full ones."""
    return [int(window or 0) if t == "sliding_attention" else 0 for t in types]


def gemma_embed_scale(hidden_size: int) -> float:
    """HF Gemma's embedding multiplier: torch.tensor(hidden_size ** 0.5) in float32."""
    return float(np.float32(math.sqrt(hidden_size)))


def softcap(value) -> float:
    """A soft-cap field: None -> 0 (off)."""
    return float(value) if value else 0.0
