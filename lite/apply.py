"""Folding smoothing scales into a decoder layer (the one step of AWQ that mutates fp weights).

For a group with input x and scales s [in]:   prev's output  /= s   (norm weight, or prev linear's
output rows and bias),   each linear's input columns  *= s   (and those of the group's dense readers: the
router of a mixture-of-experts block).   The fp function is unchanged:
W (x / s * s) = W x, which tests check to 1e-5.

    norm that scales by (offset + w) (Gemma: 1):   w' = (offset + w) / s - offset
    fused prev wider than x (Phi-3 gate_up_proj -> down_proj): only its LAST len(s) output rows /= s
        [ gate ]             down(silu(gate) * up / s * s)
        [ up   ] /= s
    Whether those last rows are what the group reads is not a question of shapes (qkv_proj -> o_proj:
    the v rows only without grouped-query attention); lmkit.lite.awq checks the layer is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from lmkit.models import SmoothGroup


def input_features(layer: nn.Module, group: SmoothGroup) -> int:
    """The input size shared by the group's linears (ValueError when they disagree)."""
    sizes = {layer.get_submodule(name).in_features for name in group.linears}
    if len(sizes) != 1:
        raise ValueError(f"linears {group.linears} of one smoothing group have different input sizes {sorted(sizes)}")
    return sizes.pop()


def can_absorb(layer: nn.Module, group: SmoothGroup) -> bool:
    """True when ``group.prev`` can take the division by per-channel scales of the group's input by its
    shape: a linear whose output size equals that input size (not v -> o under GQA), a fused linear
    wider than it (on its last rows), or a norm with a per-channel weight of that size."""
    if not group.fold:
        return False
    prev = layer.get_submodule(group.prev)
    size = input_features(layer, group)
    if isinstance(prev, nn.Linear):
        return prev.out_features >= size
    weight = getattr(prev, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == size


@torch.no_grad()
def fold_scales(layer: nn.Module, group: SmoothGroup, scales: torch.Tensor, norm_weight_offset: float = 0.0) -> None:
    """Divide ``group.prev``'s output by ``scales`` (a linear's last ``len(scales)`` rows; a norm that
    scales by ``norm_weight_offset + weight``) and multiply the linears' inputs by them, in place.

    Requires ``can_absorb(layer, group)``.
    """
    if not can_absorb(layer, group):
        raise ValueError(f"{group.prev} cannot absorb the scales of {group.linears}")
    prev = layer.get_submodule(group.prev)
    s = scales.to(device=prev.weight.device, dtype=torch.float32)
    if isinstance(prev, nn.Linear):
        rows = slice(prev.out_features - s.numel(), None)
        prev.weight[rows].div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias[rows].div_(s)
    else:
        prev.weight.copy_((norm_weight_offset + prev.weight) / s - norm_weight_offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    for name in group.linears + group.dense:  # dense readers (an MoE router) take the scale, unquantized
        layer.get_submodule(name).weight.mul_(s.view(1, -1))
