"""KV cache fake quantization in torch, exactly the format written at the top of ``lmkit/kv_policy.py``
(which the engine implements), and an HF attention function that applies it per layer.

    key/value states  [batch, kv_heads, seq, head_dim]   (keys after RoPE, before GQA repetition)
    per (batch, head, token) row over head_dim:
        scale = fp16((max - min) / (2**bits - 1))      zero = fp16(min)
        q     = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)      (q = 0 where scale == 0)
        x'    = q * scale + zero

Every key and value, the current token's own included, is quantized before attention reads it: the
engine writes a chunk's K/V into the quantized cache, then attention reads the cache. Queries stay fp.

The attention function wraps the HF attention function the architecture's KV calibration hooks name
(``lmkit.models``: sdpa, or the model's own eager function where sdpa cannot do what it needs: Gemma 2's
logit soft-capping) and is registered with that function's masks (sdpa: boolean, eager: additive). HF
hands it K after q/k norms and RoPE, and the scaling, soft-cap and sliding window, so those behave exactly
as in the fp model. It reads two keyword arguments that ``transformers`` passes from the model call down
to attention:

    model(input_ids=..., kv_bits=[8, 4, 0, ...])   per layer bits (0 = fp); None = fp everywhere
    model(input_ids=..., kv_probe=probe)           a KvErrorProbe: measures every layer at int8 / int4
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

KV_FAKE_QUANT_ATTENTION = "lmkit_kv_fake_quant"  # over sdpa; over another function: this + "__" + its name
KV_QUANT_BITS = (8, 4)

# What the probe measures per layer: name -> (bits of K, bits of V); 0 = fp
PROBE_VARIANTS: dict[str, tuple[int, int]] = {"int8": (8, 8), "int4": (4, 4), "int4_k": (4, 0), "int4_v": (0, 4)}


def round_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest fp16 value (ties to even; inf beyond fp16's range), in ``x``'s dtype.

    float64 is rounded directly (torch's own float64 -> float16 cast goes through float32 and can round
    twice); other dtypes by the cast.
    """
    if x.dtype != torch.float64:
        return x.to(torch.float16).to(x.dtype)
    _, exponent = torch.frexp(x)  # x = m * 2**exponent, 0.5 <= |m| < 1: 11 significant bits -> ulp below
    ulp = torch.ldexp(torch.ones_like(x), (exponent - 11).clamp(min=-24))  # -24: fp16 subnormal spacing
    rounded = torch.round(x / ulp) * ulp
    return torch.where(rounded.abs() > 65504, torch.copysign(torch.full_like(x, float("inf")), x), rounded)


