"""How AWQ walks one architecture, as data: where the decoder layers are, how one layer is wired, and the
smoothing groups. Names are module paths inside one decoder layer (``model.layers.{i}`` of the HF model);
each architecture module (lmkit/models/<arch>.py) holds its table.

A smoothing group shares one input ``x`` between its ``linears``. AWQ divides ``x`` channel-wise by a
scale ``s`` (folded into ``prev``: the norm weight, or the output rows of the previous linear) and
multiplies the linears' input columns by ``s``, which leaves the fp function unchanged. The pre-norm
(Llama) layer:

    input_layernorm          -> q_proj, k_proj, v_proj      loss: output of self_attn
    self_attn.v_proj         -> o_proj                       loss: output of o_proj   (only when v's output
                                                             size equals o's input size: not with GQA)
    post_attention_layernorm -> gate_proj, up_proj           loss: output of mlp
    mlp.up_proj              -> down_proj                    loss: output of down_proj

Every quantized linear appears in exactly one group; a group whose ``prev`` cannot absorb the scale
(shape mismatch, or ``fold=False``: a norm between them) is still quantized and clipped, just not smoothed. A
layer that lacks some of a group's linears (Gemma 4's global layers without v_proj) leaves them out
(lmkit.lite.moe.layer_awq_map). A ``prev`` that is a fused linear
wider than the group's input (Phi-3 ``mlp.gate_up_proj -> mlp.down_proj``, ``self_attn.qkv_proj ->
self_attn.o_proj``) takes the scale on its LAST rows (the up half, the v rows), as AutoAWQ does.

Norms whose HF forward scales by ``(offset + weight)`` (Gemma: offset 1.0) fold a scale ``s`` as
``w' = (offset + w) / s - offset``.

Mixture-of-experts layers (``AwqMap.moe``; lmkit.lite.moe expands the groups per layer, since the number of
experts and which layers are sparse come from the model):

    post_attention_layernorm -> every expert's gate, up      loss: output of the sparse block (router included)
                                (the router reads x too: it takes the scale, stays fp)
    experts.{e}.up           -> experts.{e}.down             loss: output of that down, on the rows routed to e
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SmoothGroup:
    """Linears that read the same input, the module the scale folds into, and the block whose output
    error scores a candidate scale (the block's input is the linears' input)."""

    prev: str
    linears: tuple[str, ...]
    block: str
    # modules that read the same input and take the scale but are not quantized (an MoE router)
    dense: tuple[str, ...] = ()
    # the module whose input is the group's input, for the statistics (None: linears[0]; an MoE group: its
    # block, since one expert sees only the rows routed to it)
    input_of: str | None = None
    # False: prev's output is not the linears' input as it is (Gemma 4's v_proj -> a per-head norm -> o_proj):
    # the group is quantized and clipped, never smoothed
    fold: bool = True


@dataclass(frozen=True)
class MoeLayout:
    """Where a decoder layer keeps its sparse MLP, in the HF module tree and in checkpoints. transformers 5
    holds the experts as two 3D parameters; checkpoints (and AutoAWQ, and the engine) as one linear per expert
    under ``{checkpoint_block}.{experts}.{e}.{gate | up | down}``, which is what lite quantizes (lmkit.lite.moe)."""

    block: str = "mlp"  # the sparse block: router + experts
    checkpoint_block: str = "mlp"  # its name in checkpoints (Mixtral: block_sparse_moe)
    router: str = "gate"
    experts: str = "experts"
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    norm: str = "post_attention_layernorm"
    # a shared expert every token takes (Qwen3.5-MoE: an MLP in the block, scaled by sigmoid of a one-output linear):
    # its gate and up join the block's group, its up -> down is one more group; the gate linear stays fp
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    # gpt-oss: transformers holds the experts as gate_up_proj [E, H, 2I] (inputs first, gate and up columns
    # interleaved) and down_proj [E, I, H], each with a bias, and gates them with the clamped SwiGLU; checkpoints
    # (as lite writes them, and the engine) as one biased linear per expert, gate and up apart
    interleaved: bool = False
    # False: up -> down is not smoothed (quantized and clipped only): gpt-oss's clamped SwiGLU clamps up's output,
    # so a scale folded out of up's rows would not come back through the activation unchanged
    smooth_down: bool = True
    # Gemma 4's MoE form: the experts (``block`` "": the decoder layer's own ``experts`` and ``router``) run beside
    # the dense MLP on the same residual. The router reads the residual through its own norm, the experts through
    # ``norm``: the dense groups stay, the experts' gate/up group folds into ``norm`` alone (the router does not read
    # its output), and lite.moe adds the layer's combined feed-forward as one residual block
    beside_mlp: bool = False

    def path(self, name: str) -> str:
        """Module path of ``name`` in the sparse block, inside a decoder layer (``block`` "": the layer itself)."""
        return f"{self.block}.{name}" if self.block else name

    @property
    def shared_input(self) -> str:
        """The module whose input is the input of every expert's gate and up: the sparse block, or (beside_mlp) the
        experts themselves."""
        return self.path(self.experts) if self.beside_mlp else self.block


@dataclass(frozen=True)
class AwqMap:
    """How AWQ walks one architecture."""

    architecture: str
    groups: tuple[SmoothGroup, ...]
    # One decoder layer computes, in order, x = x + post(block(norm(x))) for each (norm, block) pair.
    residual_blocks: tuple[tuple[str, str], ...]
    # block -> the norm applied to the block's output before the residual add (Gemma); absent: identity.
    post_norms: dict[str, str] = field(default_factory=dict)
    # HF norms of this architecture scale by (offset + weight): Gemma 1.0.
    norm_weight_offset: float = 0.0
    # The block that needs the layer's attention arguments (mask, rotary embeddings, positions).
    attention: str = "self_attn"
    # Linears quantized without the clipping search: their error is amplified through the attention
    # softmax rather than seen in their own output (AutoAWQ and llm-awq skip them too).
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    # the sparse MLP of mixture-of-experts layers; ``groups`` then describe the layers without one
    moe: MoeLayout | None = None
    # a buffer of the decoder layer its output is multiplied by (Gemma 4: layer_scalar), or None
    layer_scalar: str | None = None
    # linears (module names, in a layer or outside) the checkpoint keeps in fp16, in no group
    fp_linears: tuple[str, ...] = ()

    def __hash__(self) -> int:  # post_norms is a dict; the name identifies the table
        return hash(self.architecture)

    @property
    def linears(self) -> tuple[str, ...]:
        """Every quantized linear of a decoder layer, in group order."""
        return tuple(name for group in self.groups for name in group.linears)


PRE_NORM_GROUPS = (
    SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
PRE_NORM_RESIDUALS = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))


def pre_norm_awq_map(architecture: str, moe: MoeLayout | None = None) -> AwqMap:
    """The table of a Llama-layout decoder layer (separate q/k/v and gate/up linears, two pre-norms); with
    ``moe``, of its mixture-of-experts form (the dense groups then describe layers with a dense MLP)."""
    return AwqMap(architecture, PRE_NORM_GROUPS, PRE_NORM_RESIDUALS, moe=moe)
