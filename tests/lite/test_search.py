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
                  group_params, damp: float = 0.01) -> torch.Tensor:
    """GPTQ as its module docstring states it, column by column in float64, each column's error pushed onto every
    later column at once (no lazy blocks): the integers [out, in]."""
    w = w.double().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(h.shape[0], dtype=torch.float64) * (damp * float(torch.diag(h).mean()))
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.zeros_like(w)
    for c in range(w.shape[1]):
        if c % group_size == 0:
            scale, zero = (t.double() for t in group_params(w[:, c:c + group_size]))
        q[:, c] = (torch.round(w[:, c] / scale) + zero).clamp(q_min, q_max)
        err = (w[:, c] - (q[:, c] - zero) * scale) / u[c, c]
        w[:, c + 1:] -= err.unsqueeze(1) * u[c, c + 1:].unsqueeze(0)
    return q


def test_gptq_matches_a_float64_reference_without_lazy_blocks():
    """int4 in groups of 32 over 320 input channels (three lazy blocks, the last one partial; a dead channel) and
    int8 per row: the integers of the float64 reference, but for the rare weight near a rounding tie."""
    from lmkit.lite.gptq import gptq_quantize, gptq_quantize_int8
    from lmkit.lite.int8 import QMAX, int8_scales
    from lmkit.lite.quantizer import MAX_INT, quantize_params

    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 320, generator=g)
    mix = torch.eye(320) + 0.7 * torch.randn(320, 320, generator=g) / 320**0.5
    x = torch.randn(3000, 320, generator=g) @ mix * (1 + 3 * torch.rand(320, generator=g))
    x[:, 5] = 0.0  # a channel no token reaches
    hessian = x.t() @ x

    def int4_params(members):
        scale, zero = quantize_params(members.amin(dim=1).float(), members.amax(dim=1).float())
        return scale.float(), zero

    got = gptq_quantize(w, hessian, 32)
    ref = _gptq_float64(w, hessian, 32, 0, MAX_INT, int4_params)
    assert float((got.q.float() == ref.float()).float().mean()) > 0.995
    scales = int8_scales(w)
    got8 = gptq_quantize_int8(w, hessian)
    ref8 = _gptq_float64(w, hessian, w.shape[1], -QMAX, QMAX, lambda m: (scales.float(), torch.zeros(40)))
    assert float((got8.q.float() == ref8.float()).float().mean()) > 0.995
    assert torch.all(got.dequantize()[:, 5] == 0) and torch.all(got8.q[:, 5] == 0)  # the dead channel


def test_element_wise_passes_take_threads_by_weight_size():
    """One thread over a weight that fits the caches (SmolLM2's largest, 1536 x 576), all of torch's over a large
    one (an 8B model's down_proj)."""
    from lmkit.lite.threads import elementwise_threads, torch_threads

    with torch_threads(2):
        assert elementwise_threads(1536 * 576) == 1 and elementwise_threads(4096 * 14336) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
def test_gptq_on_a_gpu_gives_the_cpus_integers():
    """lite on --device cuda: the weight, the Hessian and the clip ratios on the GPU, the column loop on the CPU."""
    from lmkit.lite.gptq import gptq_quantize

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(1000, 256, generator=g) * (1 + 3 * torch.rand(256, generator=g))
    ratio = 0.8 + 0.2 * torch.rand(64, 4, generator=g)
    cpu = gptq_quantize(w, x.t() @ x, 64, ratio, ratio)
    gpu = gptq_quantize(w.cuda(), (x.t() @ x).cuda(), 64, ratio.cuda(), ratio.cuda())
    assert gpu.q.device.type == "cuda" and float((gpu.q.cpu() == cpu.q).float().mean()) > 0.99
