"""Error-compensating rounding (GPTQ, Frantar et al. 2022) into lmkit's two weight formats: int4 groups
(``gptq_quantize``, for AWQ) and int8 per output channel (``gptq_quantize_int8``, for SmoothQuant W8A8).

Round-to-nearest rounds every weight on its own. GPTQ rounds the input columns of a linear one at a
time and pushes each column's rounding error onto the columns not yet rounded, weighted by the inverse
second moment of the input, so that the *output* error over the calibration tokens is what is
minimised (to second order), not the weight error:

    H = X^T X + damp * I        (X: the inputs the linear sees, after smoothing)   [in, in]
    U = chol(H^-1) upper
    for column c:  q_c = Q(w_c);  e = (w_c - q_c) / U[c, c];  w_{c+1:} -= e * U[c, c+1:]

int4: each group's (scale, zero) is set when its first column is reached, from the weights as updated so
far and shrunk by the clipping ratios the clip search chose for that (row, group); in activation order
(``column_order`` global) every group's is set before rounding. int8: one symmetric scale per row, from
the row before rounding (as GPTQ does per channel). The result is an ordinary ``QuantizedWeight`` /
``Int8Weight``: a checkpoint reader cannot tell it from round-to-nearest.

``reference_correction`` first moves the target of the rounding from the fp layer's outputs on the quantized
model's inputs a share of the way to the fp model's own outputs (asymmetric calibration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lmkit.lite.int8 import Int8Weight, int8_scales
from lmkit.lite.int8 import QMAX as INT8_MAX
from lmkit.lite.quantizer import MAX_INT, QuantizedWeight, quantize_params

BLOCK_COLUMNS = 128  # lazy-update block; a multiple of every supported group size
INNER_COLUMNS = 16  # lazy-update block inside it; divides every supported group size

# (group index, the block being rounded [out, cols], the group's first column in it) -> (scale, zero) [out]
GroupParams = Callable[[int, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StaticParams:
    """Every group's (scale, zero), fixed before rounding, for columns taken out of their groups' order."""

    scales: np.ndarray  # [groups, out] float32
    zeros: np.ndarray  # [groups, out] float32
    column_group: np.ndarray  # [in] the group of each column, in the order the columns are rounded


def _inverse_factor(w: torch.Tensor, hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """U = chol(H^-1) upper of the damped ``hessian``; zeroes the columns of ``w`` no token reaches (in place)."""
    in_features = w.shape[1]
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(in_features, device=h.device) * (damp * float(torch.diag(h).mean()))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def _round_columns(w: torch.Tensor, u: torch.Tensor, group_size: int, params: GroupParams, q_min: int,
                   q_max: int, static: StaticParams | None = None) -> torch.Tensor:
    """Integers [out, in] (float32) of ``w`` [out, in] rounded column by column as in the module docstring:
    q = clamp(round(w / scale) + zero, q_min, q_max), each group's (scale, zero) from ``params`` when its
    first column is reached. ``w`` is left as it was.

    The column loop is the sequential part, so it runs on numpy rows (a column of ``w`` is a row of its
    transpose: ~1 us an operation where a torch call costs several) and pushes each column's error only onto
    the rest of its INNER_COLUMNS; each inner and each BLOCK_COLUMNS block then hands its errors on at once
    (a matrix product), the lazy batch updates of GPTQ's reference code. A group starts on an inner block's
    boundary, so ``params`` sees its columns with every earlier column's error applied. On a GPU the loop runs
    on the CPU all the same (its operations are too small for kernel launches): ``params`` gets the block on
    ``w``'s device, and the integers go back there. Its matrix products run on numpy's BLAS threads, which
    lmkit.lite.threads does not set. ``static`` (set before any column is rounded) replaces ``params`` where a
    group's columns are not contiguous (activation order)."""
    out_features, in_features = w.shape
    device = w.device
    wt = np.array(w.detach().t().cpu().numpy(), dtype=np.float32, order="C")  # [in, out], a copy: row c = column c
    ut = u.detach().float().cpu().contiguous().numpy()  # upper triangular [in, in]
    qt = np.empty_like(wt)
    s = z = None
    for b0 in range(0, in_features, BLOCK_COLUMNS):
        b1 = min(b0 + BLOCK_COLUMNS, in_features)
        errors = np.empty((b1 - b0, out_features), dtype=np.float32)
        for i0 in range(b0, b1, INNER_COLUMNS):
            i1 = min(i0 + INNER_COLUMNS, b1)
            for c in range(i0, i1):
                if static is not None:
                    s, z = static.scales[static.column_group[c]], static.zeros[static.column_group[c]]
                elif c % group_size == 0:
                    scale, zero = params(c // group_size, torch.from_numpy(wt[b0:b1]).t().to(device), c - b0)
                    s, z = scale.float().cpu().contiguous().numpy(), zero.float().cpu().contiguous().numpy()
                col = wt[c]
                qc = np.rint(col / s)
                qc += z
                np.clip(qc, q_min, q_max, out=qc)
                qt[c] = qc
                err = (col - (qc - z) * s) / ut[c, c]
                errors[c - b0] = err
                if c + 1 < i1:
                    wt[c + 1:i1] -= np.outer(ut[c, c + 1:i1], err)
            if i1 < b1:
                wt[i1:b1] -= ut[i0:i1, i1:b1].T @ errors[i0 - b0:i1 - b0]
        if b1 < in_features:
            wt[b1:] -= ut[b0:b1, b1:].T @ errors
    return torch.from_numpy(qt).t().contiguous().to(device)


@torch.no_grad()
def reference_correction(hessian: torch.Tensor, drift: torch.Tensor, share: float,
                         damp: float = 0.01) -> torch.Tensor:
    """B [in, in] such that W* = W + W B, for every linear W that reads one input, is the weight whose outputs on
    the inputs x_t the quantized model gives it (``hessian`` = sum_t x_t x_t^T) come nearest, in least squares, to
    the target (1 - a) W x_t + a W r_t, r_t the fp model's input at the same token (``drift`` =
    sum_t (r_t - x_t) x_t^T), a = ``share``, pulled toward W by lam = ``damp`` * mean(diag(hessian)):

        W* = (W (hessian + a drift) + lam W) (hessian + lam I)^-1
           = W + a W drift (hessian + lam I)^-1

    The squared error of Q x_t to that target is |(W* - Q) x_t|^2 summed, plus a term free of Q (lam aside), so GPTQ
    of W* under ``hessian`` rounds towards it: a = 0 is plain GPTQ (B = 0), a = 1 the fp model's own outputs (the
    asymmetric calibration of GPTAQ, Li et al. 2025). ``drift`` is summed from per-token differences, not as
    sum r x^T - hessian, whose terms cancel where r_t is near x_t (early layers). Computed once per input, applied
    to each linear reading it."""
    h = hessian.detach().float()
    lam = damp * float(torch.diag(h).mean())
    damped = h.clone()
    damped.diagonal().add_(lam)
    factor = torch.linalg.cholesky(damped)
    del damped
    scaled = drift.detach().float() * share
    return torch.cholesky_solve(scaled.t().contiguous(), factor).t().contiguous()


def column_order(hessian: torch.Tensor, group_size: int, order: str) -> torch.Tensor:
    """The order [in] in which ``order`` rounds the input columns: none = as stored; group = each group's columns
    in turn, within a group those of the largest input second moment (``hessian``'s diagonal) first; global = all
    columns by that moment (GPTQ's activation order)."""
    in_features = hessian.shape[0]
    if order == "none":
        return torch.arange(in_features)
    energy = -torch.diag(hessian).float().cpu()
    if order == "global":
        return torch.argsort(energy, stable=True)
    if order == "group":
        within = torch.argsort(energy.view(-1, group_size), dim=1, stable=True)
        return (within + torch.arange(0, in_features, group_size).unsqueeze(1)).reshape(-1)
    raise ValueError(f"GPTQ column order must be group, global or none, got {order!r}")


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  clip_ratio_min: torch.Tensor | None = None, clip_ratio_max: torch.Tensor | None = None,
                  damp: float = 0.01, order: str = "global") -> QuantizedWeight:
    """int4 of ``weight`` [out, in] by GPTQ under ``hessian`` [in, in] (= sum_t x_t x_t^T).

    ``clip_ratio_min``/``clip_ratio_max`` [out, in/g] scale each group's min/max (1 = no clipping).
    ``damp`` is added to the diagonal as a fraction of its mean (numerical safety). ``order``: see
    ``column_order``. With none and group each group's (scale, zero) is set from the weights as updated when its
    first column is reached; with global a group's columns are spread over the whole pass, so every group's is set
    before rounding from the weights as given (the "static groups" of act-order checkpoints without g_idx).
    """
    w = weight.detach().float().clone()
    out_features, in_features = w.shape
    if in_features % group_size or BLOCK_COLUMNS % group_size or group_size % INNER_COLUMNS:
        raise ValueError(f"group size {group_size} must divide {in_features} and {BLOCK_COLUMNS} and be a multiple "
                         f"of {INNER_COLUMNS}")
    perm = column_order(hessian, group_size, order)
    w[:, torch.diag(hessian) == 0] = 0.0  # as _inverse_factor does: the static groups' ranges see it too
    num_groups = in_features // group_size
    scales = torch.zeros(out_features, num_groups, dtype=torch.float16, device=w.device)
    zeros = torch.zeros(out_features, num_groups, device=w.device)

    def group_params(g: int | slice, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = members.amin(dim=-1), members.amax(dim=-1)
        if clip_ratio_min is not None:
            lo = torch.where(lo < 0, lo * clip_ratio_min[:, g], lo)
        if clip_ratio_max is not None:
            hi = torch.where(hi > 0, hi * clip_ratio_max[:, g], hi)
        s16, z = quantize_params(lo, hi)
        scales[:, g], zeros[:, g] = s16, z
        return s16.float(), z

    static = None
    if order == "global":
        s, z = group_params(slice(None), w.view(out_features, num_groups, group_size))
        static = StaticParams(scales=s.t().cpu().contiguous().numpy(), zeros=z.float().t().cpu().contiguous().numpy(),
                              column_group=(perm // group_size).numpy())
    wp = w[:, perm.to(w.device)]
    hp = perm.to(hessian.device)
    u = _inverse_factor(wp, hessian[hp][:, hp], damp)
    qp = _round_columns(wp, u, group_size, lambda g, block, j: group_params(g, block[:, j:j + group_size]), 0,
                        MAX_INT, static)
    q = torch.empty_like(qp)
    q[:, perm.to(q.device)] = qp
    return QuantizedWeight(q=q.to(torch.uint8), zeros=zeros.to(torch.uint8), scales=scales, group_size=group_size)


@torch.no_grad()
def gptq_quantize_int8(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01) -> Int8Weight:
    """Symmetric int8 per output channel of ``weight`` [out, in] by GPTQ under ``hessian`` [in, in]; the
    scales are round-to-nearest's (``int8_scales`` of the weight as given)."""
    w = weight.detach().float().clone()
    scales = int8_scales(w)
    zero = torch.zeros_like(scales, dtype=torch.float32)
    u = _inverse_factor(w, hessian, damp)
    q = _round_columns(w, u, w.shape[1], lambda g, block, j: (scales.float(), zero), -INT8_MAX, INT8_MAX)
    return Int8Weight(q=q.to(torch.int8), scales=scales)
