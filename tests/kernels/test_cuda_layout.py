"""The CUDA backend's int4 layout, built on the host at load time: checked on every machine (no GPU needed)
against lmkit.lite's AWQ packer, the independent reference of the AutoAWQ "GEMM" format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit import _engine
from lmkit.lite.quantizer import pack_awq_gemm, quantize


@pytest.mark.parametrize("out_features,in_features,group_size", [(8, 64, 32), (72, 576, 64), (40, 256, 128)])
def test_repack_awq_matches_the_unpacked_weight(out_features, in_features, group_size):
    torch.manual_seed(out_features + in_features)
    qw = quantize(torch.randn(out_features, in_features), group_size)
    packed = pack_awq_gemm(qw)
    words, scales, zeros = _engine.cuda.repack_awq(packed["qweight"].numpy(), packed["qzeros"].numpy(),
                                                   packed["scales"].numpy(), group_size)
    assert words.shape == (out_features, in_features // 8) and words.dtype == np.uint32
    # word w of row n holds q[n, 8w + i] in bits 4i .. 4i + 3
    nibbles = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    np.testing.assert_array_equal(nibbles.reshape(out_features, in_features), qw.q.numpy())
    np.testing.assert_array_equal(zeros, qw.zeros.numpy())
    np.testing.assert_array_equal(scales.view(np.float16), qw.scales.numpy())


def test_repack_awq_rejects_inconsistent_tensors():
    qw = quantize(torch.randn(16, 64), 32)
    packed = {k: v.numpy() for k, v in pack_awq_gemm(qw).items()}
    with pytest.raises(ValueError, match="group size a multiple of 32"):
        _engine.cuda.repack_awq(packed["qweight"], packed["qzeros"], packed["scales"], 16)
    with pytest.raises(ValueError, match=r"scales has shape \[1, 16\]; the layer's shape implies \[2, 16\]"):
        _engine.cuda.repack_awq(packed["qweight"], packed["qzeros"], packed["scales"][:1], 32)
    with pytest.raises(ValueError, match=r"qzeros has shape \[2, 1\]"):
        _engine.cuda.repack_awq(packed["qweight"], packed["qzeros"][:, :1], packed["scales"], 32)
    with pytest.raises(ValueError, match="float16"):
        _engine.cuda.repack_awq(packed["qweight"], packed["qzeros"], packed["scales"].astype(np.float32), 32)