def fake_quant_kv(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize-dequantize ``x`` over its last dim as the engine's KV cache does (see the module doc).

    bits: 0 (returns ``x`` itself), 8 or 4. Computes in float64 for float64 input, else in float32;
    returns ``x``'s dtype. ValueError for other bits.
    """
    if bits == 0:
        return x
    if bits not in KV_QUANT_BITS:
        raise ValueError(f"KV bits must be 0 (fp), 8 or 4, got {bits!r}")
    levels = 2**bits - 1
    work = x if x.dtype == torch.float64 else x.float()
    lo = work.amin(dim=-1, keepdim=True)
    hi = work.amax(dim=-1, keepdim=True)
    scale = round_to_fp16((hi - lo) / levels)
    zero = round_to_fp16(lo)
    is_flat = scale == 0
    q = torch.round((work - zero) / torch.where(is_flat, torch.ones_like(scale), scale))  # round half to even
    q = torch.where(is_flat, torch.zeros_like(q), q.clamp(0, levels))
    return (q * scale + zero).to(x.dtype)


class KvErrorProbe:
    """Per layer, how much int8 / int4 KV change the output of the attention block (after o_proj) when
    only that layer is quantized: the block's input comes from the fp model, its output is compared
    with and without quantized K/V. The model itself runs on in fp.

    error[layer][variant] = sqrt(sum ||out_q - out_fp||^2 / sum ||out_fp||^2) over all observed tokens.
    """

    def __init__(self, num_layers: int, o_proj: str = "o_proj"):
        self.num_layers = num_layers
        self.o_proj = o_proj  # the output projection inside the attention module
        self.sum_sq_ref = [0.0] * num_layers
        self.sum_sq_err = [dict.fromkeys(PROBE_VARIANTS, 0.0) for _ in range(num_layers)]
        self.num_tokens = 0
        self.first_layer: int | None = None

    def observe(self, attend: Callable, module, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """The fp attention output of ``module`` (pre-o_proj, as ``attend`` returns it); accumulates errors."""

        def block_output(k_bits: int, v_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
            out, _ = attend(module, query, fake_quant_kv(key, k_bits), fake_quant_kv(value, v_bits),
                            attention_mask, **kwargs)
            return out, module.get_submodule(self.o_proj)(out.reshape(*out.shape[:2], -1))

        layer = module.layer_idx
        fp_out, fp_block = block_output(0, 0)
        self.sum_sq_ref[layer] += float(fp_block.double().square().sum())
        for name, (k_bits, v_bits) in PROBE_VARIANTS.items():
            _, block = block_output(k_bits, v_bits)
            self.sum_sq_err[layer][name] += float((block.double() - fp_block.double()).square().sum())
        if self.first_layer is None:  # the first layer with attention (a hybrid's layer 0 may be recurrent)
            self.first_layer = layer
        if layer == self.first_layer:
            self.num_tokens += query.shape[0] * query.shape[2]
        return fp_out

    def errors(self) -> list[dict[str, float]]:
        """Per layer: variant -> relative error of the attention block output (0 for a layer without attention)."""
        if not self.num_tokens:
            raise RuntimeError("the KV error probe observed no tokens")
        return [{name: (err / ref) ** 0.5 if ref > 0 else 0.0 for name, err in errs.items()}
                for errs, ref in zip(self.sum_sq_err, self.sum_sq_ref)]


def kv_fake_quant_attention(module, query, key, value, attention_mask, kv_bits=None, kv_probe=None, *,
                            attend: Callable, **kwargs):
    """HF attention function: ``attend`` (the wrapped HF attention function) over fake-quantized K/V at
    ``kv_bits[module.layer_idx]``, or, with a ``kv_probe``, the fp attention while the probe measures the
    quantized variants."""
    if kv_probe is not None:
        return kv_probe.observe(attend, module, query, key, value, attention_mask, kwargs), None
    bits = kv_bits[module.layer_idx] if kv_bits is not None else 0
    return attend(module, query, fake_quant_kv(key, bits), fake_quant_kv(value, bits), attention_mask, **kwargs)


def _attention_function(name: str) -> Callable:
    """A key of transformers' AttentionInterface ("sdpa"), or the dotted path of a model's own function."""
    from transformers import AttentionInterface

    if "." not in name:
        return AttentionInterface._global_mapping[name]
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(module), function)


def use_kv_fake_quant_attention(model, hooks=None) -> None:
    """Switch ``model`` (a transformers causal LM) to the fake-quant attention over the attention function
    of ``hooks`` (``lmkit.models.KvCalibHooks``; default: the registry's for the model's architecture),
    registering it once, with the masks that function reads under its name (so sliding windows and
    padding work as before). ValueError for an architecture lmkit does not know."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if hooks is None:
        from lmkit.models import get_architecture

        hooks = get_architecture(model.config.architectures[0]).kv_calib
        if hooks is None:
            raise ValueError(f"{model.config.architectures[0]}: fake-quantized KV evaluation is not supported yet "
                             "(some of its layers are recurrent and keep no K/V)")
    name = KV_FAKE_QUANT_ATTENTION
    if hooks.attention_function != "sdpa":
        name += "__" + hooks.attention_function.replace(".", "_")
    if name not in AttentionInterface._global_mapping:
        attend = _attention_function(hooks.attention_function)
        AttentionInterface.register(name, functools.partial(kv_fake_quant_attention, attend=attend))
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[hooks.attention_mask])
    model.set_attn_implementation(name)
