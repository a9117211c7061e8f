"""``lmkit lite fp4``: a floating-point checkpoint -> compressed-tensors FP4 (e2m1) weights, round to nearest (no
calibration), as llm-compressor's weight-only presets write them, through lite/rtn.py's loop (every linear of the
model's table; the rest in fp16):

    nvfp4 (NVFP4A16, format nvfp4-pack-quantized), per linear:
        weight_global_scale = 448 * 6 / max|W|                        (compressed-tensors' generate_gparam), the
                              least of a fused group's (q/k/v, gate/up) for all of them, as llm-compressor sets
                              it for vLLM (its update_fused_layer_weight_global_scales); lmkit's engine then
                              joins the group into one weight
        weight_scale        = E4M3(global * max|W[n, block]| / 6)     per block of 16 inputs (calculate_qparams)
        weight_packed       = e2m1(W * global / weight_scale), two codes a byte   (NVFP4PackedCompressor)
    mxfp4 (MXFP4A16, format mxfp4-pack-quantized): weight_scale an e8m0 exponent per block of 32 inputs, no global
        scale (MXFP4PackedCompressor)

Activations stay in float (the W4A4 presets need calibrated activation scales). lmkit's CPU engine runs both with
the codes as written (ops.h's Nvfp4 and Mxfp4 group heads); vLLM serves them on GPUs that have FP4 kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmkit.lite.config import Fp4Config
from lmkit.lite.progress import Reporter
from lmkit.lite.rtn import RtnResult, write_rounded

Fp4Result = RtnResult  # what quantize_fp4 did
PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}  # Fp4Config.format -> compressed-tensors' preset scheme


def fp4_scheme(fmt: str):
    """compressed-tensors' QuantizationScheme of ``fmt`` ("nvfp4", "mxfp4"): its weight-only preset."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(PRESETS[fmt], ["Linear"])


def fp4_quantization_config(fmt: str, modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` of an FP4 checkpoint of ``fmt``, with ``modules_to_not_convert`` in its
    ``ignore`` list."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": fp4_scheme(fmt)}, format=f"{fmt}-pack-quantized",
                                quantization_status="compressed", ignore=list(modules_to_not_convert)).model_dump()
    config["quant_method"] = "compressed-tensors"
    return config


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM's fused projections


def fused_global_scale(local: str, linears: dict[str, torch.nn.Module]) -> torch.Tensor:
    """NVFP4's global scale of the linear ``local`` of a layer whose linears are ``linears``: 448 * 6 / max|W|
    (compressed-tensors' generate_gparam), the least over its fused group (q/k/v, or gate/up of one MLP or
    expert) where it is in one."""
    from compressed_tensors.quantization.utils import generate_gparam

    prefix, _, leaf = local.rpartition(".")
    group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
    members = [linears[m] for m in ((f"{prefix}.{g}" if prefix else g) for g in group) if m in linears]
    return torch.min(torch.cat([generate_gparam(m.weight.detach().float().amin(), m.weight.detach().float().amax())
                                for m in members])).reshape([1])


def fp4_linear_tensors(name: str, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                       global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one linear ``name`` (without ``.weight``) in ``fmt``, on the host, as compressed-tensors'
    compressor for the format writes them (weight_packed U8 [out, in / 2], weight_scale per block, NVFP4's
    weight_global_scale: ``global_scale``, or the weight's own); the bias in fp16. Raises ValueError for inputs that
    are no multiple of 32 (the engine's FP4 panels)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = fp4_scheme(fmt)
    w = weight.detach().float()
    n, k = w.shape
    if k % 32:
        raise ValueError(f"{name}: {k} inputs; lmkit's FP4 weights need a multiple of 32")
    block = scheme.weights.group_size
    grouped = w.reshape(n, k // block, block)
    state = {"weight": w}
    if fmt == "nvfp4":
        if global_scale is None:
            global_scale = generate_gparam(w.amin(), w.amax())
        state["weight_global_scale"] = global_scale
    else:
        global_scale = None
    state["weight_scale"], state["weight_zero_point"] = calculate_qparams(grouped.amin(-1), grouped.amax(-1),
                                                                          scheme.weights, global_scale=global_scale)
    compressor = BaseCompressor.get_value_from_registry(f"{fmt}-pack-quantized")
    tensors = {f"{name}.{part}": t.to("cpu").contiguous()
               for part, t in compressor.compress(state, scheme).items()}
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to("cpu", torch.float16)
    return tensors


def quantize_fp4(model: str | Path | None, config: Fp4Config, reporter: Reporter | None = None) -> Fp4Result:
    """Quantize the HF checkpoint ``model`` (a folder, a hub id, or None/"smollm2" for the bundled SmolLM2) to FP4
    weights (``config.format``) and write it to ``config.work_dir`` as compressed-tensors.

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished (temp folder, marker last, rename).
    Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported architecture, already
    quantized input, a linear of inputs that are no multiple of 32, work dir).
    """
    return write_rounded(model, config.work_dir, config.overwrite, config.device, "fp4", config.format,
                         f"{config.format}-pack-quantized",
                         lambda name, local, linears: fp4_linear_tensors(
                             name, linears[local].weight, linears[local].bias, config.format,
                             fused_global_scale(local, linears) if config.format == "nvfp4" else None),
                         lambda dense: fp4_quantization_config(config.format, dense), reporter)
