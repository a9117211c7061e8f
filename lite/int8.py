"""Pure int8 tensor math of SmoothQuant W8A8; knows nothing about models. Shapes follow ``nn.Linear``:

    weight w [out, in], symmetric per output channel:
        scale[o] = max_i |w[o, i]| / 127 (rounded to fp16; a zero row gets the smallest scale)
        q[o, i]  = clamp(round(w[o, i] / scale[o]), -127, 127)          int8
        dequantized w[o, i] = q[o, i] * scale[o]                        (fp32 from the fp16 scale)
    activation x [..., in], symmetric per token, dynamic (computed at run time from the token itself):
        x_q = clamp(round(x / s), -127, 127) * s,   s = max_i |x_i| / 127

This is compressed-tensors' W8A8 int8 scheme (weights ``strategy: channel``, input activations ``strategy:
token, dynamic: true``), what llm-compressor's SmoothQuant presets write and vLLM runs; the searches score
candidates with these formulas, and the torch reference (lmkit.lite.checkpoint) runs compressed-tensors'
own fake quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_BITS = 8
QMAX = 127
_MIN_SCALE = 2.0**-24  # the smallest positive fp16 (subnormal): a zero row's scale, exact in fp16


@dataclass(frozen=True)
class Int8Weight:
    """One linear's int8 weight: ``q`` int8 [out, in], ``scales`` fp16 [out]."""

    q: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: q * scale, row by row."""
        return self.q.float() * self.scales.float().unsqueeze(1)


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """fp16 [out]: the per-row scales of ``w`` [out, in] (max |w| / 127, at least the smallest fp16)."""
    return (w.detach().float().abs().amax(dim=1) / QMAX).clamp(min=_MIN_SCALE).to(torch.float16)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Round-to-nearest int8 of ``w`` [out, in] per output channel (module docstring)."""
    scales = int8_scales(w)
    q = torch.round(w.detach().float() / scales.float().unsqueeze(1)).clamp_(-QMAX, QMAX)
    return Int8Weight(q=q.to(torch.int8), scales=scales)


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., in] through dynamic per-token int8 and back (module docstring), in x's dtype."""
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / QMAX
    return (torch.round(x / s).clamp_(-QMAX, QMAX) * s).to(x.dtype)
