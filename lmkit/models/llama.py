"""Llama (LlamaForCausalLM): the pre-norm decoder the other "llama"-family modules build on. Llama 3.1/3.2 rope
(llama3), linear and yarn scaling; head_dim may differ from hidden_size / heads."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import pre_norm_awq_map

NAME = "LlamaForCausalLM"


def layer_keys(modules: dict[str, str]) -> dict[str, str]:
    """Engine role -> HF tensor name for per-layer ``modules`` (role -> tensor path inside model.layers.{i})."""
    return {f"layers.{{i}}.{role}": f"model.layers.{{i}}.{path}" for role, path in modules.items()}


MODEL_KEYS = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
PRE_NORM_LAYER = {
    "input_norm": "input_layernorm.weight",
    "pre_mlp_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
QKV_BIAS_LAYER = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                  "v_bias": "self_attn.v_proj.bias"}
QK_NORM_LAYER = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
KEY_MAP = {**MODEL_KEYS, **layer_keys(PRE_NORM_LAYER)}

# transformers.LlamaConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False}


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "o_proj has a bias (lmkit has q/k/v biases only)")
    c.reject("mlp_bias", "the MLP linears have biases")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[0] * n)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, pre_norm_awq_map(NAME))
