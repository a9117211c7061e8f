"""The searches against brute force: the clip error formula equals the output error over tokens, the
clip search and the least-squares refinement never do worse than plain quantization, and the scale
search never scores worse than no smoothing and leaves the module unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmkit.lite.quantizer import quantize
from lmkit.lite.search import (candidate_scales, group_error, refine_quantization, search_clip, search_scale,
                               shrink_grid, weight_group_mean)


def _data(out_f=12, in_f=64, tokens=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(tokens, in_f, generator=g) * (1 + 5 * torch.rand(in_f, generator=g))  # uneven channels
    return w, x


def _moments(x, group_size):
    xg = x.view(x.shape[0], -1, group_size).transpose(0, 1)
    return torch.bmm(xg.transpose(1, 2), xg)


def test_group_error_is_output_error_per_group():
    w, x = _data()
    gs = 32
    delta = quantize(w, gs).dequantize() - w
    err = group_error(delta.view(12, 2, gs), _moments(x, gs))
    for G in range(2):
        part = x[:, G * gs:(G + 1) * gs] @ delta[:, G * gs:(G + 1) * gs].t()  # [tokens, out]
        assert torch.allclose(err[:, G], part.pow(2).sum(0), rtol=1e-4)


def test_clip_search_never_worse_and_ranges_shrink():
    w, x = _data()
    gs = 32
    C = _moments(x, gs)
    w_min, w_max = search_clip(w, C, gs, shrink_grid(11, 0.5))
    full = group_error((quantize(w, gs).dequantize() - w).view(12, 2, gs), C)
    clipped = group_error((quantize(w, gs, w_min, w_max).dequantize() - w).view(12, 2, gs), C)
    assert bool((clipped <= full + 1e-6).all()) and float(clipped.sum()) < float(full.sum())
    groups = w.view(12, 2, gs)
    assert bool((w_min >= groups.amin(2) - 1e-7).all()) and bool((w_max <= groups.amax(2) + 1e-7).all())


def test_clip_search_rounds_as_the_quantizer_does_in_either_layout():
    """The clip search's float rounding error is the quantizer's dequantize(quantize(W)) - W bit for bit (clipped
    ranges, a constant group, a group that does not straddle 0), row-major or group-major."""
    from lmkit.lite.search import _rounding_error

    w, _ = _data(seed=4)
    w[0, :32] = 0.5  # a constant group
    w[1, 32:] = w[1, 32:].abs() + 0.1  # all positive: the range widens to hold 0
    gs = 32
    groups = w.view(12, 2, gs)
    lo, hi = groups.amin(2) * 0.8, groups.amax(2) * 0.9
    expected = quantize(w, gs, lo, hi).dequantize().view(12, 2, gs) - groups
    assert torch.equal(_rounding_error(groups.clone(), lo, hi), expected)
    major = _rounding_error(groups.transpose(0, 1).contiguous(), lo.t(), hi.t())
    assert torch.equal(major, expected.transpose(0, 1))


def test_refinement_never_worse_per_group():
    w, x = _data(seed=1)
    gs = 32
    C = _moments(x, gs)
    w_min, w_max = search_clip(w, C, gs, shrink_grid(11, 0.5))
    base = quantize(w, gs, w_min, w_max)
    refined = refine_quantization(w, C, gs, w_min, w_max)
    e_base = group_error((base.dequantize() - w).view(12, 2, gs), C)
    e_ref = group_error((refined.dequantize() - w).view(12, 2, gs), C)
    assert bool((e_ref <= e_base * (1 + 1e-6) + 1e-9).all()) and float(e_ref.sum()) < float(e_base.sum())
    assert refined.q.dtype == torch.uint8 and int(refined.q.max()) <= 15 and int(refined.zeros.max()) <= 15


def test_candidate_scales_are_normalised():
    x_mean = torch.tensor([0.1, 1.0, 10.0, 3.0])
    for form in ("act", "duo"):
        s = candidate_scales(x_mean, torch.full((4,), 0.5), 0.5, form)
        assert abs(float(s.max() * s.min()) - 1.0) < 1e-5
    assert torch.allclose(candidate_scales(x_mean, torch.ones(4), 0.0, "act"), torch.ones(4))
    w_mean = weight_group_mean([torch.tensor([[1.0, -2.0, 0.5, 4.0]])], 2)
    assert torch.allclose(w_mean, torch.tensor([0.5, 1.0, 0.125, 1.0]), atol=1e-5)


def test_scale_search_never_worse_than_identity_and_restores_weights():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 96, bias=False), nn.SiLU(), nn.Linear(96, 64, bias=False))
    x = torch.randn(4, 50, 64) * (1 + 10 * (torch.arange(64) % 7 == 0))  # a few outlier channels
    before = mlp[0].weight.detach().clone()
    result = search_scale(lambda t: mlp(t), [mlp[0]], x, x.abs().reshape(-1, 64).mean(0), 32, num_grid=10)
    assert torch.equal(mlp[0].weight, before)
    assert result.loss <= result.loss_identity
    assert result.ratio > 0 and result.loss < result.loss_identity  # outlier channels: smoothing helps


def test_gptq_rounding_lowers_output_error():
    from lmkit.lite.gptq import gptq_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    mix = torch.eye(128) + 0.5 * torch.randn(128, 128, generator=g) / 128**0.5  # correlated input channels
    x = torch.randn(2000, 128, generator=g) @ mix * (1 + 3 * torch.rand(128, generator=g))
    rtn = quantize(w, 32)
    gptq = gptq_quantize(w, x.t() @ x, 32)
    assert gptq.q.shape == rtn.q.shape and gptq.scales.dtype == torch.float16 and int(gptq.q.max()) <= 15

    def out_err(qw):
        return float((x @ (qw.dequantize() - w).t()).pow(2).mean())

    assert out_err(gptq) < 0.95 * out_err(rtn)


def _gptq_float64(w: torch.Tensor, hessian: torch.Tensor, group_size: int, q_min: int, q_max: int,
                  group_params, damp: float = 0.01, perm: torch.Tensor | None = None,
                  static: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """GPTQ as its module docstring states it, column by column in float64, each column's error pushed onto every
    later column at once (no lazy blocks): the integers [out, in]. ``perm``: the order of the columns (a group's
    params from its members when its first column in that order comes); ``static``: every group's (scale, zero)
    [out, groups] fixed beforehand."""
    perm = torch.arange(w.shape[1]) if perm is None else perm
    w = w.double()[:, perm].clone()
    h = hessian.double()[perm][:, perm].clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(h.shape[0], dtype=torch.float64) * (damp * float(torch.diag(h).mean()))
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.zeros_like(w)
    params = {}
    for c in range(w.shape[1]):
        group = int(perm[c]) // group_size
        if static is not None:
            scale, zero = static[0][:, group].double(), static[1][:, group].double()
        elif group not in params:
            members = (perm // group_size == group).nonzero().flatten()
            params[group] = tuple(t.double() for t in group_params(w[:, members]))
        if static is None:
            scale, zero = params[group]
        q[:, c] = (torch.round(w[:, c] / scale) + zero).clamp(q_min, q_max)
        err = (w[:, c] - (q[:, c] - zero) * scale) / u[c, c]
        w[:, c + 1:] -= err.unsqueeze(1) * u[c, c + 1:].unsqueeze(0)
    out = torch.empty_like(q)
    out[:, perm] = q
    return out


def _correlated_inputs(seed: int, tokens: int, channels: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(channels) + 0.7 * torch.randn(channels, channels, generator=g) / channels**0.5
    return torch.randn(tokens, channels, generator=g) @ mix * (1 + 3 * torch.rand(channels, generator=g)) ** 2


@pytest.mark.parametrize("order", ["none", "group", "global"])
def test_gptq_matches_a_float64_reference_without_lazy_blocks(order):
    """int4 in groups of 32 over 320 input channels (three lazy blocks, the last one partial; a dead channel) in
    each column order, and int8 per row: the integers of the float64 reference, but for the rare weight near a
    rounding tie."""
    from lmkit.lite.gptq import column_order, gptq_quantize, gptq_quantize_int8
    from lmkit.lite.int8 import QMAX, int8_scales
    from lmkit.lite.quantizer import MAX_INT, quantize_params

    w = torch.randn(40, 320, generator=torch.Generator().manual_seed(7))
    x = _correlated_inputs(8, 3000, 320)
    x[:, 5] = 0.0  # a channel no token reaches
    hessian = x.t() @ x

    def int4_params(members):
        scale, zero = quantize_params(members.amin(dim=1).float(), members.amax(dim=1).float())
        return scale.float(), zero

    perm = column_order(hessian, 32, order)
    assert sorted(perm.tolist()) == list(range(320))
    energy = torch.diag(hessian)[perm]
    if order == "none":
        assert torch.equal(perm, torch.arange(320))
    elif order == "group":  # each group's own columns, strongest first
        assert torch.equal(perm // 32, torch.arange(320) // 32) and bool((energy.view(10, 32).diff(dim=1) <= 0).all())
    else:  # strongest first over the whole input
        assert bool((energy.diff() <= 0).all()) and not torch.equal(perm // 32, torch.arange(320) // 32)
    ratio_min = ratio_max = None
    static = None
    if order == "global":  # every group's range fixed first, shrunk by the clip search's ratios
        g = torch.Generator().manual_seed(9)
        ratio_min, ratio_max = (0.7 + 0.3 * torch.rand(40, 10, generator=g) for _ in range(2))
        grouped = w.clone()
        grouped[:, 5] = 0.0
        lo, hi = grouped.view(40, 10, 32).amin(dim=2), grouped.view(40, 10, 32).amax(dim=2)
        lo, hi = torch.where(lo < 0, lo * ratio_min, lo), torch.where(hi > 0, hi * ratio_max, hi)
        scale, zero = quantize_params(lo, hi)
        static = (scale.float(), zero)
    got = gptq_quantize(w, hessian, 32, ratio_min, ratio_max, order=order)
    ref = _gptq_float64(w, hessian, 32, 0, MAX_INT, int4_params, perm=perm, static=static)
    assert float((got.q.float() == ref.float()).float().mean()) > 0.995
    assert torch.all(got.dequantize()[:, 5] == 0)  # the dead channel
    if order == "none":
        scales = int8_scales(w)
        got8 = gptq_quantize_int8(w, hessian)
        ref8 = _gptq_float64(w, hessian, w.shape[1], -QMAX, QMAX, lambda m: (scales.float(), torch.zeros(40)))
        assert float((got8.q.float() == ref8.float()).float().mean()) > 0.995
        assert torch.all(got8.q[:, 5] == 0)


def test_activation_order_lowers_gptqs_output_error():
    """Channels of very unequal energy: rounding the strongest first (group, then global order) leaves less output
    error than the stored order, on inputs the Hessian did not see."""
    from lmkit.lite.gptq import gptq_quantize

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    x, held_out = _correlated_inputs(4, 6000, 256).split([4000, 2000])
    errors = {order: float((held_out @ (gptq_quantize(w, x.t() @ x, 64, order=order).dequantize() - w).t())
                           .pow(2).mean()) for order in ("none", "group", "global")}
    assert errors["group"] < 0.99 * errors["none"], errors
    assert errors["global"] < 0.95 * errors["group"], errors


def test_reference_correction_solves_the_damped_least_squares_and_gptq_follows_it():
    """W + W B = argmin_W* sum_t |W r_t - W* x_t|^2 + lam |W* - W|^2 (float64 normal equations) at share 1, W alone at
    share 0; GPTQ of W + W B under x's Hessian leaves less error against the fp model's outputs W r_t than GPTQ of W,
    on tokens it did not see, and a quarter share lies between."""
    from lmkit.lite.gptq import gptq_quantize, reference_correction

    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 128, generator=g)
    drift = 0.3 * torch.randn(128, 128, generator=g) / 128**0.5  # the quantized model's inputs drift from the fp's
    r = _correlated_inputs(12, 6000, 128)
    x = r + r @ drift + 0.2 * torch.randn(6000, 128, generator=g)
    (r, r_out), (x, x_out) = r.split([4000, 2000]), x.split([4000, 2000])
    hessian, difference = x.t() @ x, (r - x).t() @ x
    assert torch.equal(reference_correction(hessian, difference, 0.0), torch.zeros(128, 128))
    got = w + w @ reference_correction(hessian, difference, 1.0, damp=0.01)
    h, c, wd = x.double().t() @ x.double(), r.double().t() @ x.double(), w.double()
    lam = 0.01 * float(torch.diag(h).mean())
    expected = torch.linalg.solve(h + lam * torch.eye(128, dtype=torch.float64), (wd @ c + lam * wd).t()).t()
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-4
    assert float((got - w).norm() / w.norm()) > 0.05  # the drift is worth correcting
    quarter = w + w @ reference_correction(hessian, difference, 0.25)
    assert torch.allclose(quarter, w + 0.25 * (got - w), rtol=1e-3, atol=1e-4)

    def error(qw):  # against the fp model's outputs on held-out tokens
        return float((r_out @ w.t() - x_out @ qw.dequantize().t()).pow(2).mean())

    errors = [error(gptq_quantize(v, hessian, 32)) for v in (got, quarter, w)]
    assert errors[0] < 0.8 * errors[1] < 0.8 * 0.8 * errors[2], errors


def test_element_wise_passes_take_threads_by_weight_size():
    """One thread over a weight that fits the caches (SmolLM2's largest, 1536 x 576), all of torch's over a large
    one (an 8B model's down_proj)."""
    from lmkit.lite.threads import elementwise_threads, torch_threads

    with torch_threads(2):
        assert elementwise_threads(1536 * 576) == 1 and elementwise_threads(4096 * 14336) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
@pytest.mark.parametrize("order", ["global", "group", "none"])
def test_gptq_on_a_gpu_gives_the_cpus_integers(order):
    """lite on --device cuda: the weight, the Hessian, the clip ratios and the fp-model correction on the GPU, the
    column loop on the CPU."""
    from lmkit.lite.gptq import gptq_quantize, reference_correction

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(1000, 256, generator=g) * (1 + 3 * torch.rand(256, generator=g))
    r = x + 0.1 * torch.randn(1000, 256, generator=g)
    ratio = 0.8 + 0.2 * torch.rand(64, 4, generator=g)
    correction = reference_correction(x.t() @ x, (r - x).t() @ x, 0.25)
    on_gpu = reference_correction((x.t() @ x).cuda(), ((r - x).t() @ x).cuda(), 0.25)
    assert on_gpu.device.type == "cuda" and torch.allclose(on_gpu.cpu(), correction, atol=1e-4)
    cpu = gptq_quantize(w + w @ correction, x.t() @ x, 64, ratio, ratio, order=order)
    gpu = gptq_quantize((w + w @ correction).cuda(), (x.t() @ x).cuda(), 64, ratio.cuda(), ratio.cuda(), order=order)
    assert gpu.q.device.type == "cuda" and float((gpu.q.cpu() == cpu.q).float().mean()) > 0.99
