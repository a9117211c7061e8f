"""Gemma 4 text (Gemma4ForCausalLM, model_type gemma4_text; and the text model of Gemma4ForConditionalGeneration):
Gemma 3's layer with plain-w RMSNorms, a weightless RMSNorm on the values, softmax scale 1 (the q/k norms do the
scaling), and each layer's output times a stored scalar (layer_scalar). Sliding layers (five per global one by
default) have head_dim and default RoPE; global layers are wider (global_head_dim, by default 512) with
proportional RoPE (only the first partial_rotary_factor of the angles rotate), and with attention_k_eq_v have
num_global_key_value_heads KV heads whose values are the keys (no v_proj). Final logits soft-capped.

The MoE model (26B-A4B, enable_moe_block): every layer runs its dense MLP and its routed experts (GeGLU, top-k of a
softmax renormalized, then times each expert's per_expert_scale) side by side on the layer's input; the router reads
a weightless norm of it times router.scale / sqrt(hidden), the experts their own norm; the two outputs are normed,
summed, and normed again.

The E-models (E2B, E4B): per-layer embeddings (hidden_size_per_layer_input P: a second table [vocab, layers * P]
and a projection of the scaled embeddings give each layer a P-wide input, which ends the layer with a gated
projection back to hidden, normed and added); the last num_kv_shared_layers layers have no k/v projections and
read the KV cache of the last earlier layer of their type (kv_sharing_modes), their MLP twice as wide with
use_double_wide_mlp. use_bidirectional_attention "vision" (the shipped checkpoints') makes image tokens attend both
ways: text, all lmkit serves, stays causal; "all" is refused by name.

config.json layouts: transformers >= 5.25 saves the global layers' shape as per_layer_config ({"5": {"head_dim":
512, "num_key_value_heads": 4}}); the hub's files (written by the release's transformers) as global_head_dim and
num_global_key_value_heads; both are read.
"""

from __future__ import annotations

from lmkit.models.architecture import GELU_TANH, ROPE_GLOBAL, ROPE_LOCAL, Architecture, HfConfig, KvCalibHooks, \
    ModelFields, activation, gemma_embed_scale, layer_type_rope, layer_types, shape_fields, softcap, windows_of
from lmkit.models.awq_map import AwqMap, MoeLayout, SmoothGroup
from lmkit.models.gemma2 import KEY_MAP as GEMMA2_KEY_MAP
from lmkit.models.llama import QK_NORM_LAYER, layer_keys
from lmkit.models.qwen3_5 import multimodal_architecture

NAME = "Gemma4ForCausalLM"
MOE_LAYER = {
    "router": "router.proj.weight",
    "router_scale": "router.scale",
    "expert_scale": "router.per_expert_scale",
    "experts.gate_up_proj": "experts.gate_up_proj",  # [E, 2 moe_inter, hidden]: each expert's gate rows, then up rows
    "experts.down_proj": "experts.down_proj",  # [E, hidden, moe_inter]
    # lmkit lite awq's checkpoints: one int4 linear per expert (lmkit.lite.moe)
    "experts.{e}.gate_proj": "experts.{e}.gate_proj.weight",
    "experts.{e}.up_proj": "experts.{e}.up_proj.weight",
    "experts.{e}.down_proj": "experts.{e}.down_proj.weight",
    "post_mlp_norm_1": "post_feedforward_layernorm_1.weight",
    "pre_moe_norm": "pre_feedforward_layernorm_2.weight",
    "post_moe_norm": "post_feedforward_layernorm_2.weight",
}
PER_LAYER_EMBEDDING = {"embed_tokens_per_layer": "model.embed_tokens_per_layer.weight",
                       "per_layer_model_projection": "model.per_layer_model_projection.weight",
                       "per_layer_projection_norm": "model.per_layer_projection_norm.weight"}
PER_LAYER_EMBEDDING_LAYER = {"per_layer_input_gate": "per_layer_input_gate.weight",
                             "per_layer_projection": "per_layer_projection.weight",
                             "post_per_layer_input_norm": "post_per_layer_input_norm.weight"}
KEY_MAP = {**GEMMA2_KEY_MAP, **PER_LAYER_EMBEDDING, **layer_keys(QK_NORM_LAYER),
           **layer_keys({"layer_scalar": "layer_scalar", **MOE_LAYER, **PER_LAYER_EMBEDDING_LAYER})}
