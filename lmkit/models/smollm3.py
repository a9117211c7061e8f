"""SmolLM3 (SmolLM3ForCausalLM): Llama's layer with RoPE left out on some layers (no_rope_layers: 1 = RoPE,
default every fourth layer without); a sliding window, when use_sliding_window, on the layers layer_types marks
(default: the no-RoPE ones)."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, ROPE_NONE, SILU, Architecture, HfConfig, ModelFields, \
    activation, global_rope, layer_types, shape_fields
from lmkit.models.awq_map import pre_norm_awq_map
from lmkit.models.llama import KEY_MAP

NAME = "SmolLM3ForCausalLM"
# transformers.SmolLM3Config's defaults of the fields read here (its default_theta is 2e6)
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
            "no_rope_layer_interval": 4, "attention_bias": False, "mlp_bias": False}
DEFAULT_THETA = 2_000_000.0


def read_config(c: HfConfig) -> ModelFields:
    c.reject("attention_bias", "it puts a bias on o_proj as well (lmkit has q/k/v biases only)")
    c.reject("mlp_bias", "the MLP linears have biases")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"], DEFAULT_THETA)
    n = shape["num_layers"]
    interval = int(c.get("no_rope_layer_interval"))
    uses_rope = c.raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise c.error("no_rope_layers", f"need {n} entries")
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    types = layer_types(c, n, lambda i: "sliding_attention" if window is not None and not uses_rope[i]
                        else "full_attention")
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL if r else ROPE_NONE for r in uses_rope],
                       layer_sliding_window=[int(window or 0) if t == "sliding_attention" else 0 for t in types])


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, pre_norm_awq_map(NAME))
