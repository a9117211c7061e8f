"""The two AWQ searches, as functions of tensors and modules that return plain tensors.

Scale search (one smoothing group): candidate per-input-channel scales

    act:  s = mean|x| ^ a                         a = 0, 1/n, ..., (n-1)/n   (a = 0: no smoothing)
    duo:  s = mean|x| ^ a / mean_w ^ (1 - a)      mean_w = per-input-channel mean of |W| / group max|W|
    both: normalised to max(s) * min(s) = 1

are scored by the mean squared error of the block output when the group's weights are replaced by
Q(W * s) / s (the other linears of the block stay fp). The identity s = 1 (plain round-to-nearest) is
always a candidate too, so the chosen scale never scores worse than no smoothing.

Clip search (one linear, after smoothing): for each (output row, input group) choose how far to shrink
the quantization range [min, max] -> [a * min, b * max], a, b in the shrink grid, minimising that
group's share of the output error over every calibration token:

    err[o, G] = dW[o, G] . C[G] . dW[o, G]     dW = Q_range(W) - W, C[G] = sum_t x_t[G] x_t[G]^T  (g x g)

which is exact for the group (it is the squared error of sum_k dW[o, k] x_t[k] over the group's
channels, summed over all tokens t) and costs no pass over the activations per candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmkit.lite.quantizer import MAX_INT, QuantizedWeight, quantize, quantize_params
from lmkit.lite.threads import elementwise_threads, torch_threads


@dataclass(frozen=True)
class ScaleSearchResult:
    """The chosen scale of one smoothing group and how it scored."""

    scales: torch.Tensor  # float32 [in]
    ratio: float  # the exponent a; -1.0 when the identity (no smoothing) won
    loss: float  # block-output MSE with the chosen scale
    loss_identity: float  # block-output MSE of plain round-to-nearest (s = 1)


def weight_group_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """float32 [in]: mean over all output rows of |W| / (max |W| of its quantization group)."""
    w = torch.cat([w.float() for w in weights], dim=0)
    out_features, in_features = w.shape
    groups = w.abs().view(out_features, in_features // group_size, group_size)
    normalised = groups / (groups.amax(dim=2, keepdim=True) + 1e-6)
    return normalised.view(out_features, in_features).mean(dim=0)


def candidate_scales(x_abs_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, form: str) -> torch.Tensor:
    """float32 [in] scales for exponent ``ratio`` (see module docstring), normalised."""
    x = x_abs_mean.float().clamp(min=1e-8)
    if form == "duo":
        s = x.pow(ratio) / (w_mean.float().pow(1 - ratio) + 1e-4)
    elif form == "act":
        s = x.pow(ratio)
    else:
        raise ValueError(f"unknown scale form {form!r} (act | duo)")
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(block: Callable[[torch.Tensor], torch.Tensor], linears: list[nn.Linear], x: torch.Tensor,
                 x_abs_mean: torch.Tensor, group_size: int, num_grid: int = 20, form: str = "duo") -> ScaleSearchResult:
    """Grid-search the smoothing scale of ``linears`` (which all read ``x``) by the MSE of ``block(x)``.

    ``block`` computes the output the loss is measured on from ``x`` using ``linears``. The linears'
    weights are replaced temporarily and restored before returning (the module is unchanged).
    """
    originals = [lin.weight.data.clone() for lin in linears]
    w_mean = weight_group_mean(originals, group_size)
    reference = block(x)
    threads = elementwise_threads(max(w.numel() for w in originals))

    def score(scales: torch.Tensor | None) -> float:
        with torch_threads(threads):  # element-wise work (see lmkit.lite.threads)
            for lin, w in zip(linears, originals):
                if scales is None:
                    lin.weight.data = quantize(w, group_size).dequantize()
                else:
                    lin.weight.data = quantize(w * scales.view(1, -1), group_size).dequantize() / scales.view(1, -1)
        return float((block(x) - reference).float().pow(2).mean())

    try:
        loss_identity = score(None)
        best = ScaleSearchResult(torch.ones_like(x_abs_mean, dtype=torch.float32), -1.0, loss_identity, loss_identity)
        for step in range(num_grid):
            ratio = step / num_grid
            scales = candidate_scales(x_abs_mean, w_mean, ratio, form)
            loss = score(scales)
            if loss < best.loss:
                best = ScaleSearchResult(scales, ratio, loss, loss_identity)
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    return best


def shrink_grid(num_points: int, max_shrink: float) -> torch.Tensor:
    """``num_points`` factors from 1 down to 1 - max_shrink, evenly spaced."""
    if num_points < 1 or not 0 <= max_shrink < 1:
        raise ValueError(f"bad clip grid: {num_points} points, max shrink {max_shrink}")
    if num_points == 1:
        return torch.ones(1)
    return torch.linspace(1.0, 1.0 - max_shrink, num_points)


def group_error(delta: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """[out, G] output error per (row, group): delta [out, G, g] . moments [G, g, g] . delta."""
    return _group_major_error(delta.transpose(0, 1).contiguous(), moments).t()


def _group_major_error(delta: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """[G, out] ``group_error`` of a group-major delta [G, out, g] (contiguous: bmm runs faster on it)."""
    return (torch.bmm(delta, moments) * delta).sum(dim=2)


def _rounding_error(groups: torch.Tensor, w_min: torch.Tensor, w_max: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(W, w_min, w_max)) - W of ``groups`` [A, B, g] (ranges [A, B]: either layout), the
    quantizer's own float operations in place, without its integer tensors (the clip search's inner loop: bit for
    bit the same)."""
    scales, zeros = quantize_params(w_min.float(), w_max.float())
    s, z = scales.float().unsqueeze(2), zeros.unsqueeze(2)
    q = torch.round(groups / s).add_(z).clamp_(0, MAX_INT)
    return q.sub_(z).mul_(s).sub_(groups)


