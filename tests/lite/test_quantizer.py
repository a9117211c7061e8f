"""Pure int4 math against hand-computed references: quantize/dequantize, and the AWQ GEMM packing
checked bit by bit against a packer written here with explicit integer arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit.lite.quantizer import (AWQ_ORDER, QuantizedWeight, check_group_size, pack_awq_gemm, pack_int4,
                                  pseudo_quantize, quantize, unpack_awq_gemm, unpack_int4)

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # written out again on purpose: the test does not trust the module's constant


def hand_pack(values: list[list[int]]) -> list[list[int]]:
    """Independent reference packer: 8 columns per int32, nibble k <- column 8c + ORDER[k], signed int32."""
    packed = []
    for row in values:
        words = []
        for c in range(len(row) // 8):
            word = 0
            for k in range(8):
                word += row[8 * c + ORDER[k]] * (16 ** k)
            words.append(word - 2**32 if word >= 2**31 else word)
        packed.append(words)
    return packed


def test_order_constant_matches_the_format():
    assert list(AWQ_ORDER) == ORDER


def test_quantize_one_group_by_hand():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    qw = quantize(w, group_size=4)
    scale = float(np.float16(3.0 / 15.0))  # (max - min) / 15, stored as fp16: 0.199951171875
    assert scale == 0.199951171875
    zero = round(1.0 / scale)  # round(-min / scale) = round(5.0012) = 5
    q = [min(max(round(v / scale) + zero, 0), 15) for v in (-1.0, 0.0, 0.5, 2.0)]
    assert zero == 5 and q == [0, 5, 8, 15]
    assert qw.q.tolist() == [q] and qw.zeros.tolist() == [[zero]] and qw.scales.tolist() == [[scale]]
    expected = [(v - zero) * scale for v in q]
    assert qw.dequantize()[0].tolist() == pytest.approx(expected, abs=0, rel=1e-7)
    assert pseudo_quantize(w, 4).tolist() == qw.dequantize().tolist()


def test_quantize_groups_are_independent_and_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    w[:, 64:] *= 100.0  # the second group of every row has a 100x larger range
    qw = quantize(w, 64)
    assert qw.q.shape == (16, 128) and qw.zeros.shape == (16, 2) and qw.scales.shape == (16, 2)
    assert qw.scales.dtype == torch.float16 and int(qw.q.max()) <= 15 and int(qw.zeros.max()) <= 15
    err = (qw.dequantize() - w).abs().view(16, 2, 64).amax(dim=2)
    assert bool((err <= qw.scales.float() * 0.5 + 1e-6 * w.abs().max()).all())  # half a step at most
    assert torch.equal(quantize(w[:, :64], 64).dequantize(), qw.dequantize()[:, :64])


def test_constant_and_one_signed_groups_are_represented():
    w = torch.full((8, 32), 0.25)
    assert torch.allclose(pseudo_quantize(w, 32), w, atol=0.25 / 15 / 2 + 1e-6)
    w = torch.linspace(1.0, 2.0, 32).repeat(8, 1)  # the range [1, 2] is widened to [0, 2]: zero point 0
    qw = quantize(w, 32)
    assert qw.zeros.tolist() == [[0]] * 8
    assert qw.scales.float().tolist() == [[float(np.float16(2.0 / 15))]] * 8
    assert float((qw.dequantize() - w).abs().max()) <= float(np.float16(2.0 / 15)) / 2 + 1e-6
    qn = quantize(-w, 32)
    assert qn.zeros.tolist() == [[15]] * 8
    assert float((qn.dequantize() + w).abs().max()) <= float(np.float16(2.0 / 15)) / 2 + 1e-6


def test_clip_ranges_saturate():
    w = torch.tensor([[-4.0, -1.0, 0.0, 1.0, 4.0, 0.5, -0.5, 2.0]])
    qw = quantize(w, 8, w_min=torch.tensor([[-2.0]]), w_max=torch.tensor([[2.0]]))
    d = qw.dequantize()[0]
    assert float(d[0]) == pytest.approx(-2.0, abs=0.14) and float(d[4]) == pytest.approx(2.0, abs=0.14)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide the 576 input channels of q"):
        check_group_size(576, 128, "q")
    check_group_size(576, 64, "q")


def test_pack_known_word():
    # columns 0..7 holding their own index: nibbles (low -> high) 0 2 4 6 1 3 5 7 = 0x75316420
    assert pack_int4(torch.arange(8, dtype=torch.uint8).view(1, 8)).tolist() == [[0x75316420]]
    # column 7 = 15 lands in the top nibble: the sign bit
    values = torch.zeros(1, 8, dtype=torch.uint8)
    values[0, 7] = 15
    assert pack_int4(values).tolist() == [[15 * 16**7 - 2**32]]


def test_pack_matches_hand_packer_and_round_trips():
    g = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (6, 32), generator=g, dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert packed.tolist() == hand_pack(values.tolist())
    assert torch.equal(unpack_int4(packed), values)


def test_pack_awq_gemm_layout_and_round_trip():
    torch.manual_seed(2)
    w = torch.randn(24, 128)  # [out, in]
    qw = quantize(w, 32)
    t = pack_awq_gemm(qw)
    assert t["qweight"].shape == (128, 3) and t["qweight"].dtype == torch.int32  # [in, out/8]
    assert t["qzeros"].shape == (4, 3) and t["qzeros"].dtype == torch.int32  # [in/g, out/8]
    assert t["scales"].shape == (4, 24) and t["scales"].dtype == torch.float16  # [in/g, out]
    assert t["qweight"].tolist() == hand_pack(qw.q.t().tolist())
    assert t["qzeros"].tolist() == hand_pack(qw.zeros.t().tolist())
    back = unpack_awq_gemm(t["qweight"], t["qzeros"], t["scales"])
    assert back.group_size == 32
    assert torch.equal(back.q, qw.q) and torch.equal(back.zeros, qw.zeros) and torch.equal(back.scales, qw.scales)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_unpack_hand_built_tensors():
    """W^T[i, j] = (q[i, j] - z[i / g, j]) * s[i / g, j], computed here element by element."""
    g = torch.Generator().manual_seed(3)
    in_f, out_f, gs = 64, 16, 32
    q = torch.randint(0, 16, (in_f, out_f), generator=g).tolist()
    z = torch.randint(0, 16, (in_f // gs, out_f), generator=g).tolist()
    s = (torch.rand(in_f // gs, out_f, generator=g) * 0.1 + 0.01).half()
    qweight = torch.tensor(hand_pack(q), dtype=torch.int32)
    qzeros = torch.tensor(hand_pack(z), dtype=torch.int32)
    w = unpack_awq_gemm(qweight, qzeros, s).dequantize()  # [out, in]
    sf = s.float().tolist()
    for i in range(in_f):
        for j in range(out_f):
            expected = float(np.float32(q[i][j] - z[i // gs][j]) * np.float32(sf[i // gs][j]))
            assert float(w[j, i]) == expected


def test_unpack_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="inconsistent AWQ GEMM shapes"):
        unpack_awq_gemm(torch.zeros(64, 2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
                        torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="int32"):
        unpack_awq_gemm(torch.zeros(64, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int32),
                        torch.zeros(2, 16, dtype=torch.float16))


def test_quantized_weight_is_plain_data():
    qw = quantize(torch.randn(8, 32), 32)
    assert isinstance(qw, QuantizedWeight) and qw.q.dtype == torch.uint8
