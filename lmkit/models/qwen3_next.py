"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): the forerunner of Qwen3.5-MoE. The same layers
(lmkit/models/qwen3_5.py, lmkit/models/qwen3_5_moe.py) in another checkpoint layout: each Gated DeltaNet layer's
input projections are two fused linears grouped by key head (in_proj_qkvz: per key head its q, k, then its value
heads' v and z rows; in_proj_ba: per key head its value heads' b, then a rows; the loader reads them as
Qwen3.5's four), and, as in Qwen3-MoE, a layer is sparse unless listed in mlp_only_layers, every
decoder_sparse_step-th one, its router renormalizing the top-k only with norm_topk_prob. Sparse layers have
Qwen3.5-MoE's shared expert; dense ones Llama's MLP of intermediate_size."""

from __future__ import annotations

from lmkit.models import qwen3_5, qwen3_5_moe
from lmkit.models.architecture import Architecture, HfConfig, ModelFields
from lmkit.models.awq_map import AwqMap, MoeLayout, SmoothGroup
from lmkit.models.llama import layer_keys
from lmkit.models.moe import fused_moe_keys, moe_keys

NAME = "Qwen3NextForCausalLM"
FUSED_LINEAR_ATTENTION = {
    "in_proj_qkvz": "linear_attn.in_proj_qkvz.weight",
    "in_proj_ba": "linear_attn.in_proj_ba.weight",
}
TEXT_KEY_MAP = {**qwen3_5.TEXT_KEY_MAP, **layer_keys(FUSED_LINEAR_ATTENTION), **moe_keys("mlp"),
                **fused_moe_keys("mlp"), **layer_keys(qwen3_5_moe.SHARED_EXPERT_LAYER)}
# with the MTP head Qwen ships (mtp.*, qwen3_5.mtp_keys): one layer shaped as the last full-attention one
KEY_MAP = {**TEXT_KEY_MAP, **qwen3_5.mtp_keys(TEXT_KEY_MAP)}
# transformers.Qwen3NextConfig's defaults of the fields read here
DEFAULTS = {**qwen3_5.DEFAULTS, "intermediate_size": 5632, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": None}


def read_config(c: HfConfig) -> ModelFields:
    fields = qwen3_5.read_config(c)
    experts = int(c.require("num_experts"))
    step = int(c.require("decoder_sparse_step"))
    dense = set(c.get("mlp_only_layers") or [])
    layer_moe = [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(fields.num_layers)]
    if not any(layer_moe):
        return fields
    return qwen3_5_moe.read_experts(c, fields, layer_moe, norm_topk_prob=bool(c.get("norm_topk_prob")))


def qwen3_next_awq_map(name: str) -> AwqMap:
    """Qwen3.5's table (lmkit/models/qwen3_5.py) over the fused projections: in_proj_qkvz quantized, in_proj_ba
    (beta's and the decay's inputs) taking the scale in fp16; sparse layers with Qwen3.5-MoE's shared expert, dense
    ones (mlp_only_layers) Llama's MLP groups."""
    groups = (
        SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothGroup("input_layernorm", ("linear_attn.in_proj_qkvz",), "linear_attn", dense=("linear_attn.in_proj_ba",)),
        SmoothGroup("linear_attn.norm", ("linear_attn.out_proj",), "linear_attn.out_proj", fold=False),
        SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    return AwqMap(name, groups, (("input_layernorm", "self_attn"), ("input_layernorm", "linear_attn"),
                                 ("post_attention_layernorm", "mlp")), norm_weight_offset=1.0,
                  moe=MoeLayout(shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"))


# KV calibration has no fake-quantized Gated DeltaNet layers yet: `lmkit lite calibrate` refuses it by name.
ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, qwen3_next_awq_map(NAME))
