"""Folding smoothing scales into a decoder layer (the one step of AWQ that mutates fp weights).

For a group with input x and scales s [in]:   prev's output  /= s   (norm weight, or prev linear's
output rows and bias),   each linear's input columns  *= s.   The fp function is unchanged:
W (x / s * s) = W x, which tests check to 1e-5.
"""

from __future__ import annotations

import torch
from torch import nn

from lmkit.lite.awq_maps import SmoothGroup


def input_features(layer: nn.Module, group: SmoothGroup) -> int:
    """The input size shared by the group's linears (ValueError when they disagree)."""
    sizes = {layer.get_submodule(name).in_features for name in group.linears}
    if len(sizes) != 1:
        raise ValueError(f"linears {group.linears} of one smoothing group have different input sizes {sorted(sizes)}")
    return sizes.pop()


def can_absorb(layer: nn.Module, group: SmoothGroup) -> bool:
    """True when ``group.prev`` can take the division by per-channel scales of the group's input:
    a linear whose output size equals that input size (not v -> o under GQA), or a norm with a
    per-channel weight of that size."""
    prev = layer.get_submodule(group.prev)
    size = input_features(layer, group)
    if isinstance(prev, nn.Linear):
        return prev.out_features == size
    weight = getattr(prev, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == size


@torch.no_grad()
def fold_scales(layer: nn.Module, group: SmoothGroup, scales: torch.Tensor) -> None:
    """Divide ``group.prev``'s output by ``scales`` and multiply the linears' inputs by them, in place.

    Requires ``can_absorb(layer, group)``.
    """
    if not can_absorb(layer, group):
        raise ValueError(f"{group.prev} cannot absorb the scales of {group.linears}")
    prev = layer.get_submodule(group.prev)
    s = scales.to(device=prev.weight.device, dtype=torch.float32)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.view(-1, 1))
    else:
        prev.weight.div_(s)
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s)
    for name in group.linears:
        layer.get_submodule(name).weight.mul_(s.view(1, -1))
