"""Mixture-of-experts layers in lite. transformers 5 keeps a sparse block's experts as two 3D parameters
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); checkpoints, AutoAWQ and the engine
keep one linear per expert (``{block}.experts.{e}.gate_proj / up_proj / down_proj``; Mixtral
``block_sparse_moe.experts.{e}.w1 / w3 / w2``). lite works in the checkpoint's form: ``ExpertLinears``
replaces the 3D module by one ``nn.Linear`` per expert with the same forward, so that AWQ's hooks, searches,
folds and export see every expert's linears under the checkpoint's names, and an expert's hook sees exactly
the rows routed to it.

AWQ groups of a sparse layer (``layer_awq_map``; the architecture's ``AwqMap.groups`` describe its dense
layers, Qwen3-MoE's ``mlp_only_layers``):

    attention groups as in the dense layer
    post_attention_layernorm -> gate and up of every expert (the router takes the scale too, and stays fp);
        statistics over every token (the block's input), loss on the sparse block's output
    experts.{e}.up -> experts.{e}.down, one group per expert, on the rows routed to e

gpt-oss (``MoeLayout.interleaved``): transformers' gate_up_proj [E, H, 2I] holds gate and up in alternate columns,
inputs first, with biases; the per-expert linears are biased and gated by the clamped SwiGLU (``ClampedSwiGlu``), whose
clamp on up's output keeps up -> down unsmoothed. Gemma 4's MoE form (``beside_mlp``): the experts sit in the decoder
layer beside its dense MLP; ``BesideMlpFeedForward`` is the layer's whole feed-forward as one residual block (what the
decomposition checks) and ``BesideMlpExperts`` the experts as a function of their normed input (the gate/up group's
loss). Gemma 4's E-models: ``PerLayerInputBlock`` is the layer's per-layer-input residual block (its linears fp16).
The wrappers own no parameters: the checkpoint's names and the state dicts are the layer's own.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmkit.models import AwqMap, MoeLayout, SmoothGroup

ATTENTION_PREVS = ("input_layernorm", "self_attn.v_proj", "linear_attn.norm")  # the dense groups a sparse layer keeps


class _Expert(nn.Module):
    """One expert's gate, up and down linears under the checkpoint's names (gpt-oss: with biases)."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, bias: bool = False):
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=bias))
        setattr(self, up, nn.Linear(hidden, inter, bias=bias))
        setattr(self, down, nn.Linear(inter, hidden, bias=bias))


