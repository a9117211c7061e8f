"""Qwen3 (Qwen3ForCausalLM): Llama's layer with per-head RMSNorms on q and k before RoPE, no biases, an
explicit head_dim; sliding windows as Qwen2."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import pre_norm_awq_map
from lmkit.models.llama import KEY_MAP as LLAMA_KEY_MAP, QK_NORM_LAYER, layer_keys
from lmkit.models.qwen2 import sliding_windows

NAME = "Qwen3ForCausalLM"
KEY_MAP = {**LLAMA_KEY_MAP, **layer_keys(QK_NORM_LAYER)}
# transformers.Qwen3Config's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "head_dim": 128, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": 4096, "max_window_layers": 28}


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "it puts a bias on o_proj as well (lmkit has q/k/v biases only)")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), has_qk_norm=True, rope=rope,
                       rotary_dim=rotary_dim, layer_rope=[ROPE_GLOBAL] * n,
                       layer_sliding_window=sliding_windows(c, n))


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, pre_norm_awq_map(NAME))
