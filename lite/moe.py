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
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmkit.models import AwqMap, MoeLayout, SmoothGroup

ATTENTION_PREVS = ("input_layernorm", "self_attn.v_proj", "linear_attn.norm")  # the dense groups a sparse layer keeps


class _Expert(nn.Module):
    """One expert's gate, up and down linears under the checkpoint's names."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int):
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))


class ExpertLinears(nn.Module):
    """The experts of one sparse block as per-expert linears (children "0", "1", ...); ``forward`` is
    transformers' expert loop (every expert some row picked: its rows, act(gate) * up, down, times the router
    weight, added)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn, names: tuple[str, str, str]):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), _Expert(names, hidden, inter))
        self.num_experts = num_experts
        self.names = names
        self.act_fn = act_fn

    def __len__(self) -> int:
        return self.num_experts

    def linear(self, e: int, which: int) -> nn.Linear:
        return getattr(getattr(self, str(e)), self.names[which])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]
            h = self.act_fn(self.linear(e, 0)(x)) * self.linear(e, 1)(x)
            y = self.linear(e, 2)(h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and \
        isinstance(getattr(module, "down_proj", None), torch.Tensor)


@torch.no_grad()
def unfuse_experts(layer: nn.Module, layout: MoeLayout) -> bool:
    """Replace the 3D experts of ``layer``'s sparse block (if it has one) by ``ExpertLinears`` holding the same
    weights (on the meta device: shapes only). Returns whether the layer is sparse."""
    path = f"{layout.block}.{layout.experts}"
    try:
        fused = layer.get_submodule(path)
    except AttributeError:
        return False
    if isinstance(fused, ExpertLinears):
        return True
    if not _is_fused_experts(fused):
        return False
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


def num_experts(layer: nn.Module, layout: MoeLayout) -> int | None:
    """The number of experts of ``layer``'s sparse block (after ``unfuse_experts``), None for a dense layer."""
    try:
        experts = layer.get_submodule(f"{layout.block}.{layout.experts}")
    except AttributeError:
        return None
    return len(experts) if isinstance(experts, ExpertLinears) else None


def expert_linear_name(layout: MoeLayout, e: int, which: int) -> str:
    """Module path inside a decoder layer of expert ``e``'s gate (0), up (1) or down (2) linear."""
    return f"{layout.block}.{layout.experts}.{e}.{layout.expert_linears[which]}"


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
    dense = (f"{block}.{layout.router}",)
    extra = ()
    if layout.shared_expert is not None:  # Qwen3.5-MoE: the shared expert reads the block's input too
        mlp = f"{block}.{layout.shared_expert}"
        linears += (f"{mlp}.gate_proj", f"{mlp}.up_proj")
        dense += (f"{block}.{layout.shared_expert_gate}",)
        extra = (SmoothGroup(f"{mlp}.up_proj", (f"{mlp}.down_proj",), f"{mlp}.down_proj"),)
    shared = SmoothGroup(layout.norm, linears, block, dense=dense, input_of=block)
    per_expert = tuple(SmoothGroup(expert_linear_name(layout, e, 1), (expert_linear_name(layout, e, 2),),
                                   expert_linear_name(layout, e, 2)) for e in range(count))
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
    head = f"{layout.block}.{layout.experts}."
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
    ``experts.down_proj`` [E, H, I], the block under its module name."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}  # block prefix -> e -> which -> weight
    ckpt = f".{layout.checkpoint_block}."
    marker = f"{ckpt}{layout.experts}."
    for name, value in state.items():
        if name.startswith(layers_prefix) and marker in name:
            block_prefix, rest = name.split(marker, 1)
            if not rest.split(".", 1)[0].isdigit():  # stacked already (Qwen3.5-MoE as Qwen ships it)
                out[name.replace(ckpt, f".{layout.block}.", 1)] = value
                continue
            e, linear, suffix = rest.split(".", 2)
            if suffix != "weight" or linear not in layout.expert_linears:
                raise ValueError(f"unexpected expert tensor {name}")
            experts.setdefault(block_prefix, {}).setdefault(int(e), {})[layout.expert_linears.index(linear)] = value
        elif name.startswith(layers_prefix) and ckpt in name:
            out[name.replace(ckpt, f".{layout.block}.", 1)] = value
        else:
            out[name] = value
    for block_prefix, per_expert in experts.items():
        count = len(per_expert)
        if sorted(per_expert) != list(range(count)) or any(len(v) != 3 for v in per_expert.values()):
            raise ValueError(f"{block_prefix}{marker}: experts 0..{count - 1} must each have gate, up and down")
        base = f"{block_prefix}.{layout.block}.{layout.experts}"
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per_expert[e][0], per_expert[e][1]]) for e in range(count)])
        out[f"{base}.down_proj"] = torch.stack([per_expert[e][2] for e in range(count)])
    return out