class ClampedSwiGlu:
    """gpt-oss's gated activation of (gate, up) apart: (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g =
    min(gate, limit) (transformers' GptOssExperts._apply_gate on its interleaved columns)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


class _ActTimesUp:
    """act(gate) * up: the gated activation of every other MoE family here."""

    def __init__(self, act_fn):
        self.act_fn = act_fn

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


class ExpertLinears(nn.Module):
    """The experts of one sparse block as per-expert linears (children "0", "1", ...); ``forward`` is
    transformers' expert loop (every expert some row picked: its rows, act(gate) * up, down, times the router
    weight, added)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn, names: tuple[str, str, str],
                 glu=None, bias: bool = False):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), _Expert(names, hidden, inter, bias))
        self.num_experts = num_experts
        self.names = names
        self.act_fn = act_fn
        self.glu = glu or _ActTimesUp(act_fn)  # (gate output, up output) -> the down projection's input

    def __len__(self) -> int:
        return self.num_experts

    def linear(self, e: int, which: int) -> nn.Linear:
        return getattr(getattr(self, str(e)), self.names[which])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]
            h = self.glu(self.linear(e, 0)(x), self.linear(e, 1)(x))
            y = self.linear(e, 2)(h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _unfuse_interleaved(fused: nn.Module, layout: MoeLayout) -> "ExpertLinears":
    """gpt-oss's experts (``MoeLayout.interleaved``): gate_up_proj [E, H, 2I] (inputs first, gate and up columns
    interleaved), down_proj [E, I, H], their biases, as per-expert linears with biases and the clamped SwiGLU."""
    num_experts, hidden, two_inter = fused.gate_up_proj.shape
    inter = two_inter // 2
    device = fused.gate_up_proj.device
    with torch.device(device):
        experts = ExpertLinears(num_experts, hidden, inter, None, layout.expert_linears,
                                glu=ClampedSwiGlu(fused.alpha, fused.limit), bias=True)
    if device.type != "meta":
        for e in range(num_experts):
            for which, cols in ((0, slice(0, None, 2)), (1, slice(1, None, 2))):
                experts.linear(e, which).weight.copy_(fused.gate_up_proj[e][:, cols].t())
                experts.linear(e, which).bias.copy_(fused.gate_up_proj_bias[e][cols])
            experts.linear(e, 2).weight.copy_(fused.down_proj[e].t())
            experts.linear(e, 2).bias.copy_(fused.down_proj_bias[e])
    return experts.to(fused.gate_up_proj.dtype)


def _is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and \
        isinstance(getattr(module, "down_proj", None), torch.Tensor)


@torch.no_grad()
def unfuse_experts(layer: nn.Module, layout: MoeLayout) -> bool:
    """Replace the 3D experts of ``layer``'s sparse block (if it has one) by ``ExpertLinears`` holding the same
    weights (on the meta device: shapes only). Returns whether the layer is sparse."""
    path = layout.path(layout.experts)
    try:
        fused = layer.get_submodule(path)
    except AttributeError:
        return False
    if isinstance(fused, ExpertLinears):
        return True
    if not _is_fused_experts(fused):
        return False
    if layout.interleaved:
        layer.get_submodule(layout.block).set_submodule(layout.experts, _unfuse_interleaved(fused, layout))
        return True
    if layout.beside_mlp:
        _add_beside_mlp_blocks(layer, layout)
    num_experts, two_inter, hidden = fused.gate_up_proj.shape
    inter = two_inter // 2
    device = fused.gate_up_proj.device
    with torch.device(device):
        experts = ExpertLinears(num_experts, hidden, inter, fused.act_fn, layout.expert_linears)
    if device.type != "meta":
        for e in range(num_experts):
            experts.linear(e, 0).weight.copy_(fused.gate_up_proj[e, :inter])
            experts.linear(e, 1).weight.copy_(fused.gate_up_proj[e, inter:])
            experts.linear(e, 2).weight.copy_(fused.down_proj[e])
    experts.to(fused.gate_up_proj.dtype)
    layer.get_submodule(layout.block).set_submodule(layout.experts, experts)
    return True


class _Refs:
    """Modules a wrapper calls without owning them (not registered: the layer's state dict stays as it is)."""

    def __init__(self, **modules):
        self.__dict__.update(modules)


class BesideMlpFeedForward(nn.Module):
    """Gemma 4's MoE layer's feed-forward as one residual block, on the residual x (its norm: identity):
    post(post_1(mlp(pre(x))) + post_2(experts(pre_2(x), router(x)))), as the decoder layer computes it."""

    def __init__(self, layer: nn.Module, layout: MoeLayout):
        super().__init__()
        self.refs = _Refs(layer=layer, layout=layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, layout = self.refs.layer, self.refs.layout
        router, experts = (layer.get_submodule(layout.path(n)) for n in (layout.router.split(".")[0], layout.experts))
        dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = router(flat)
        sparse = layer.post_feedforward_layernorm_2(experts(layer.get_submodule(layout.norm)(flat), index, weights))
        return layer.post_feedforward_layernorm(dense + sparse.reshape(x.shape))


class BesideMlpExperts(nn.Module):
    """Gemma 4's routed experts as a function of what they read, norm_2(x) (the experts' gate/up group's loss): the
    router's input, x through its own weightless RMS norm, is norm_2(x) / norm_2.weight (a plain-weight RMS norm of
    the same x; the router's norm of it is the identity up to its eps). The searches never fold into norm_2 while
    they call this, so its weight is the one the observed inputs were normed by."""

    def __init__(self, layer: nn.Module, layout: MoeLayout):
        super().__init__()
        self.refs = _Refs(layer=layer, layout=layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, layout = self.refs.layer, self.refs.layout
        router, experts = (layer.get_submodule(layout.path(n)) for n in (layout.router.split(".")[0], layout.experts))
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = router(flat / layer.get_submodule(layout.norm).weight)
        return experts(flat, index, weights).reshape(x.shape)


BESIDE_MLP_FFN = "beside_mlp_ffn"  # the residual block BesideMlpFeedForward, under this name in the layer
BESIDE_MLP_FFN_NORM = "beside_mlp_ffn_input"  # its norm (nn.Identity)
BESIDE_MLP_EXPERTS = "beside_mlp_experts"  # BesideMlpExperts


def _add_beside_mlp_blocks(layer: nn.Module, layout: MoeLayout) -> None:
    """Gives a Gemma 4 MoE layer (experts unfused) the modules its AWQ map names (no parameters of their own)."""
    layer.add_module(BESIDE_MLP_FFN, BesideMlpFeedForward(layer, layout))
    layer.add_module(BESIDE_MLP_FFN_NORM, nn.Identity())
    layer.add_module(BESIDE_MLP_EXPERTS, BesideMlpExperts(layer, layout))


PER_LAYER_INPUT_BLOCK = "per_layer_input_block"  # Gemma 4 E-models: PerLayerInputBlock, under this name in the layer
PER_LAYER_INPUT_NORM = "per_layer_input_block_input"  # its norm (nn.Identity)


class PerLayerInputBlock(nn.Module):
    """Gemma 4's E-model layer's last residual block, on the residual x (its norm: identity) and the layer's
    per-layer input p: post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * p))."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.refs = _Refs(layer=layer)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        layer = self.refs.layer
        h = layer.act_fn(layer.per_layer_input_gate(x)) * per_layer_input
        return layer.post_per_layer_input_norm(layer.per_layer_projection(h))


def add_per_layer_input_block(layer: nn.Module) -> None:
    """Gives a Gemma 4 E-model layer (one with per_layer_input_gate) the modules its AWQ map names; else nothing."""
    if isinstance(getattr(layer, "per_layer_input_gate", None), nn.Module):
        layer.add_module(PER_LAYER_INPUT_BLOCK, PerLayerInputBlock(layer))
        layer.add_module(PER_LAYER_INPUT_NORM, nn.Identity())


def with_per_layer_input(awq_map: AwqMap, layer: nn.Module) -> AwqMap:
    """``awq_map`` with a Gemma 4 E-model layer's per-layer-input block as its last residual block (its linears in no
    group: fp16, see gemma4_awq_map); unchanged for any other layer."""
    if not hasattr(layer, PER_LAYER_INPUT_BLOCK):
        return awq_map
    return dataclasses.replace(awq_map, residual_blocks=awq_map.residual_blocks +
                               ((PER_LAYER_INPUT_NORM, PER_LAYER_INPUT_BLOCK),))


def num_experts(layer: nn.Module, layout: MoeLayout) -> int | None:
    """The number of experts of ``layer``'s sparse block (after ``unfuse_experts``), None for a dense layer."""
    try:
        experts = layer.get_submodule(layout.path(layout.experts))
    except AttributeError:
        return None
    return len(experts) if isinstance(experts, ExpertLinears) else None


def expert_linear_name(layout: MoeLayout, e: int, which: int) -> str:
    """Module path inside a decoder layer of expert ``e``'s gate (0), up (1) or down (2) linear."""
    return layout.path(f"{layout.experts}.{e}.{layout.expert_linears[which]}")


def layer_awq_map(awq_map: AwqMap, layer: nn.Module) -> AwqMap:
    """The AWQ map of one decoder layer: ``awq_map`` itself for a dense layer; for a sparse one (experts
    unfused) its attention groups, the shared gate/up group with the router, and one up -> down group per
    expert."""
    layout = awq_map.moe
    count = num_experts(layer, layout) if layout is not None else None
    if count is None:
        return _present(awq_map, layer)
    block = layout.block
    linears = tuple(expert_linear_name(layout, e, w) for e in range(count) for w in (0, 1))
    if layout.beside_mlp:  # Gemma 4: the dense groups, then the experts' on their own norm (the router: not its reader)
        shared = SmoothGroup(layout.norm, linears, BESIDE_MLP_EXPERTS, input_of=layout.shared_input)
        per_expert = tuple(SmoothGroup(expert_linear_name(layout, e, 1), (expert_linear_name(layout, e, 2),),
                                       expert_linear_name(layout, e, 2)) for e in range(count))
        blocks = tuple(b for b in awq_map.residual_blocks if b[1] == awq_map.attention)
        post = {awq_map.attention: awq_map.post_norms[awq_map.attention]} if awq_map.attention in awq_map.post_norms \
            else {}
        return _present(dataclasses.replace(awq_map, groups=awq_map.groups + (shared,) + per_expert,
                                            residual_blocks=blocks + ((BESIDE_MLP_FFN_NORM, BESIDE_MLP_FFN),),
                                            post_norms=post), layer)
    dense = (f"{block}.{layout.router}",)
    extra = ()
    if layout.shared_expert is not None:  # Qwen3.5-MoE: the shared expert reads the block's input too
        mlp = f"{block}.{layout.shared_expert}"
        linears += (f"{mlp}.gate_proj", f"{mlp}.up_proj")
        dense += (f"{block}.{layout.shared_expert_gate}",)
        extra = (SmoothGroup(f"{mlp}.up_proj", (f"{mlp}.down_proj",), f"{mlp}.down_proj"),)
    shared = SmoothGroup(layout.norm, linears, block, dense=dense, input_of=block)
    per_expert = tuple(SmoothGroup(expert_linear_name(layout, e, 1), (expert_linear_name(layout, e, 2),),
                                   expert_linear_name(layout, e, 2), fold=layout.smooth_down) for e in range(count))
    attention = tuple(g for g in awq_map.groups if g.prev in ATTENTION_PREVS)
    return _present(dataclasses.replace(awq_map, groups=attention + (shared,) + extra + per_expert), layer)


def _present(awq_map: AwqMap, layer: nn.Module) -> AwqMap:
    """``awq_map`` with what this layer lacks left out: linears (Gemma 4's global layers with attention_k_eq_v: no
    v_proj), then the groups left empty, and the residual blocks it does not have (a Qwen3.5 layer has self_attn or
    linear_attn)."""
    def has(name: str) -> bool:
        try:
            return isinstance(layer.get_submodule(name), nn.Module)
        except AttributeError:
            return False

    groups = tuple(dataclasses.replace(g, linears=tuple(n for n in g.linears if has(n)),
                                       dense=tuple(n for n in g.dense if has(n)))
                   for g in awq_map.groups if any(has(n) for n in g.linears))
    blocks = tuple((norm, block) for norm, block in awq_map.residual_blocks if has(block))
    return dataclasses.replace(awq_map, groups=groups, residual_blocks=blocks)


def expert_of(layout: MoeLayout, name: str) -> int | None:
    """The expert index of a module path inside a decoder layer (``mlp.experts.3.down_proj`` -> 3), else None."""
    head = layout.path(layout.experts) + "."
    if not name.startswith(head):
        return None
    return int(name[len(head):].split(".", 1)[0])


def checkpoint_name(layout: MoeLayout | None, name: str) -> str:
    """A module path inside a decoder layer as checkpoints name it (Mixtral: mlp. -> block_sparse_moe.)."""
    if layout is None or layout.block == layout.checkpoint_block or not name.startswith(layout.block + "."):
        return name
    return layout.checkpoint_block + name[len(layout.block):]


def stack_experts(state: dict[str, torch.Tensor], layout: MoeLayout, layers_prefix: str) -> dict[str, torch.Tensor]:
    """A checkpoint's state dict (per-expert linears, checkpoint names) in transformers 5's form: each sparse
    block's experts stacked into ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and
    ``experts.down_proj`` [E, H, I], the block under its module name (``layout.interleaved``, gpt-oss: gate_up_proj
    [E, H, 2I] with gate and up columns interleaved, down_proj [E, I, H], and their biases)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}  # block prefix -> e -> which -> weight
    biases: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    ckpt = f".{layout.checkpoint_block}." if layout.checkpoint_block else "."
    rename = layout.block != layout.checkpoint_block
    marker = f"{ckpt}{layout.experts}."
    for name, value in state.items():
        if name.startswith(layers_prefix) and marker in name:
            block_prefix, rest = name.split(marker, 1)
            if not rest.split(".", 1)[0].isdigit():  # stacked already (Qwen3.5-MoE as Qwen ships it)
                out[name.replace(ckpt, f".{layout.block}.", 1) if rename else name] = value
                continue
            e, linear, suffix = rest.split(".", 2)
            if suffix not in ("weight", "bias") or (suffix == "bias" and not layout.interleaved) or \
                    linear not in layout.expert_linears:
                raise ValueError(f"unexpected expert tensor {name}")
            into = experts if suffix == "weight" else biases
            into.setdefault(block_prefix, {}).setdefault(int(e), {})[layout.expert_linears.index(linear)] = value
        elif rename and name.startswith(layers_prefix) and ckpt in name:
            out[name.replace(ckpt, f".{layout.block}.", 1)] = value
        else:
            out[name] = value
    for block_prefix, per_expert in experts.items():
        count = len(per_expert)
        if sorted(per_expert) != list(range(count)) or any(len(v) != 3 for v in per_expert.values()):
            raise ValueError(f"{block_prefix}{marker}: experts 0..{count - 1} must each have gate, up and down")
        base = f"{block_prefix}.{layout.path(layout.experts)}"
        if layout.interleaved:
            bias = biases.get(block_prefix, {})
            if sorted(bias) != list(range(count)) or any(len(v) != 3 for v in bias.values()):
                raise ValueError(f"{block_prefix}{marker}: experts 0..{count - 1} must each have gate, up and down "
                                 "biases")
            out[f"{base}.gate_up_proj"] = torch.stack([
                torch.stack([per_expert[e][0], per_expert[e][1]], dim=1).flatten(0, 1).t() for e in range(count)])
            out[f"{base}.gate_up_proj_bias"] = torch.stack([
                torch.stack([bias[e][0], bias[e][1]], dim=1).flatten() for e in range(count)])
            out[f"{base}.down_proj"] = torch.stack([per_expert[e][2].t() for e in range(count)])
            out[f"{base}.down_proj_bias"] = torch.stack([bias[e][2] for e in range(count)])
            continue
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per_expert[e][0], per_expert[e][1]]) for e in range(count)])
        out[f"{base}.down_proj"] = torch.stack([per_expert[e][2] for e in range(count)])
    return out
