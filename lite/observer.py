"""Activation observer: forward hooks on the first linear of each smoothing group (or the module named by its
``input_of``) record, over every calibration token, what the searches need about the group's input x
[tokens, in] (an expert's linear: the rows routed to it; its samples are those rows of the chunks that hold
the search sequences):

    abs_sum  [in]           sum_t |x_t|                  -> mean |x| per input channel (AWQ's scale candidates)
    abs_max  [in]           max_t |x_t|                  -> SmoothQuant's scale candidates
    moments  [in/g, g, g]   sum_t x_t[G] x_t[G]^T        -> exact per-group output error (clip search)
    hessian  [in, in]       sum_t x_t x_t^T              -> GPTQ rounding (only with --rounding gptq)
    drift    [in, in]       sum_t (r_t - x_t) x_t^T      -> GPTQ towards the fp model's outputs (--gptq-model-
                                                            target): r_t the input the fp model gives the same
                                                            linear at the same token (the runner's reference pass);
                                                            the difference is taken per token, before the sum
    samples  [b, seq, in]   x of the first b sequences   -> block inputs on which scales are scored

Everything is float32 except ``drift``'s products, whose operands may be bfloat16 (``drift_dtype``, where the
calibration computes in it: ``--calib-precision``): each chunk's product, rounded to bf16, is added into a float32
sum. ``hessian`` stays float32: rounding its elements independently can cost it positive definiteness (GPTQ
factors it), while ``drift`` only shifts GPTQ's target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lmkit.models import AwqMap


@dataclass
class InputStats:
    """What one smoothing group's input looked like over the calibration set."""

    abs_sum: torch.Tensor
    moments: torch.Tensor | None
    hessian: torch.Tensor | None = None  # [in, in] sum_t x_t x_t^T (for GPTQ rounding); moments are its blocks
    abs_max: torch.Tensor | None = None  # [in] max_t |x_t| (zeros before the first token)
    drift: torch.Tensor | None = None  # [in, in] sum_t (r_t - x_t) x_t^T, r_t the fp model's input at token t
    references: list[torch.Tensor] = field(default_factory=list)  # the reference pass's inputs, not yet paired
    num_tokens: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.num_tokens, 1)

    @property
    def sample_input(self) -> torch.Tensor:
        """[b, seq, in] inputs of the first ``search_samples`` sequences."""
        return torch.cat(self.samples, dim=0)

    @torch.no_grad()
    def rescale(self, scales: torch.Tensor) -> None:
        """The statistics of x / scales (after smoothing folded the scales into the previous module)."""
        s = scales.to(self.abs_sum.device, torch.float32)
        self.abs_sum /= s
        if self.abs_max is not None:
            self.abs_max /= s
        if self.moments is not None:
            num_groups, g, _ = self.moments.shape
            inv = (1.0 / s).view(num_groups, g)
            self.moments *= inv.unsqueeze(2) * inv.unsqueeze(1)
        inv = 1.0 / s
        for square in (self.hessian, self.drift):
            if square is not None:
                square *= inv.unsqueeze(1) * inv.unsqueeze(0)
        self.samples = [x / s for x in self.samples]

    @torch.no_grad()
    def accumulate(self, flat: torch.Tensor, group_size: int, drift_dtype: torch.dtype = torch.float32) -> None:
        """Adds the rows of ``flat`` [tokens, in] (fp32) to the sums (``drift``'s product in ``drift_dtype``)."""
        self.abs_sum += flat.abs().sum(dim=0)
        if self.abs_max is None:
            self.abs_max = torch.zeros_like(self.abs_sum)
        if flat.shape[0]:
            torch.maximum(self.abs_max, flat.abs().amax(dim=0), out=self.abs_max)
        self.num_tokens += flat.shape[0]
        if self.drift is not None:
            if not self.references or self.references[0].shape != flat.shape:
                raise RuntimeError("a linear's input has no reference input of its shape from the fp model's pass "
                                   "(the runner must run the reference chunk first)")
            difference = (self.references.pop(0) - flat).to(drift_dtype)
            self.drift += (difference.t() @ flat.to(drift_dtype)).float()
        if self.hessian is not None:
            self.hessian += flat.t() @ flat
        elif self.moments is not None:
            grouped = flat.view(flat.shape[0], -1, group_size).transpose(0, 1)  # [G, tokens, g]
            self.moments += torch.bmm(grouped.transpose(1, 2), grouped)

    def moments_from_hessian(self, group_size: int) -> None:
        """Set ``moments`` to the diagonal blocks of ``hessian`` (computed once instead of twice)."""
        num_groups = self.hessian.shape[0] // group_size
        blocks = self.hessian.view(num_groups, group_size, num_groups, group_size)
        self.moments = torch.stack([blocks[i, :, i, :] for i in range(num_groups)]).contiguous()


