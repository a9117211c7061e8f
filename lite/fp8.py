"""``lmkit lite fp8``: a floating-point checkpoint -> compressed-tensors FP8 E4M3, round to nearest (no calibration),
in llm-compressor's layout:

    layer by layer (LayerwiseModel, fp32): every linear of the model's table (lmkit/models/: the same linears
    ``lite awq`` / ``smooth_quant`` quantize, MoE experts one by one)
        weight_scale = max|W[n, :]| / 448 per output channel   (compressed-tensors' calculate_qparams, FP8 args)
        weight       = E4M3(W / weight_scale)                    (its Float/NaiveQuantizationCompressor.compress)
    the lm_head, MoE routers and every other tensor: fp16, as ``lite smooth_quant`` writes them; ``ignore`` names
    the dense linears
    scheme dynamic:     format float-quantized, input activations FP8 dynamic per token (FP8_DYNAMIC)
    scheme weight-only: format naive-quantized, no activation quantization

The format is the one compressed-tensors infers for the scheme (infer_module_format), its compressor the one
registered for that format. lmkit's CPU engine dequantizes the weights at load (lmkit/models/fp8.py).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmkit.lite import export
from lmkit.lite.blocks import dense_linears, layer_other_tensors, write_checkpoint
from lmkit.lite.config import Fp8Config, resolve_device
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.progress import Reporter, SilentReporter
from lmkit.lite.requirements import require

NUM_BITS = 8


@dataclass
class Fp8Result:
    """What ``quantize_fp8`` did."""

    work_dir: Path
    source: Path
    scheme: str  # Fp8Config.scheme
    format: str  # the compressed-tensors format written
    num_layers: int
    num_linears: int
    seconds: float
    size_before_bytes: int
    size_after_bytes: int
    phase_seconds: dict[str, float] = field(default_factory=dict)


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
    E4M3 and write it to ``config.work_dir`` as compressed-tensors (the scheme's format).

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished (temp folder, marker last, rename).
    Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported architecture, already
    quantized input, work dir).
    """
    from lmkit.model_path import resolve_model

    reporter = reporter or SilentReporter()
    require("fp8", {"torch": "the quantization math", "transformers": "reading the model",
                    "compressed_tensors": "writing compressed-tensors checkpoints"})
    start = time.perf_counter()
    phase_seconds: dict[str, float] = {}
    source = resolve_model(model)
    device = resolve_device(config.device)
    scheme = fp8_scheme(config.scheme)

    t = time.perf_counter()
    reporter.phase("reading the model")
    lw = LayerwiseModel(source, device)
    temp_dir = export.prepare_work_dir(config.work_dir, config.overwrite)
    try:
        phase_seconds["prepare"] = time.perf_counter() - t
        t = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        num_linears = 0
        reporter.start_layers(lw.num_layers)
        for index in range(lw.num_layers):
            layer = lw.load_layer(index)
            awq_map = lw.layer_awq_map(index)
            for name in awq_map.linears:
                linear = layer.get_submodule(name)
                tensors.update(fp8_linear_tensors(lw.checkpoint_name(index, name), linear.weight, linear.bias,
                                                  scheme))
                num_linears += 1
            tensors.update(layer_other_tensors(lw, index, layer, awq_map))
            del layer
            reporter.layer_done(index, {"layer": index, "linears": len(awq_map.linears)})
        phase_seconds["layers"] = time.perf_counter() - t

        t = time.perf_counter()
        reporter.phase("writing the checkpoint")
        write_checkpoint(lw, tensors, temp_dir,
                         fp8_quantization_config(config.scheme, dense_linears(lw.awq_map, lw.arch.unused_tensors)))
        phase_seconds["export"] = time.perf_counter() - t
        lw.close()

        result = Fp8Result(work_dir=Path(config.work_dir).expanduser().absolute(), source=source,
                           scheme=config.scheme, format=fp8_format(scheme), num_layers=lw.num_layers,
                           num_linears=num_linears, seconds=time.perf_counter() - start,
                           size_before_bytes=export.folder_bytes(source),
                           size_after_bytes=export.folder_bytes(temp_dir), phase_seconds=phase_seconds)
        export.publish(temp_dir, config.work_dir, {"kind": "fp8", "scheme": config.scheme, "source": str(source)})
        return result
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish
