"""Qwen3.5 / Qwen3.6 dense (Qwen3_5ForCausalLM, and the text model of Qwen3_5ForConditionalGeneration): a hybrid of
recurrent Gated DeltaNet layers and gated full-attention layers (by default three of the first for each one of the
second). Attention layers: an output gate in q_proj (each head's query rows, then its gate rows), per-head q/k
RMSNorms, partial RoPE (a quarter of head_dim; Qwen3.5's multimodal RoPE is plain RoPE for text), no KV
window. Every RMSNorm scales by (1 + w) except the Gated DeltaNet's own output norm (plain w). The MLP is
Llama's."""

from __future__ import annotations

import dataclasses

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import AwqMap, SmoothGroup
from lmkit.models.llama import KEY_MAP as LLAMA_KEY_MAP, QK_NORM_LAYER, layer_keys

NAME = "Qwen3_5ForCausalLM"
LINEAR_ATTENTION_LAYER = {
    "in_proj_qkv": "linear_attn.in_proj_qkv.weight",
    "in_proj_z": "linear_attn.in_proj_z.weight",
    "in_proj_b": "linear_attn.in_proj_b.weight",
    "in_proj_a": "linear_attn.in_proj_a.weight",
    "out_proj": "linear_attn.out_proj.weight",
    "conv1d": "linear_attn.conv1d.weight",
    "dt_bias": "linear_attn.dt_bias",
    "A_log": "linear_attn.A_log",
    "linear_norm": "linear_attn.norm.weight",
}
MTP_HEAD = {
    "mtp.fc": "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding": "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden": "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm": "mtp.norm.weight",
}


def mtp_keys(key_map: dict[str, str]) -> dict[str, str]:
    """The multi-token-prediction head's keys (mtp.*, as Qwen ships them beside the model in every Qwen3.5 and
    Qwen3-Next checkpoint; vLLM's and SGLang's qwen3_5_mtp / qwen3_next_mtp read the same names): mtp.fc [hidden,
    2 hidden] over [pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(hidden)], mtp.norm, and per MTP layer
    mtp.layers.{i}. + a full-attention layer's tensors of ``key_map`` (its attention, and its MLP or experts); "{i}"
    runs over the MTP layers (ModelFields.mtp_num_layers, which the engine reads)."""
    layers = {f"mtp.{role}": "mtp." + key[len("model."):] for role, key in key_map.items()
              if key.startswith("model.layers.{i}.") and ".linear_attn." not in key}
    return {**MTP_HEAD, **layers}


# Every layer's keys: a layer has either the attention ones or the linear-attention ones (roles absent from a
# checkpoint are left out; the engine asks each layer for its kind's); and the MTP head's.
TEXT_KEY_MAP = {**LLAMA_KEY_MAP, **layer_keys(QK_NORM_LAYER), **layer_keys(LINEAR_ATTENTION_LAYER)}
KEY_MAP = {**TEXT_KEY_MAP, **mtp_keys(TEXT_KEY_MAP)}
# transformers.Qwen3_5TextConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "head_dim": 256, "attention_bias": False, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "partial_rotary_factor": 0.25, "full_attention_interval": 4}
LAYER_KINDS = ("linear_attention", "full_attention")


def layer_recurrent(c: HfConfig, num_layers: int) -> list[int]:
    """Per layer 1 for a Gated DeltaNet layer, 0 for full attention: layer_types, else every
    full_attention_interval-th layer full (transformers' rule)."""
    interval = int(c.get("full_attention_interval"))
    types = c.raw.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                         for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_KINDS for t in types):
        raise c.error("layer_types", f"need {num_layers} entries of {', '.join(LAYER_KINDS)}")
    return [int(t == "linear_attention") for t in types]


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "it puts biases on q/k/v/o_proj (lmkit has q/k/v biases only)")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), has_qk_norm=True, rope=rope,
                       rotary_dim=rotary_dim, layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[0] * n,
                       norm_weight_offset=1.0, attn_output_gate=True, layer_recurrent=layer_recurrent(c, n),
                       linear_num_key_heads=int(c.require("linear_num_key_heads")),
                       linear_num_value_heads=int(c.require("linear_num_value_heads")),
                       linear_key_head_dim=int(c.require("linear_key_head_dim")),
                       linear_value_head_dim=int(c.require("linear_value_head_dim")),
                       linear_conv_kernel=int(c.require("linear_conv_kernel_dim")),
                       mtp_num_layers=mtp_num_layers(c))


