"""Gemma 2 (Gemma2ForCausalLM): RMSNorms before and after each block, all scaling by (1 + w); GeGLU with tanh
GELU; embeddings times sqrt(hidden_size); queries scaled by query_pre_attn_scalar**-0.5; tanh soft-caps on
the attention scores and the final logits; sliding and full attention layers alternating (layer_types)."""

from __future__ import annotations

from lmkit.models.architecture import GELU_TANH, ROPE_GLOBAL, Architecture, HfConfig, KvCalibHooks, ModelFields, \
    activation, gemma_embed_scale, global_rope, layer_types, shape_fields, softcap, windows_of
from lmkit.models.awq_map import AwqMap, SmoothGroup
from lmkit.models.llama import MODEL_KEYS, layer_keys

NAME = "Gemma2ForCausalLM"
GEMMA_LAYER = {
    "input_norm": "input_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "pre_mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
KEY_MAP = {**MODEL_KEYS, **layer_keys(GEMMA_LAYER)}
# transformers.Gemma2Config's defaults of the fields read here
DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "head_dim": 256, "attention_bias": False, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
            "use_bidirectional_attention": None}


def gemma_awq_map(name: str) -> AwqMap:
    """Gemma's layer: x = x + post_attention_layernorm(self_attn(input_layernorm(x))), then
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))); norms scale by (1 + w)."""
    groups = (
        SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    return AwqMap(name, groups, (("input_layernorm", "self_attn"), ("pre_feedforward_layernorm", "mlp")),
                  post_norms={"self_attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
                  norm_weight_offset=1.0)


def gemma_fields(c: HfConfig) -> dict:
    """The fields Gemma 2 and Gemma 3 read alike (all but rope, windows and soft-caps)."""
    c.reject("attention_bias", "the q/k/v/o linears have biases")
    c.reject("use_bidirectional_attention", "lmkit runs causal attention only")
    shape = shape_fields(c)
    return dict(**shape, hidden_act=activation(c, "hidden_activation", GELU_TANH), norm_weight_offset=1.0,
                embed_scale=gemma_embed_scale(shape["hidden_size"]),
                attn_scale=float(c.require("query_pre_attn_scalar")) ** -0.5)


def read_config(c: HfConfig) -> ModelFields:
    fields = gemma_fields(c)
    rope, rotary_dim = global_rope(c, fields["head_dim"])
    n = fields["num_layers"]
    types = layer_types(c, n, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    return ModelFields(**fields, rope=rope, rotary_dim=rotary_dim, layer_rope=[ROPE_GLOBAL] * n,
                       layer_sliding_window=windows_of(types, c.get("sliding_window")),
                       attn_logit_softcap=softcap(c.get("attn_logit_softcapping")),
                       final_logit_softcap=softcap(c.get("final_logit_softcapping")))


# sdpa refuses soft-capped scores: KV calibration wraps Gemma 2's own eager attention (additive masks).
KV_CALIB = KvCalibHooks(attention_function="transformers.models.gemma2.modeling_gemma2.eager_attention_forward",
                        attention_mask="eager", final_logit_softcap="final_logit_softcapping")
ARCHITECTURE = Architecture(NAME, "gemma", KEY_MAP, read_config, DEFAULTS, gemma_awq_map(NAME), KV_CALIB)
