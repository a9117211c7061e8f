"""Mistral (MistralForCausalLM): Llama's layer with one sliding window on every layer (Mistral 7B v0.1);
Mistral-Nemo's head_dim differs from hidden_size / heads."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope, shape_fields
from lmkit.models.awq_map import pre_norm_awq_map
from lmkit.models.llama import KEY_MAP

NAME = "MistralForCausalLM"
# transformers.MistralConfig's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "sliding_window": 4096}


def read_config(c: HfConfig) -> ModelFields:
    # HF's Mistral has no biases whatever the config says, and ignores layer_types (it warns).
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[int(c.get("sliding_window") or 0)] * n)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, pre_norm_awq_map(NAME))
