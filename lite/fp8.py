"""``lmkit lite fp8``: a floating-point checkpoint -> compressed-tensors FP8 E4M3, round to nearest (no calibration),
in llm-compressor's layout, through lite/rtn.py's loop (every linear of the model's table; the rest in fp16):

    weight_scale = max|W[n, :]| / 448 per output channel   (compressed-tensors' calculate_qparams, FP8 args)
    weight       = E4M3(W / weight_scale)                    (its Float/NaiveQuantizationCompressor.compress)
    scheme dynamic:     format float-quantized, input activations FP8 dynamic per token (FP8_DYNAMIC)
    scheme weight-only: format naive-quantized, no activation quantization

The format is the one compressed-tensors infers for the scheme (infer_module_format), its compressor the one
registered for that format. lmkit's CPU engine dequantizes the weights at load (lmkit/models/fp8.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmkit.lite.config import Fp8Config
from lmkit.lite.progress import Reporter
from lmkit.lite.requirements import require
from lmkit.lite.rtn import REQUIRED, RtnResult, write_rounded

NUM_BITS = 8
Fp8Result = RtnResult  # what quantize_fp8 did


def fp8_scheme(scheme: str):
    """compressed-tensors' QuantizationScheme of ``scheme`` ("dynamic": FP8_DYNAMIC; "weight-only"): E4M3 weights,
    symmetric, per output channel; FP8 dynamic per-token input activations for "dynamic"."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=NUM_BITS, type="float", symmetric=True, strategy="channel", dynamic=False)
    acts = QuantizationArgs(num_bits=NUM_BITS, type="float", symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights,
                              input_activations=acts if scheme == "dynamic" else None)


def fp8_format(scheme) -> str:
    """The compression format compressed-tensors infers for a Linear under ``scheme``."""
    from compressed_tensors.compressors.format import infer_module_format

    return infer_module_format(torch.nn.Linear, scheme).value


def fp8_quantization_config(scheme: str, modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` of an FP8 checkpoint of ``scheme`` (Fp8Config.scheme), with
    ``modules_to_not_convert`` in its ``ignore`` list."""
    from compressed_tensors.quantization import QuantizationConfig

    qs = fp8_scheme(scheme)
    config = QuantizationConfig(config_groups={"group_0": qs}, format=fp8_format(qs),
                                quantization_status="compressed", ignore=list(modules_to_not_convert)).model_dump()
    config["quant_method"] = "compressed-tensors"
    return config


def fp8_linear_tensors(name: str, weight: torch.Tensor, bias: torch.Tensor | None, scheme) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one linear ``name`` (without ``.weight``) under ``scheme``, on the host: ``weight``
    float8_e4m3fn [out, in] and ``weight_scale`` float32 [out, 1] as compressed-tensors' compressor for the
    scheme's format writes them; the bias in fp16."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)  # [out, 1]
    scale, zero = calculate_qparams(-amax, amax, scheme.weights)
    compressor = BaseCompressor.get_value_from_registry(fp8_format(scheme))
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    tensors = {f"{name}.weight": out["weight"].to("cpu").contiguous(),
               f"{name}.weight_scale": out["weight_scale"].to("cpu", torch.float32).reshape(-1, 1).contiguous()}
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to("cpu", torch.float16)
    return tensors


def quantize_fp8(model: str | Path | None, config: Fp8Config, reporter: Reporter | None = None) -> Fp8Result:
    """Quantize the HF checkpoint ``model`` (a folder, a hub id, or None/"smollm2" for the bundled SmolLM2) to FP8
    E4M3 and write it to ``config.work_dir`` as compressed-tensors (the scheme's format; lite/rtn.py's loop).

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished (temp folder, marker last, rename).
    Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported architecture, already
    quantized input, work dir).
    """
    require("fp8", REQUIRED)
    scheme = fp8_scheme(config.scheme)
    return write_rounded(model, config.work_dir, config.overwrite, config.device, "fp8", config.scheme,
                         fp8_format(scheme),
                         lambda name, local, linears: fp8_linear_tensors(name, linears[local].weight,
                                                                         linears[local].bias, scheme),
                         lambda dense: fp8_quantization_config(config.scheme, dense), reporter)
