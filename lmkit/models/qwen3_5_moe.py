"""Qwen3.5 / Qwen3.6 mixture of experts (Qwen3_5MoeForCausalLM, and the text model of
Qwen3_5MoeForConditionalGeneration: Qwen3.5-35B-A3B ... 397B-A17B): Qwen3.5's hybrid of Gated DeltaNet and gated
full-attention layers (lmkit/models/qwen3_5.py), with every layer's MLP a mixture of experts: a softmax router
whose top-k probabilities are renormalized to sum 1, and a shared expert every token takes, scaled by
sigmoid(shared_expert_gate . x) and added to the routed sum. There is no dense MLP (no intermediate_size)."""

from __future__ import annotations

import dataclasses

from lmkit.models import qwen3_5
from lmkit.models.architecture import Architecture, HfConfig, ModelFields
from lmkit.models.awq_map import MoeLayout
from lmkit.models.llama import layer_keys
from lmkit.models.moe import fused_moe_keys, moe_keys

NAME = "Qwen3_5MoeForCausalLM"
SHARED_EXPERT_LAYER = {
    "shared_expert.gate_proj": "mlp.shared_expert.gate_proj.weight",
    "shared_expert.up_proj": "mlp.shared_expert.up_proj.weight",
    "shared_expert.down_proj": "mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
}
# per-expert tensors (what transformers 5.24 saves) or the fused pair Qwen ships
TEXT_KEY_MAP = {**qwen3_5.TEXT_KEY_MAP, **moe_keys("mlp"), **fused_moe_keys("mlp"),
                **layer_keys(SHARED_EXPERT_LAYER)}
KEY_MAP = {**TEXT_KEY_MAP, **qwen3_5.mtp_keys(TEXT_KEY_MAP)}
# transformers.Qwen3_5MoeTextConfig's defaults of the fields read here (intermediate_size: it has none, every MLP
# being a mixture of experts; 0 tells the engine so)
DEFAULTS = {**qwen3_5.DEFAULTS, "intermediate_size": 0, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def read_experts(c: HfConfig, fields: ModelFields, layer_moe: list[int], norm_topk_prob: bool) -> ModelFields:
    """``fields`` with the MoE layers ``layer_moe`` of config ``c``: routed experts and the shared expert."""
    fields.layer_moe = layer_moe
    fields.num_experts = int(c.require("num_experts"))
    fields.num_experts_per_tok = int(c.require("num_experts_per_tok"))
    fields.moe_intermediate_size = int(c.require("moe_intermediate_size"))
    fields.shared_expert_intermediate_size = int(c.require("shared_expert_intermediate_size"))
    fields.norm_topk_prob = norm_topk_prob
    if fields.shared_expert_intermediate_size <= 0:
        raise c.error("shared_expert_intermediate_size", "every sparse layer of this family has a shared expert (> 0)")
    return fields


def read_config(c: HfConfig) -> ModelFields:
    fields = qwen3_5.read_config(c)
    # every layer sparse; Qwen3_5MoeTopKRouter always renormalizes the top-k probabilities
    return read_experts(c, fields, [1] * fields.num_layers, norm_topk_prob=True)


# AWQ: Qwen3.5's table with the sparse block (the shared expert beside the routed ones, lmkit.lite.moe); KV
# calibration has no fake-quantized Gated DeltaNet layers yet: `lmkit lite calibrate` refuses it by name.
AWQ_MAP = dataclasses.replace(qwen3_5.qwen3_5_awq_map(NAME), moe=MoeLayout(
    shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"))
ARCHITECTURE = Architecture(NAME, "llama", KEY_MAP, read_config, DEFAULTS, AWQ_MAP)
MULTIMODAL_ARCHITECTURE = qwen3_5.multimodal_architecture("Qwen3_5MoeForConditionalGeneration", ARCHITECTURE)
