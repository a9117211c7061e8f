"""OLMoE (OlmoeForCausalLM): q/k RMSNorms over the whole q and k projections (not per head), and on every layer
64 experts of which each token uses 8 (softmax router, renormalized with norm_topk_prob); the experts' size is
intermediate_size. clip_qkv (clamping q, k, v) is refused."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import MoeLayout, pre_norm_awq_map
from lmkit.models.llama import MODEL_KEYS, PRE_NORM_LAYER, QK_NORM_LAYER, layer_keys
from lmkit.models.moe import moe_keys

NAME = "OlmoeForCausalLM"
ATTENTION_LAYER = {role: key for role, key in PRE_NORM_LAYER.items() if not key.startswith("mlp.")}
KEY_MAP = {**MODEL_KEYS, **layer_keys({**ATTENTION_LAYER, **QK_NORM_LAYER}), **moe_keys("mlp")}
# transformers.OlmoeConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None, "num_experts": 64,
            "num_experts_per_tok": 8, "norm_topk_prob": False}


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "o_proj has a bias (lmkit has q/k/v biases only)")
    c.reject("clip_qkv", "lmkit does not clamp q, k and v")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[0] * n, has_qk_norm=True,
                       qk_norm_whole=True, num_experts=int(c.get("num_experts")),
                       num_experts_per_tok=int(c.get("num_experts_per_tok")),
                       moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=bool(c.get("norm_topk_prob")),
                       layer_moe=[1] * n)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS,
                            pre_norm_awq_map(NAME, MoeLayout()))