def mtp_num_layers(c: HfConfig) -> int:
    """The MTP head's layers: mtp_num_hidden_layers as Qwen's config.json files carry it (transformers' config
    classes do not know the field, and drop mtp.* on load); 0 when absent."""
    n = c.raw.get("mtp_num_hidden_layers") or 0
    if not isinstance(n, int) or n < 0:
        raise c.error("mtp_num_hidden_layers", "it must be a count of layers (>= 0)")
    return n


def qwen3_5_awq_map(name: str) -> AwqMap:
    """A layer of either kind: input_layernorm -> self_attn (q with its gate rows, k, v; v -> o where the shapes
    allow: the output gate multiplies channel by channel) or -> linear_attn (in_proj_qkv and in_proj_z quantized;
    in_proj_b and in_proj_a, the inputs of beta and the decay, take the scale and stay in fp16, as routers do).
    out_proj is clipped, never smoothed: a short convolution, SiLU, the delta rule and a per-head gated norm lie
    between in_proj_qkv and it. Norms scale by (1 + w). (lmkit.lite.moe.layer_awq_map keeps each layer's kind.)"""
    groups = (
        SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothGroup("input_layernorm", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), "linear_attn",
                    dense=("linear_attn.in_proj_b", "linear_attn.in_proj_a")),
        SmoothGroup("linear_attn.norm", ("linear_attn.out_proj",), "linear_attn.out_proj", fold=False),
        SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    return AwqMap(name, groups, (("input_layernorm", "self_attn"), ("input_layernorm", "linear_attn"),
                                 ("post_attention_layernorm", "mlp")), norm_weight_offset=1.0)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, qwen3_5_awq_map(NAME))

# The checkpoints Qwen ships: Qwen3_5ForConditionalGeneration, the text model under model.language_model and its
# config under text_config, beside a vision tower (left unread: lmkit serves text) and the multi-token-prediction
# head (mtp.*: loaded by the engine through the key map, run by nobody yet; lite carries it over as it is).
NAME_MULTIMODAL = "Qwen3_5ForConditionalGeneration"


def multimodal_architecture(name: str, text: Architecture, unused: tuple[str, ...] = ("model.visual.", "mtp.")) \
        -> Architecture:
    """The ``name``ForConditionalGeneration checkpoint of a text architecture ``text``: its tensors under
    model.language_model, its config under text_config; the tensors under ``unused`` (Qwen: the vision tower and
    the MTP head) outside the text model, carried over as they are by lite (which quantizes the text model with
    ``text``'s AWQ table); the engine reads those of them its key map names (the MTP head, mtp_keys)."""
    key_map = {role: key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
               for role, key in text.key_map.items()}

    def read_multimodal_config(c: HfConfig) -> ModelFields:
        cfg = c.get("text_config")
        if not isinstance(cfg, dict):
            raise c.error("text_config", "it must be the text model's config (a JSON object)")
        fields = text.read_config(HfConfig(cfg, text.config_defaults, c.architecture))
        fields.tie_word_embeddings = bool(c.raw.get("tie_word_embeddings", fields.tie_word_embeddings))
        return fields

    awq_map = None if text.awq_map is None else dataclasses.replace(text.awq_map, architecture=name)
    return Architecture(name, text.family, key_map, read_multimodal_config, text.config_defaults, awq_map,
                        kv_calib=text.kv_calib, unused_tensors=unused, text_prefix="model.language_model.")


MULTIMODAL_ARCHITECTURE = multimodal_architecture(NAME_MULTIMODAL, ARCHITECTURE)
