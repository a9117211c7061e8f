"""Pure int4 tensor math: group-wise asymmetric quantization and the AutoAWQ "GEMM" packing.

Knows nothing about models. Shapes follow ``nn.Linear``: a weight is ``[out, in]``; a group is
``group_size`` consecutive input channels of one output row, with its own (scale, zero):

    w [out, in] -> view [out, in/g, g]; per (row, group), with min <= 0 <= max (range widened to hold 0):
                   scale = (max - min) / 15 (rounded to fp16),
    zero = clamp(round(-min / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15)
    dequantized w = (q - zero) * scale      (computed in fp32 from the fp16 scale: exactly what a reader
                                             of the packed checkpoint computes)

The packed layout (DESIGN.md section 4) stores the transpose, ``W^T [in, out]``:

    qweight int32 [in, out/8]     qzeros int32 [in/g, out/8]     scales fp16 [in/g, out]
    one int32 = 8 output columns:  bits 4k..4k+3 hold column  8c + AWQ_ORDER[k]
    AWQ_ORDER = 0 2 4 6 1 3 5 7    i.e. nibbles (low -> high):  c0 c2 c4 c6 c1 c3 c5 c7
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.lite.config import SUPPORTED_GROUP_SIZES  # noqa: F401  (re-exported: the sizes the format allows)

NUM_BITS = 4
MAX_INT = 2**NUM_BITS - 1  # 15
PACK_NUM = 32 // NUM_BITS  # 8 nibbles per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k holds output column AWQ_ORDER[k] of each block of 8
_MIN_SCALE = 1e-5  # a constant group gets this scale instead of 0 (fp16 can hold it: subnormal-free)


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear's int4 weight, unpacked. ``q`` and ``zeros`` hold integers 0..15 (uint8)."""

    q: torch.Tensor  # uint8 [out, in]
    zeros: torch.Tensor  # uint8 [out, in/g]
    scales: torch.Tensor  # float16 [out, in/g]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: (q - zero) * scale, group by group."""
        return dequantize(self.q, self.zeros, self.scales, self.group_size)


def check_group_size(in_features: int, group_size: int, name: str = "weight") -> None:
    """ValueError naming ``name`` unless ``group_size`` is positive and divides ``in_features``."""
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input channels of {name}")


def quantize_params(w_min: torch.Tensor, w_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales fp16, zeros float32 holding integers 0..15) for groups whose range is [w_min, w_max].

    The range is widened to include 0 first, so the zero point always lies in 0..15 and a group of
    all-positive (or all-negative) values is still represented, not saturated.
    """
    w_min = w_min.clamp(max=0.0)
    w_max = w_max.clamp(min=0.0)
    scales = ((w_max - w_min).clamp(min=_MIN_SCALE) / MAX_INT).to(torch.float16)
    zeros = torch.round(-w_min / scales.float()).clamp(0, MAX_INT)
    return scales, zeros


def quantize(w: torch.Tensor, group_size: int, w_min: torch.Tensor | None = None,
             w_max: torch.Tensor | None = None) -> QuantizedWeight:
    """Group-wise asymmetric int4 of ``w`` [out, in] (any float dtype; computed in fp32).

    ``w_min``/``w_max`` [out, in/g] override each group's range (clipping: values outside it saturate);
    by default the group's own min and max are used.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [out, in] weight, got shape {list(w.shape)}")
    out_features, in_features = w.shape
    check_group_size(in_features, group_size)
    groups = w.float().reshape(out_features, in_features // group_size, group_size)
    if w_min is None:
        w_min = groups.amin(dim=2)
    if w_max is None:
        w_max = groups.amax(dim=2)
    scales, zeros = quantize_params(w_min.float(), w_max.float())
    q = torch.round(groups / scales.float().unsqueeze(2)) + zeros.unsqueeze(2)
    q = q.clamp_(0, MAX_INT).to(torch.uint8).reshape(out_features, in_features)
    return QuantizedWeight(q=q, zeros=zeros.to(torch.uint8), scales=scales, group_size=group_size)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [out, in] from q uint8 [out, in], zeros [out, in/g], scales [out, in/g]."""
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, in_features // group_size, group_size)
    w = (groups - zeros.float().unsqueeze(2)) * scales.float().unsqueeze(2)
    return w.reshape(out_features, in_features)


def pseudo_quantize(w: torch.Tensor, group_size: int, w_min: torch.Tensor | None = None,
                    w_max: torch.Tensor | None = None) -> torch.Tensor:
    """quantize then dequantize: float32 [out, in], the values the int4 checkpoint will hold."""
    return quantize(w, group_size, w_min, w_max).dequantize()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] from integers 0..15 [rows, cols] in AWQ_ORDER (see module docstring)."""
    rows, cols = values.shape
    if cols % PACK_NUM:
        raise ValueError(f"cannot pack {cols} columns into int32: the count must be a multiple of {PACK_NUM}")
    v = values.to(torch.int64).reshape(rows, cols // PACK_NUM, PACK_NUM)
    packed = torch.zeros(rows, cols // PACK_NUM, dtype=torch.int64)
    for k, column in enumerate(AWQ_ORDER):
        packed |= (v[:, :, column] & MAX_INT) << (NUM_BITS * k)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement into int32
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols*8] (integers 0..15) from int32 [rows, cols] in AWQ_ORDER."""
    rows, cols = packed.shape
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, cols, PACK_NUM, dtype=torch.uint8)
    for k, column in enumerate(AWQ_ORDER):
        out[:, :, column] = ((p >> (NUM_BITS * k)) & MAX_INT).to(torch.uint8)
    return out.reshape(rows, cols * PACK_NUM)


def pack_awq_gemm(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear: ``qweight`` int32 [in, out/8], ``qzeros`` int32 [in/g, out/8],
    ``scales`` fp16 [in/g, out]."""
    return {
        "qweight": pack_int4(qw.q.t().contiguous()),
        "qzeros": pack_int4(qw.zeros.t().contiguous()),
        "scales": qw.scales.t().contiguous(),
    }


def unpack_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """Inverse of ``pack_awq_gemm``; the group size is inferred (in / rows of ``scales``).

    Raises ValueError when the three shapes do not describe one AWQ GEMM linear.
    """
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    in_features, packed_out = qweight.shape
    num_groups, out_features = scales.shape
    if (qzeros.shape[0] != num_groups or qzeros.shape[1] != packed_out or out_features != packed_out * PACK_NUM
            or num_groups == 0 or in_features % num_groups):
        raise ValueError(
            f"inconsistent AWQ GEMM shapes: qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)}, "
            f"scales {list(scales.shape)} (expected [in, out/8], [in/g, out/8], [in/g, out])"
        )
    q = unpack_int4(qweight).t().contiguous()  # [out, in]
    zeros = unpack_int4(qzeros).t().contiguous()  # [out, in/g]
    return QuantizedWeight(q=q, zeros=zeros, scales=scales.t().contiguous().to(torch.float16),
                           group_size=in_features // num_groups)
