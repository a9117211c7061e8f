"""Qwen3-MoE (Qwen3MoeForCausalLM, Qwen3-30B-A3B): Qwen3's attention (per-head q/k norms, no biases) and, on
the sparse layers, 128 experts of which each token uses 8 (softmax router, top-k probabilities renormalized
with norm_topk_prob). A layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th one."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import MoeLayout, pre_norm_awq_map
from lmkit.models.moe import moe_keys
from lmkit.models.qwen3 import KEY_MAP as QWEN3_KEY_MAP

NAME = "Qwen3MoeForCausalLM"
KEY_MAP = {**QWEN3_KEY_MAP, **moe_keys("mlp")}
# transformers.Qwen3MoeConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": 4096, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": None}


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "it puts a bias on o_proj as well (lmkit has q/k/v biases only)")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    # the hub's config.json says num_experts; transformers 5 writes it as num_local_experts (an attribute alias)
    experts = int(c.raw["num_local_experts"] if "num_local_experts" in c.raw else c.get("num_experts"))
    step = int(c.get("decoder_sparse_step"))
    dense = set(c.get("mlp_only_layers") or [])
    layer_moe = [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(n)]
    # Qwen3MoeConfig: sliding_window only with use_sliding_window; its attention then windows every layer.
    window = int(c.get("sliding_window") or 0) if c.get("use_sliding_window") else 0
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), has_qk_norm=True, rope=rope,
                       rotary_dim=rotary_dim, layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[window] * n,
                       num_experts=experts, num_experts_per_tok=int(c.get("num_experts_per_tok")),
                       moe_intermediate_size=int(c.get("moe_intermediate_size")),
                       norm_topk_prob=bool(c.get("norm_topk_prob")), layer_moe=layer_moe)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS,
                            pre_norm_awq_map(NAME, MoeLayout()))