@torch.no_grad()
def search_clip(weight: torch.Tensor, moments: torch.Tensor, group_size: int,
                grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_min, w_max) float32 [out, in/g]: per (row, group) the clipped range with the least output error.

    ``moments`` [in/g, g, g] holds sum_t x_t x_t^T of each input group over the calibration tokens (of
    the input the linear sees, i.e. after smoothing). ``grid`` holds shrink factors (1 = no clipping).
    """
    w = weight.float()
    out_features, in_features = w.shape
    num_groups = in_features // group_size
    # group-major [G, out, g], as the error's batched product takes it; ranges [G, out]
    groups = w.view(out_features, num_groups, group_size).transpose(0, 1).contiguous()
    full_min, full_max = groups.amin(dim=2), groups.amax(dim=2)
    moments = moments.float()
    best_err = torch.full((num_groups, out_features), float("inf"), device=w.device)
    best_min, best_max = full_min.clone(), full_max.clone()
    for a in grid.tolist():
        lo = torch.where(full_min < 0, full_min * a, full_min)
        for b in grid.tolist():
            hi = torch.where(full_max > 0, full_max * b, full_max)
            err = _group_major_error(_rounding_error(groups, lo, hi), moments)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_min = torch.where(better, lo, best_min)
            best_max = torch.where(better, hi, best_max)
    return best_min.t().contiguous(), best_max.t().contiguous()


@torch.no_grad()
def refine_quantization(weight: torch.Tensor, moments: torch.Tensor, group_size: int, w_min: torch.Tensor,
                        w_max: torch.Tensor, num_iters: int = 3) -> QuantizedWeight:
    """The int4 weight of ``weight`` quantized in the ranges [w_min, w_max], with each (row, group)'s
    (scale, zero) then improved beyond the clip grid by the same exact per-group output error.

    Per iteration, with the integers q of the best parameters so far fixed: least squares for the affine
    map w ~ scale * q + offset under the metric C (2x2 normal equations), zero = round(-offset / scale)
    into 0..15, least squares for the scale alone given that zero, the scale rounded to fp16, q
    re-rounded. A group takes the new parameters only when its error drops, so the result is never
    worse per group than plain quantization in [w_min, w_max].
    """
    w = weight.float()
    out_features, in_features = w.shape
    num_groups = in_features // group_size
    wg = w.view(out_features, num_groups, group_size)
    C = moments.float()
    start = quantize(w, group_size, w_min, w_max)
    best_q = start.q.float().view_as(wg)
    best_z = start.zeros.float()
    best_s = start.scales.float()
    best_err = group_error((best_q - best_z.unsqueeze(2)) * best_s.unsqueeze(2) - wg, C)

    def metric(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a^T C b per (row, group)
        return (torch.bmm(a.transpose(0, 1), C).transpose(0, 1) * b).sum(dim=2)

    ones = torch.ones_like(wg)
    w1, ow = metric(ones, ones), metric(ones, wg)
    for _ in range(num_iters):
        q = best_q
        qq, q1, qw = metric(q, q), metric(q, ones), metric(q, wg)
        det = qq * w1 - q1 * q1
        solvable = det.abs() > 1e-6 * (qq * w1).abs() + 1e-30
        safe_det = torch.where(solvable, det, torch.ones_like(det))
        s = torch.where(solvable, (qw * w1 - q1 * ow) / safe_det, best_s)
        offset = torch.where(solvable, (qq * ow - q1 * qw) / safe_det, -best_s * best_z)
        s = torch.where(s > 1e-8, s, best_s)
        z = torch.round(-offset / s).clamp(0, MAX_INT)
        qz = q - z.unsqueeze(2)
        denom = metric(qz, qz)
        s = torch.where(denom > 1e-30, metric(qz, wg) / denom.clamp(min=1e-30), s)
        s = s.clamp(min=1e-5).to(torch.float16).float()
        q = (torch.round(wg / s.unsqueeze(2)) + z.unsqueeze(2)).clamp(0, MAX_INT)
        err = group_error((q - z.unsqueeze(2)) * s.unsqueeze(2) - wg, C)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
        best_q = torch.where(better.unsqueeze(2), q, best_q)
    return QuantizedWeight(q=best_q.to(torch.uint8).reshape(out_features, in_features).contiguous(),
                           zeros=best_z.to(torch.uint8),
                           scales=best_s.to(torch.float16), group_size=group_size)
