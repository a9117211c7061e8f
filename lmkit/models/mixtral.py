"""Mixtral (MixtralForCausalLM): Mistral's attention and, on every layer, 8 experts of which each token uses 2
(softmax router, top-k probabilities renormalized to sum 1); the experts' size is intermediate_size. Checkpoint
names: block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import MoeLayout, pre_norm_awq_map
from lmkit.models.llama import MODEL_KEYS, PRE_NORM_LAYER, layer_keys
from lmkit.models.moe import moe_keys

NAME = "MixtralForCausalLM"
ATTENTION_LAYER = {role: key for role, key in PRE_NORM_LAYER.items() if not key.startswith("mlp.")}
KEY_MAP = {**MODEL_KEYS, **layer_keys(ATTENTION_LAYER), **moe_keys("block_sparse_moe", "w1", "w3", "w2")}
MOE_LAYOUT = MoeLayout(checkpoint_block="block_sparse_moe", expert_linears=("w1", "w3", "w2"))
# transformers.MixtralConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2}


def read_config(c: HfConfig) -> ModelFields:
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[int(c.get("sliding_window") or 0)] * n,
                       num_experts=int(c.get("num_local_experts")), num_experts_per_tok=int(c.get("num_experts_per_tok")),
                       moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=True, layer_moe=[1] * n)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS,
                            pre_norm_awq_map(NAME, MOE_LAYOUT))
