"""Qwen2 (Qwen2ForCausalLM): Llama's layer with q/k/v biases; a sliding window, when use_sliding_window, on
the layers layer_types marks (default: from max_window_layers on)."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, layer_types, shape_fields, windows_of
from lmkit.models.awq_map import pre_norm_awq_map
from lmkit.models.llama import KEY_MAP as LLAMA_KEY_MAP, QKV_BIAS_LAYER, layer_keys

NAME = "Qwen2ForCausalLM"
KEY_MAP = {**LLAMA_KEY_MAP, **layer_keys(QKV_BIAS_LAYER)}
# transformers.Qwen2Config's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
            "max_window_layers": 28}


def sliding_windows(c: HfConfig, num_layers: int) -> list[int]:
    """Qwen2/Qwen3 per-layer windows as their config classes and attention modules decide them."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    first = int(c.get("max_window_layers"))
    types = layer_types(c, num_layers,
                        lambda i: "sliding_attention" if window is not None and i >= first else "full_attention")
    return windows_of(types, window)


def read_config(c: HfConfig) -> ModelFields:
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), has_qkv_bias=True, rope=rope,
                       rotary_dim=rotary_dim, layer_rope=[ROPE_GLOBAL] * n,
                       layer_sliding_window=sliding_windows(c, n))


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, pre_norm_awq_map(NAME))