class GroupInputObserver:
    """Hooks on one decoder layer; ``stats[i]`` describes the input of ``awq_map.groups[i]``.

    Call ``begin_chunk(first_sequence)`` before each forward so the observer knows which rows belong
    to the first ``num_samples`` sequences; ``remove()`` detaches the hooks. ``group_size`` matters only
    for the per-group ``moments`` (``with_moments``). Where ``paired[i]``, group i's statistics gain ``drift``:
    its inputs are paired token by token with those of the fp model's pass the runner makes first (a group that
    reads every token, the experts' shared gate/up input too, sees the same tokens in both passes; one expert's
    up -> down group sees the rows routed to it, which differ, so those are never paired).
    """

    def __init__(self, layer: nn.Module, awq_map: AwqMap, group_size: int, num_samples: int, with_moments: bool,
                 with_hessian: bool = False, paired: list[bool] | None = None,
                 drift_dtype: torch.dtype = torch.float32):
        self.num_samples = num_samples
        self.drift_dtype = drift_dtype
        self.recording_reference = False  # set by LayerRunner.run during the fp model's pass of a chunk
        self.group_size = group_size
        self.with_moments = with_moments
        self.first_sequence = 0
        self.seqlen = 0  # tokens per sequence (begin_chunk): a block's flattened input [rows, in] is kept by sequence
        self.stats: list[InputStats] = []
        self._handles = []
        for i, group in enumerate(awq_map.groups):
            linear = layer.get_submodule(group.linears[0])
            weight = linear.weight
            in_features = linear.in_features
            source = layer.get_submodule(group.input_of) if group.input_of else linear
            moments = (torch.zeros(in_features // group_size, group_size, group_size, device=weight.device)
                       if with_moments and not with_hessian else None)
            hessian = torch.zeros(in_features, in_features, device=weight.device) if with_hessian else None
            stats = InputStats(torch.zeros(in_features, device=weight.device), moments, hessian)
            if paired is not None and paired[i]:
                stats.drift = torch.zeros(in_features, in_features, device=weight.device)
            self.stats.append(stats)
            self._handles.append(source.register_forward_hook(self._hook(stats, group.input_of is not None)))

    def begin_chunk(self, first_sequence: int, seqlen: int = 0) -> None:
        self.first_sequence = first_sequence
        self.seqlen = seqlen

    def _hook(self, stats: InputStats, every_token: bool = False):
        def hook(module, args, output):
            x = args[0].detach()
            if every_token and x.dim() == 2 and self.seqlen:  # Gemma 4's experts read every token, flattened
                x = x.view(-1, self.seqlen, x.shape[-1])
            if self.recording_reference:
                if stats.drift is not None:
                    stats.references.append(x.reshape(-1, x.shape[-1]).float().clone())
                return
            stats.accumulate(x.reshape(-1, x.shape[-1]).float(), self.group_size, self.drift_dtype)
            keep = self.num_samples - self.first_sequence
            if keep > 0 and x.dim() == 2:  # an expert's linear: the rows routed to it, all of this chunk's
                stats.samples.append(x.float().clone())
            elif keep > 0:
                stats.samples.append(x[:keep].float().clone())

        return hook

    def check_paired(self) -> None:
        """RuntimeError if a reference input found no main-pass input to pair with (a module called a different
        number of times in the two passes: its ``drift`` would pair the wrong tokens)."""
        for i, stats in enumerate(self.stats):
            if stats.references:
                raise RuntimeError(f"smoothing group {i}: {len(stats.references)} input(s) of the fp model's pass "
                                   "were never paired with the quantized model's")

    def remove(self) -> None:
        """Detach the hooks; derive per-group moments from the hessians when those were gathered."""
        for stats in self.stats:
            if stats.hessian is not None and self.with_moments:
                stats.moments_from_hessian(self.group_size)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
