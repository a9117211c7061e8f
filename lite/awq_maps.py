"""Per-architecture AWQ knowledge as data: where the decoder layers are, how one layer is wired, and the
smoothing groups. Names are module paths inside one decoder layer (``model.layers.{i}`` of the HF model).

A smoothing group shares one input ``x`` between its ``linears``. AWQ divides ``x`` channel-wise by a
scale ``s`` (folded into ``prev``: the norm weight, or the output rows of the previous linear) and
multiplies the linears' input columns by ``s``, which leaves the fp function unchanged:

    input_layernorm          -> q_proj, k_proj, v_proj      loss: output of self_attn
    self_attn.v_proj         -> o_proj                       loss: output of o_proj   (only when v's output
                                                             size equals o's input size: not with GQA)
    post_attention_layernorm -> gate_proj, up_proj           loss: output of mlp
    mlp.up_proj              -> down_proj                    loss: output of down_proj

Every quantized linear appears in exactly one group; a group whose ``prev`` cannot absorb the scale
(shape mismatch) is still quantized and clipped, just not smoothed. Adding an architecture is one table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SmoothGroup:
    """Linears that read the same input, the module the scale folds into, and the block whose output
    error scores a candidate scale (the block's input is the linears' input)."""

    prev: str
    linears: tuple[str, ...]
    block: str


@dataclass(frozen=True)
class AwqMap:
    """How AWQ walks one architecture."""

    architecture: str
    groups: tuple[SmoothGroup, ...]
    # One decoder layer computes, in order, x = x + block(norm(x)) for each (norm, block) pair.
    residual_blocks: tuple[tuple[str, str], ...]
    # The block that needs the layer's attention arguments (mask, rotary embeddings, positions).
    attention: str = "self_attn"
    # Linears quantized without the clipping search: their error is amplified through the attention
    # softmax rather than seen in their own output (AutoAWQ and llm-awq skip them too).
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"

    @property
    def linears(self) -> tuple[str, ...]:
        """Every quantized linear of a decoder layer, in group order."""
        return tuple(name for group in self.groups for name in group.linears)


_LLAMA_GROUPS = (
    SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
_LLAMA_RESIDUALS = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))

AWQ_MAPS: dict[str, AwqMap] = {
    "LlamaForCausalLM": AwqMap("LlamaForCausalLM", _LLAMA_GROUPS, _LLAMA_RESIDUALS),
    "MistralForCausalLM": AwqMap("MistralForCausalLM", _LLAMA_GROUPS, _LLAMA_RESIDUALS),
    "Qwen2ForCausalLM": AwqMap("Qwen2ForCausalLM", _LLAMA_GROUPS, _LLAMA_RESIDUALS),  # q/k/v biases fold too
}


def get_awq_map(architecture: str) -> AwqMap:
    """The table for ``architecture``; ValueError listing the supported ones otherwise."""
    try:
        return AWQ_MAPS[architecture]
    except KeyError:
        raise ValueError(
            f"AWQ does not support architecture {architecture!r} yet; supported: {', '.join(sorted(AWQ_MAPS))} "
            "(adding one is a table in lmkit/lite/awq_maps.py)"
        ) from None
