"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): a pre-norm layer with fused qkv_proj (rows q | k | v) and
gate_up_proj (rows gate | up); partial rotary (partial_rotary_factor: Phi-4-mini rotates 3/4 of each head);
longrope scaling (short and long factors); one sliding window on every layer when sliding_window is set.

HF switches longrope's factors by the current sequence length; the engine picks one table per session (see
RopeTable.for_session): ModelSpec.to_engine_config(session_len).
"""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, ModelFields, activation, \
    global_rope_parameters, rope_of, shape_fields
from lmkit.models.awq_map import AwqMap, SmoothGroup
from lmkit.models.llama import MODEL_KEYS, layer_keys

NAME = "Phi3ForCausalLM"
PHI3_LAYER = {
    "input_norm": "input_layernorm.weight",
    "pre_mlp_norm": "post_attention_layernorm.weight",
    "qkv_proj": "self_attn.qkv_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_up_proj": "mlp.gate_up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
KEY_MAP = {**MODEL_KEYS, **layer_keys(PHI3_LAYER)}
# transformers.Phi3Config's defaults of the fields read here
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None}

# The fused linears fold a scale into their last rows: the v rows (only when v is as wide as o's input: no
# GQA) and the up half. q/k rows amplify their error through the softmax: qkv_proj is not clipped.
AWQ_MAP = AwqMap(
    NAME,
    (
        SmoothGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        SmoothGroup("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        SmoothGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
    no_clip=("self_attn.qkv_proj",),
)


def read_config(c: HfConfig) -> ModelFields:
    shape = shape_fields(c)
    params = global_rope_parameters(c)
    params.setdefault("partial_rotary_factor", 1.0)
    if params["rope_type"] in ("su", "yarn"):  # Phi3Config reads both legacy names as longrope
        params["rope_type"] = "longrope"
    if params["rope_type"] == "longrope":  # a Phi3Config field: it wins over the rope dict's
        params["original_max_position_embeddings"] = int(c.get("original_max_position_embeddings"))
    rope, rotary_dim = rope_of(c, params, shape["head_dim"])
    n = shape["num_layers"]
    return ModelFields(**shape, hidden_act=activation(c, "hidden_act", SILU), rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=[int(c.get("sliding_window") or 0)] * n)


ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, AWQ_MAP)
