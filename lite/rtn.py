"""The data-free writers' one loop (``lite fp8``, ``lite fp4``): a floating-point checkpoint -> a compressed-tensors
one whose linears are each rounded to nearest on their own, with no calibration:

    layer by layer (LayerwiseModel, fp32): every linear of the model's table (lmkit/models/: the same linears
    ``lite awq`` / ``smooth_quant`` quantize, MoE experts one by one) through the format's ``linear_tensors``;
    the lm_head, MoE routers and every other tensor: fp16, as ``lite smooth_quant`` writes them; ``ignore`` names
    the dense linears.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lmkit.lite import export
from lmkit.lite.blocks import dense_linears, layer_other_tensors, write_checkpoint
from lmkit.lite.config import resolve_device
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.progress import Reporter, SilentReporter
from lmkit.lite.requirements import require

# what every data-free writer needs, named at once before any work (lite/requirements.py)
REQUIRED = {"torch": "the quantization math", "transformers": "reading the model",
            "compressed_tensors": "writing compressed-tensors checkpoints"}
# (checkpoint name of a linear without ".weight", its name in the layer, the layer's linears by those names) -> the
# checkpoint's tensors of it
LinearTensors = Callable[[str, str, "dict[str, torch.nn.Module]"], "dict[str, torch.Tensor]"]


@dataclass
class RtnResult:
    """What a data-free writer (``quantize_fp8``, ``quantize_fp4``) did."""

    work_dir: Path
    source: Path
    scheme: str  # the writer's scheme (Fp8Config.scheme; Fp4Config.format)
    format: str  # the compressed-tensors format written
    num_layers: int
    num_linears: int
    seconds: float
    size_before_bytes: int
    size_after_bytes: int
    phase_seconds: dict[str, float] = field(default_factory=dict)


def write_rounded(model: str | Path | None, work_dir: Path, overwrite: bool, device: str, kind: str, scheme: str,
                  fmt: str, linear_tensors: LinearTensors, quantization_config: Callable[[list[str]], dict],
                  reporter: Reporter | None = None) -> RtnResult:
    """Write the HF checkpoint ``model`` (a folder, a hub id, or None/"smollm2" for the bundled SmolLM2) with each
    linear through ``linear_tensors`` into ``work_dir``, config ``quantization_config(dense linears)``, marker
    ``kind`` (the command: "fp8", "fp4").

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished (temp folder, marker last, rename).
    Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported architecture, already
    quantized input, work dir).
    """
    from lmkit.model_path import resolve_model

    reporter = reporter or SilentReporter()
    require(kind, REQUIRED)
    start = time.perf_counter()
    phase_seconds: dict[str, float] = {}
    source = resolve_model(model)

    t = time.perf_counter()
    reporter.phase("reading the model")
    lw = LayerwiseModel(source, resolve_device(device))
    temp_dir = export.prepare_work_dir(work_dir, overwrite)
    try:
        phase_seconds["prepare"] = time.perf_counter() - t
        t = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        num_linears = 0
        reporter.start_layers(lw.num_layers)
        for index in range(lw.num_layers):
            layer = lw.load_layer(index)
            awq_map = lw.layer_awq_map(index)
            linears = {name: layer.get_submodule(name) for name in awq_map.linears}
            for name in awq_map.linears:
                tensors.update(linear_tensors(lw.checkpoint_name(index, name), name, linears))
                num_linears += 1
            tensors.update(layer_other_tensors(lw, index, layer, awq_map))
            del layer
            reporter.layer_done(index, {"layer": index, "linears": len(awq_map.linears)})
        phase_seconds["layers"] = time.perf_counter() - t

        t = time.perf_counter()
        reporter.phase("writing the checkpoint")
        write_checkpoint(lw, tensors, temp_dir, quantization_config(dense_linears(lw.awq_map, lw.arch.unused_tensors)))
        phase_seconds["export"] = time.perf_counter() - t
        lw.close()

        result = RtnResult(work_dir=Path(work_dir).expanduser().absolute(), source=source, scheme=scheme,
                           format=fmt, num_layers=lw.num_layers, num_linears=num_linears,
                           seconds=time.perf_counter() - start, size_before_bytes=export.folder_bytes(source),
                           size_after_bytes=export.folder_bytes(temp_dir), phase_seconds=phase_seconds)
        export.publish(temp_dir, work_dir, {"kind": kind, "scheme": scheme, "source": str(source)})
        return result
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish
