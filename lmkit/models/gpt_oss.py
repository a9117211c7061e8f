"""gpt-oss (GptOssForCausalLM, gpt-oss-20b / 120b): a pre-norm decoder whose attention has q/k/v/o biases and a
learned sink logit per head (attention sinks), alternating sliding-window (128) and full layers, yarn RoPE; every
MLP a mixture of experts (32 / 128, top 4): a router with a bias whose top-k logits are softmaxed, experts with
biases and the clamped SwiGLU ((clamp(up) + 1) * g sigmoid(1.702 g), g = min(gate, 7)), gate and up interleaved.
Experts as shipped in MXFP4 (``*_blocks`` / ``*_scales``), as transformers holds them in a float dtype, or as
llama.cpp's GGUF files hold them (gate, up and down apart, MXFP4 blocks of its own layout: lmkit/models/gguf_file.py)."""

from __future__ import annotations

from lmkit.models.architecture import ROPE_GLOBAL, SILU, Architecture, HfConfig, KvCalibHooks, ModelFields, \
    global_rope, layer_types, shape_fields, windows_of
from lmkit.models.awq_map import PRE_NORM_GROUPS, PRE_NORM_RESIDUALS, AwqMap, MoeLayout
from lmkit.models.llama import MODEL_KEYS, PRE_NORM_LAYER, QKV_BIAS_LAYER, layer_keys

NAME = "GptOssForCausalLM"
ATTENTION_LAYER = {role: key for role, key in PRE_NORM_LAYER.items() if not key.startswith("mlp.")}
EXPERTS = "mlp.experts."
MOE_LAYER = {
    "router": "mlp.router.weight",
    "router_bias": "mlp.router.bias",
    "experts.gate_up_proj": EXPERTS + "gate_up_proj",  # [E, hidden, 2 inter], gate and up columns interleaved
    "experts.down_proj": EXPERTS + "down_proj",  # [E, inter, hidden]
    "experts.gate_up_proj_blocks": EXPERTS + "gate_up_proj_blocks",  # MXFP4 [E, 2 inter, hidden / 32, 16]
    "experts.gate_up_proj_scales": EXPERTS + "gate_up_proj_scales",
    "experts.down_proj_blocks": EXPERTS + "down_proj_blocks",
    "experts.down_proj_scales": EXPERTS + "down_proj_scales",
    "experts.gate_up_bias": EXPERTS + "gate_up_proj_bias",
    "experts.down_bias": EXPERTS + "down_proj_bias",
    # llama.cpp's GGUF files: gate and up apart, each as one tensor of every expert ([E, inter, hidden], MXFP4 or
    # float), named as the gguf package's table knows them
    "experts.gate_exps": EXPERTS + "gate_proj.weight",
    "experts.up_exps": EXPERTS + "up_proj.weight",
    "experts.down_exps": EXPERTS + "down_proj.weight",
    "experts.gate_exps_bias": EXPERTS + "gate_proj.bias",
    "experts.up_exps_bias": EXPERTS + "up_proj.bias",
    "experts.down_exps_bias": EXPERTS + "down_proj.bias",
    # lmkit lite awq's checkpoints: one int4 linear per expert, gate and up apart, each with its bias (lmkit.lite.moe)
    "experts.{e}.gate_proj": EXPERTS + "{e}.gate_proj.weight",
    "experts.{e}.up_proj": EXPERTS + "{e}.up_proj.weight",
    "experts.{e}.down_proj": EXPERTS + "{e}.down_proj.weight",
    "experts.{e}.gate_bias": EXPERTS + "{e}.gate_proj.bias",
    "experts.{e}.up_bias": EXPERTS + "{e}.up_proj.bias",
    "experts.{e}.down_bias": EXPERTS + "{e}.down_proj.bias",
}
KEY_MAP = {**MODEL_KEYS, **layer_keys({**ATTENTION_LAYER, **QKV_BIAS_LAYER, "o_bias": "self_attn.o_proj.bias",
                                       "sinks": "self_attn.sinks", **MOE_LAYER})}
# transformers.GptOssConfig's defaults of the fields read here (its rope_parameters default: yarn, below)
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4,
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "head_dim": 64,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}}


def read_config(c: HfConfig) -> ModelFields:
    if c.get("hidden_act") not in SILU:
        raise c.error("hidden_act", "gpt-oss's experts use the clamped SwiGLU of silu")
    if not c.get("attention_bias"):
        raise c.error("attention_bias", "gpt-oss's q/k/v/o projections have biases")
    shape = shape_fields(c)
    rope, rotary_dim = global_rope(c, shape["head_dim"], default_theta=150000.0)
    n = shape["num_layers"]
    # GptOssConfig: sliding layers first, alternating
    types = layer_types(c, n, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    experts = int(c.get("num_local_experts") if "num_experts" not in c.raw else c.raw["num_experts"])
    return ModelFields(**shape, hidden_act="clamped_swiglu", rope=rope, rotary_dim=rotary_dim,
                       layer_rope=[ROPE_GLOBAL] * n, layer_sliding_window=windows_of(types, c.get("sliding_window")),
                       has_qkv_bias=True, has_o_bias=True, attention_sinks=True, num_experts=experts,
                       num_experts_per_tok=int(c.get("num_experts_per_tok")),
                       moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=True, layer_moe=[1] * n,
                       moe_biases=True, experts_interleaved=True, swiglu_alpha=float(c.get("swiglu_alpha")),
                       swiglu_limit=float(c.get("swiglu_limit")))


# KV calibration through its own eager attention (sdpa has no sinks: the attention passes them as s_aux)
KV_CALIB = KvCalibHooks(attention_function="transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward",
                        attention_mask="eager")
# AWQ: the pre-norm attention groups (q/k/v/o biases quantize as AutoAWQ's linears keep them: fp16 beside the int4
# weight; the sinks are per-head logits, not a linear: fp16) and every MLP sparse: each expert's gate and up in one
# group on post_attention_layernorm, the router (with its bias) taking the scale in fp16, as AutoAWQ and
# llm-compressor leave routers; each expert's down quantized and clipped but not smoothed (MoeLayout.smooth_down).
# MXFP4 experts are dequantized to float for calibration and requantized to int4 g{group size}.
AWQ_MAP = AwqMap(NAME, tuple(g for g in PRE_NORM_GROUPS if g.prev in ("input_layernorm", "self_attn.v_proj")),
                 PRE_NORM_RESIDUALS, moe=MoeLayout(router="router", interleaved=True, smooth_down=False))
ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, AWQ_MAP, kv_calib=KV_CALIB)