# transformers.Gemma4TextConfig's defaults of the fields read here (global_head_dim: its __post_init__'s default)
DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "head_dim": 256, "attention_bias": False, "sliding_window": 512,
            "final_logit_softcapping": None, "use_bidirectional_attention": None, "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 262_144,
            "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
            "use_double_wide_mlp": False, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None}
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig.__post_init__'s default of global_head_dim
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def _refuse_unsupported(c: HfConfig) -> None:
    c.reject("attention_bias", "the q/k/v/o linears have biases")
    if c.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": image tokens only; text is causal
        raise c.error("use_bidirectional_attention", "gemma4: bidirectional attention over text ('all') is not "
                                                     "supported: lmkit runs causal attention")


def _global_layer_shape(c: HfConfig, types: list[str], head_dim: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """Per layer (head_dim, KV heads): per_layer_config's overrides when the file has them, else global_head_dim
    and (with attention_k_eq_v) num_global_key_value_heads on the full_attention layers, as the config class."""
    n = len(types)
    dims, heads = [head_dim] * n, [kv_heads] * n
    per_layer = c.raw.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise c.error("per_layer_config", "it must map layer indices to head_dim / num_key_value_heads")
        for key, override in per_layer.items():
            if not (str(key).isdigit() and int(key) < n and isinstance(override, dict)) or \
                    set(override) - {"head_dim", "num_key_value_heads"}:
                raise c.error("per_layer_config", f"entry {key!r}: lmkit reads layer indices < {n} with head_dim "
                                                  "and num_key_value_heads")
            dims[int(key)] = int(override.get("head_dim", head_dim))
            heads[int(key)] = int(override.get("num_key_value_heads", kv_heads))
        return dims, heads
    global_dim = int(c.raw.get("global_head_dim", GLOBAL_HEAD_DIM))
    global_heads = c.raw.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
    for i, t in enumerate(types):
        if t == "full_attention":
            dims[i] = global_dim
            heads[i] = int(global_heads) if global_heads is not None else kv_heads
    return dims, heads


def read_config(c: HfConfig) -> ModelFields:
    if c.raw.get("model_type", "gemma4_text") != "gemma4_text":
        raise c.error("model_type", "lmkit serves the Gemma 4 text model (model_type gemma4_text)")
    _refuse_unsupported(c)
    shape = shape_fields(c)
    n, head_dim, kv_heads = shape["num_layers"], shape["head_dim"], shape["num_kv_heads"]
    types = layer_types(c, n, lambda i: "sliding_attention" if (i + 1) % 6 else "full_attention")
    types[-1] = "full_attention"  # Gemma4TextConfig forces it (with a warning)
    dims, heads = _global_layer_shape(c, types, head_dim, kv_heads)
    global_dims = {d for d, t in zip(dims, types) if t == "full_attention"}
    local_dims = {d for d, t in zip(dims, types) if t == "sliding_attention"}
    if len(global_dims) > 1 or len(local_dims) > 1:
        raise c.error("per_layer_config", "lmkit needs one head_dim per layer type (one rotary table each)")
    params = c.raw.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in set(types)):
        raise c.error("rope_parameters", "it must hold one dict per layer type")
    rope, _ = layer_type_rope(c, global_dims.pop(), params["full_attention"], 1_000_000.0)
    rope_local = None
    if local_dims:
        rope_local, _ = layer_type_rope(c, local_dims.pop(), params["sliding_attention"], 10_000.0)
    k_eq_v = bool(c.get("attention_k_eq_v"))
    e_model = _e_model_fields(c, types, int(shape["vocab_size"]), int(shape["intermediate_size"]))
    moe = {}
    if c.get("enable_moe_block"):
        experts, top_k = int(c.require("num_experts")), int(c.require("top_k_experts"))
        moe = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(c.require(
            "moe_intermediate_size")), norm_topk_prob=True, layer_moe=[1] * n, moe_beside_mlp=True)
    return ModelFields(**moe, **shape, **e_model, hidden_act=activation(c, "hidden_activation", GELU_TANH),
                       embed_scale=gemma_embed_scale(shape["hidden_size"]), attn_scale=1.0, has_qk_norm=True,
                       rope=rope, rope_local=rope_local,
                       layer_rope=[ROPE_LOCAL if t == "sliding_attention" else ROPE_GLOBAL for t in types],
                       layer_sliding_window=windows_of(types, c.get("sliding_window")),
                       final_logit_softcap=softcap(c.get("final_logit_softcapping")),
                       layer_head_dim=dims if len(set(dims)) > 1 else [],
                       layer_num_kv_heads=heads if len(set(heads)) > 1 else [],
                       layer_v_from_k=[int(k_eq_v and t == "full_attention") for t in types] if k_eq_v else [],
                       has_v_norm=True, has_layer_scalar=True)


def kv_sources(c: HfConfig, types: list[str]) -> list[int]:
    """Per layer, the layer whose KV cache it reads (transformers' kv_sharing_modes): the last num_kv_shared_layers
    layers read the last earlier layer of their own type; every other layer its own."""
    n, shared = len(types), int(c.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise c.error("num_kv_shared_layers", f"gemma4: num_kv_shared_layers must be in [0, num_hidden_layers = "
                                              f"{n}): some layer must keep its own KV cache")
    first = n - shared
    last_of = {t: i for i, t in enumerate(types[:first])}
    sources = list(range(n))
    for i in range(first, n):
        if types[i] not in last_of:
            raise c.error("num_kv_shared_layers", f"gemma4: layer {i} ({types[i]}) shares the KV cache of no "
                                                  "earlier layer of its type")
        sources[i] = last_of[types[i]]
    return sources


def _e_model_fields(c: HfConfig, types: list[str], vocab: int, inter: int) -> dict:
    """The E-models' fields: per-layer embeddings, KV sources, the KV-sharing layers' doubled MLP."""
    fields = {}
    per_layer = int(c.get("hidden_size_per_layer_input") or 0)
    if per_layer:
        ple_vocab = int(c.get("vocab_size_per_layer_input"))
        if ple_vocab != vocab:
            raise c.error("vocab_size_per_layer_input", f"gemma4: lmkit needs the per-layer embeddings' vocabulary "
                                                        f"to be vocab_size ({vocab}), got {ple_vocab}")
        fields["per_layer_input_size"] = per_layer
    sources = kv_sources(c, types)
    if sources != list(range(len(types))):
        fields["layer_kv_source"] = sources
        if c.get("use_double_wide_mlp"):
            fields["layer_intermediate_size"] = [inter * (2 if s != i else 1) for i, s in enumerate(sources)]
    return fields


def gemma4_awq_map(name: str) -> AwqMap:
    """Gemma's layer with plain-w norms and the output times layer_scalar. v_proj's output goes through a
    per-head norm before o_proj: o_proj is quantized and clipped, never smoothed; a global layer with
    attention_k_eq_v has no v_proj (its group is q, k). The MoE form (26B-A4B): the dense MLP's groups as here, every
    expert's gate and up on pre_feedforward_layernorm_2, each expert's up -> down (lmkit.lite.moe, beside_mlp); the
    router (proj, scale, per-expert scale) stays fp16, as AutoAWQ and llm-compressor leave routers: it reads the
    residual through its own weightless norm, so no smoothing scale reaches it."""
    groups = (
        SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", fold=False),
        SmoothGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    return AwqMap(name, groups, (("input_layernorm", "self_attn"), ("pre_feedforward_layernorm", "mlp")),
                  post_norms={"self_attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
                  layer_scalar="layer_scalar",
                  # E-models: the per-layer-input gate and projection stay fp16 (small: 2 x hidden x 256 a layer of
                  # E2B's, and read in no group: the gate's input is the un-normed residual, nothing folds into it;
                  # the projection's input is gated by the activation), as are the per-layer embedding table and
                  # its model projection outside the layers (a table lookup, and one projection per token)
                  fp_linears=("per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"),
                  moe=MoeLayout(block="", checkpoint_block="", router="router.proj",
                                norm="pre_feedforward_layernorm_2", beside_mlp=True))


# KV calibration: transformers' attention functions see K after its norm and RoPE and V after its norm, where the
# engine quantizes them; the final soft-cap after the head. (The E-models' KV sharing is refused by lite.kvcalib.)
KV_CALIB = KvCalibHooks(final_logit_softcap="final_logit_softcapping")
ARCHITECTURE = Architecture(NAME, "gemma", KEY_MAP, read_config, DEFAULTS, gemma4_awq_map(NAME), KV_CALIB)

# The checkpoints Google ships: Gemma4ForConditionalGeneration, the text model under model.language_model and its
# config under text_config, beside vision and audio towers (left unread: lmkit serves text).
NAME_MULTIMODAL = "Gemma4ForConditionalGeneration"
MULTIMODAL_ARCHITECTURE = multimodal_architecture(
    NAME_MULTIMODAL, ARCHITECTURE,
    unused=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."))
