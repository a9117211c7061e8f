"""AWQ (activation-aware weight quantization), layer by layer through the decoder.

    checks (architecture, not quantized, group size divides every linear, work dir writable)
    calibration windows X [samples, seq] -> embeddings X0 [samples, seq, hidden] (fp32)
    for each decoder layer (only this layer's weights and the activation buffers in memory: the quantized
    model's and, with an fp-model target (the default), the fp model's):
      1 fp pass over all windows; observer hooks gather per-group input statistics (mean |x|,
        per-group second moments; the full second moment for GPTQ rounding)
      2 per smoothing group: grid-search the scale exponent by block-output MSE on the search windows
        (the identity is a candidate too: smoothing never scores worse than none). The loss is measured
        on what the block adds to the residual stream: through the block's post norm where it has one
        (Gemma), for the group of a whole block and for the group of its output linear (o_proj, down_proj)
      3 fold the chosen scales into the previous norm / linear (fp function unchanged; each fold is first
        tried on one window, and a fused linear whose last rows are not what the group reads, Phi-3's
        qkv_proj -> o_proj under grouped-query attention, is left unsmoothed)
      4 per linear: clipping search by exact per-group output error over all calibration tokens
        (q_proj/k_proj are left out, as in AutoAWQ; --clip-qk includes them)
      5 int4 (asymmetric, zeros) in the clipped ranges: GPTQ error-compensating rounding under the smoothed
        inputs' second moments, columns in activation order (--gptq-order), a share of the way towards the fp
        model's own outputs (--gptq-model-target, 0.25: the windows also run through the fp layers, paired token
        by token; not with --propagate fp); or round-to-nearest (--rounding nearest, plain AWQ), optionally with
        a least-squares refinement of (scale, zero) (--refine)
      6 next layer's input: this layer's output with its quantized weights (--propagate fp: fp output)
    checkpoint + search results -> temp folder -> marker -> rename to work_dir

``calib_samples == 0`` skips 1-4 and 6: plain round-to-nearest (the RTN baseline).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmkit.lite import export
from lmkit.lite.blocks import (Discard, LayerRunner, block_function, calibration_inputs, cover_experts, dense_linears,
                               fold_chosen, foldable_groups, is_expert_group, layer_other_tensors, linears_in,
                               write_checkpoint)
from lmkit.lite.config import AwqConfig, resolve_calib_dtype, resolve_device
from lmkit.lite.gptq import gptq_quantize, reference_correction
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.observer import GroupInputObserver
from lmkit.lite.quantizer import PACK_NUM, SUPPORTED_GROUP_SIZES, QuantizedWeight, quantize
from lmkit.lite.requirements import require_quantizer
from lmkit.lite.search import refine_quantization, search_clip, search_scale, shrink_grid
from lmkit.lite.progress import Reporter, SilentReporter, evaluate_before_after, report_json
from lmkit.lite.threads import elementwise_threads, torch_threads
from lmkit.models import AwqMap


@dataclass
class AwqResult:
    """What ``quantize_awq`` did."""

    work_dir: Path
    source: Path
    method: str  # "awq" | "rtn"
    num_layers: int
    group_size: int
    seconds: float
    size_before_bytes: int
    size_after_bytes: int
    phase_seconds: dict[str, float] = field(default_factory=dict)
    ppl_before: Any = None  # PplResult when config.eval
    ppl_after: Any = None
    kl: Any = None  # KlResult of the checkpoint against the source when config.eval
    tasks_before: Any = None  # TaskResult when config.eval_tasks
    tasks_after: Any = None
    layers: list[dict] = field(default_factory=list)
    # name -> float32 [out, in] dequantized weight as computed in memory (keep_pseudo_quantized=True only)
    pseudo_quantized: dict[str, torch.Tensor] | None = None


def check_group_size(shapes: dict[str, tuple[int, int]], group_size: int) -> int:
    """``group_size``, or for 0 the largest supported size that divides every linear's input. ValueError naming
    the first linear whose input size ``group_size`` does not divide, and the supported group sizes that divide
    every linear; also checks output sizes pack into int32."""
    working = [g for g in SUPPORTED_GROUP_SIZES if all(i % g == 0 for _, i in shapes.values())]
    if group_size == 0:
        if not working:
            name, (_, in_features) = next((n, s) for n, s in shapes.items() if s[1] % SUPPORTED_GROUP_SIZES[0])
            raise ValueError(f"none of the group sizes {', '.join(map(str, SUPPORTED_GROUP_SIZES))} divides every "
                             f"quantized layer of this model ({name} has {in_features} input channels), so it cannot "
                             "be quantized in this format")
        group_size = max(working)
    for name, (out_features, in_features) in shapes.items():
        if out_features % PACK_NUM:
            raise ValueError(f"{name} has {out_features} output channels, not a multiple of {PACK_NUM}: "
                             "it cannot be packed in the AWQ GEMM format")
        if in_features % group_size:
            hint = (f"group sizes that divide every quantized layer of this model: {', '.join(map(str, working))}"
                    if working else f"none of {', '.join(map(str, SUPPORTED_GROUP_SIZES))} divides every layer "
                                    "of this model, so it cannot be quantized in this format")
            raise ValueError(f"--w-group-size {group_size} does not divide the {in_features} input channels of "
                             f"{name} ({in_features} / {group_size} = {in_features / group_size:g}); {hint}")
    return group_size


@torch.no_grad()
def _process_layer(model: LayerwiseModel, runner: LayerRunner | None, index: int, x: torch.Tensor | None,
                   config: AwqConfig, scales_out: dict, clips_out: dict, kept: dict | None = None,
                   x_ref: torch.Tensor | None = None):
    """Quantize decoder layer ``index`` given its input ``x`` (None for RTN; with --propagate quantized
    ``x`` is overwritten by the next layer's input) and return (checkpoint tensors, report).
    ``scales_out``/``clips_out`` receive the search results, ``kept`` (when given) the dequantized weights.
    ``x_ref`` (--gptq-model-target): the same windows' input in the fp model, overwritten by its fp output."""
    prefix = model.layer_prefix(index)
    g = config.w_group_size
    layer = model.load_layer(index)
    awq_map = model.layer_awq_map(index)
    report: dict[str, Any] = {"layer": index, "groups": []}
    quantized: dict[str, QuantizedWeight] = {}
    seconds = {"forward": 0.0, "scale_search": 0.0, "clip_search": 0.0, "quantize": 0.0}

    if x is not None:
        t = time.perf_counter()
        num_search = min(config.search_samples, x.shape[0])
        # the checks run before the observer hooks are attached
        foldable = foldable_groups(layer, awq_map, runner.kwargs(index, 1), x[:1], prefix.rstrip("."),
                                   config.search_scale)
        paired = None if x_ref is None else [not is_expert_group(awq_map, group) for group in awq_map.groups]
        observer = GroupInputObserver(layer, awq_map, g, num_search, with_moments=config.clip or config.refine,
                                      with_hessian=config.rounding == "gptq", paired=paired,
                                      drift_dtype=runner.compute_dtype)
        try:  # with --propagate fp the fp output is the next layer's input; else it only feeds the observer
            runner.run(layer, index, x, x if config.propagate == "fp" else Discard(), observer,
                       None if x_ref is None else (x_ref, x_ref))
        finally:
            observer.remove()
        if any(is_expert_group(awq_map, group) for group in awq_map.groups):  # a sparse layer
            report["experts"] = cover_experts(layer, awq_map, observer.stats, g, g)
        seconds["forward"] += time.perf_counter() - t

        t = time.perf_counter()
        search_kwargs = runner.kwargs(index, num_search)
        with linears_in(layer, runner.compute_dtype, awq_map.linears):  # candidates scored as the passes compute
            chosen = _search_scales(layer, awq_map, observer.stats, foldable, search_kwargs, config, report)
        fold_chosen(layer, awq_map, observer.stats, chosen, prefix, scales_out)
        seconds["scale_search"] += time.perf_counter() - t

        t = time.perf_counter()
        quantized.update(_quantize_calibrated(layer, awq_map, observer.stats, config, prefix, clips_out))
        seconds["clip_search"] += time.perf_counter() - t
        del observer

    t = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    for name in awq_map.linears:  # under the checkpoint's names (Mixtral's experts: block_sparse_moe.)
        linear = layer.get_submodule(name)
        if name not in quantized:
            quantized[name] = quantize(linear.weight, g)
        stored = model.checkpoint_name(index, name)
        tensors.update(export.linear_tensors(stored, quantized[name], linear.bias, config.format))
        if kept is not None:
            kept[stored + ".weight"] = quantized[name].dequantize()
    tensors.update(layer_other_tensors(model, index, layer, awq_map))
    seconds["quantize"] += time.perf_counter() - t

    if x is not None and config.propagate == "quantized":
        t = time.perf_counter()
        for name, qw in quantized.items():
            layer.get_submodule(name).weight.data = qw.dequantize().to(x.device)
        runner.run(layer, index, x, x)
        seconds["forward"] += time.perf_counter() - t
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    del layer
    return tensors, report


def _search_scales(layer: nn.Module, awq_map: AwqMap, stats: list, foldable: list[bool], search_kwargs: dict,
                   config: AwqConfig, report: dict) -> list[torch.Tensor | None]:
    """The scale search of each smoothing group: its chosen scales, or None where it keeps none (its report entry
    goes into ``report``)."""
    chosen: list[torch.Tensor | None] = []
    for group, group_stats, is_foldable in zip(awq_map.groups, stats, foldable):
        entry = {"prev": group.prev, "linears": list(group.linears), "smoothed": False}
        if is_foldable:
            block = block_function(layer, awq_map, group.block, search_kwargs)
            linears = [layer.get_submodule(n) for n in group.linears]
            found = search_scale(block, linears, group_stats.sample_input, group_stats.abs_mean, config.w_group_size,
                                 num_grid=config.num_grid, form=config.scale_form)
            entry.update(smoothed=found.ratio >= 0, ratio=found.ratio, loss=found.loss,
                         loss_identity=found.loss_identity)
            chosen.append(found.scales if found.ratio >= 0 else None)
        else:
            entry["reason"] = ("disabled" if not config.search_scale else
                               "prev cannot take the scales (shapes, or v -> o under grouped-query attention)")
            chosen.append(None)
        report["groups"].append(entry)
    return chosen


def _quantize_calibrated(layer: nn.Module, awq_map: AwqMap, stats: list, config: AwqConfig, prefix: str,
                         clips_out: dict) -> dict[str, QuantizedWeight]:
    """Clip search (and least-squares refinement) per linear from the observed input moments, then int4."""
    grid = shrink_grid(config.clip_grid, config.clip_max_shrink)
    quantized = {}
    for group, group_stats in zip(awq_map.groups, stats):
        correction = None
        if group_stats.drift is not None:  # --gptq-model-target: one correction for the linears reading this input
            correction = reference_correction(group_stats.hessian, group_stats.drift, config.gptq_model_target)
            group_stats.drift = None
        for name in group.linears:
            weight = layer.get_submodule(name).weight
            with torch_threads(elementwise_threads(weight.numel())):  # see lmkit.lite.threads
                quantized[name] = _quantize_linear(weight, group_stats, config, prefix + name, grid, clips_out,
                                                   clip=config.clip and (name not in awq_map.no_clip or config.clip_qk),
                                                   correction=correction)
    return quantized


def _quantize_linear(weight: torch.Tensor, group_stats, config: AwqConfig, name: str, grid: torch.Tensor,
                     clips_out: dict, clip: bool, correction: torch.Tensor | None = None) -> QuantizedWeight:
    """One linear's clip search (into ``clips_out`` under ``name``) and its int4 by the configured rounding; with GPTQ
    rounding the weight rounded is W + W ``correction`` (see ``reference_correction``), its channels that no
    calibration token reaches zeroed first (GPTQ drops them: their range must not set a group's)."""
    g = config.w_group_size
    if config.rounding == "gptq":
        weight = weight.detach().float()
        if correction is not None:
            weight = weight + weight @ correction
        dead = torch.diag(group_stats.hessian) == 0
        if bool(dead.any()):
            weight = weight.clone()
            weight[:, dead] = 0.0
    w_min = w_max = None
    if clip:
        w_min, w_max = search_clip(weight, group_stats.moments, g, grid)
        clips_out[name + ".min"] = w_min
        clips_out[name + ".max"] = w_max
    if config.rounding == "gptq":
        ratio_min = ratio_max = None
        if w_min is not None:
            full = weight.float().view(weight.shape[0], -1, g)
            full_min, full_max = full.amin(dim=2), full.amax(dim=2)
            ratio_min = torch.where(full_min < 0, w_min / full_min, torch.ones_like(w_min))
            ratio_max = torch.where(full_max > 0, w_max / full_max, torch.ones_like(w_max))
        return gptq_quantize(weight, group_stats.hessian, g, ratio_min, ratio_max, order=config.gptq_order)
    if config.refine:
        return refine_quantization(weight, group_stats.moments, g, w_min, w_max)
    return quantize(weight, g, w_min, w_max)


def quantize_awq(model: str | Path | None, config: AwqConfig, reporter: Reporter | None = None,
                 keep_pseudo_quantized: bool = False) -> AwqResult:
    """Quantize the HF checkpoint ``model`` (a folder, a hub id, or None/"smollm2" for the bundled
    SmolLM2) to 4-bit AWQ and write it to ``config.work_dir``.

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished: the output is built in a
    temp folder beside it, the completion marker is written last and the folder renamed into place.
    Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported architecture,
    already quantized input, group size, calibration data, work dir). ``keep_pseudo_quantized`` returns
    the dequantized weights as computed in memory too (to verify the checkpoint against; small models).
    """
    from lmkit.model_path import resolve_model

    reporter = reporter or SilentReporter()
    require_quantizer("awq", config)
    start = time.perf_counter()
    phase_seconds: dict[str, float] = {}
    source = resolve_model(model)
    device = resolve_device(config.device)

    t = time.perf_counter()
    reporter.phase("reading the model")
    lw = LayerwiseModel(source, device)
    config = replace(config, w_group_size=check_group_size(lw.linear_shapes(), config.w_group_size))
    compute_dtype = torch.float32
    if not config.is_rtn:  # the report says what ran
        compute_dtype = resolve_calib_dtype(config.calib_precision, device)
        config = replace(config, calib_precision="bf16" if compute_dtype == torch.bfloat16 else "fp32")
    temp_dir = export.prepare_work_dir(config.work_dir, config.overwrite)
    try:
        x = None
        seqlen = 0
        if not config.is_rtn:
            reporter.phase(f"tokenizing calibration data ({config.calib_dataset})")
            x, seqlen = calibration_inputs(lw, config)
        phase_seconds["prepare"] = time.perf_counter() - t

        t = time.perf_counter()
        runner = LayerRunner(lw, seqlen, compute_dtype) if x is not None else None
        tensors: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        clips: dict[str, torch.Tensor] = {}
        layer_reports = []
        kept: dict[str, torch.Tensor] | None = {} if keep_pseudo_quantized else None
        reporter.start_layers(lw.num_layers)
        x_ref = x.clone() if x is not None and config.pairs_with_fp_model else None
        for index in range(lw.num_layers):
            layer_tensors, report = _process_layer(lw, runner, index, x, config, scales, clips, kept, x_ref)
            tensors.update(layer_tensors)
            layer_reports.append(report)
            reporter.layer_done(index, report)
        del x, x_ref
        phase_seconds["layers"] = time.perf_counter() - t

        t = time.perf_counter()
        reporter.phase("writing the checkpoint")
        dense = dense_linears(lw.awq_map, lw.arch.unused_tensors) if config.format == "compressed-tensors" else None
        write_checkpoint(lw, tensors, temp_dir, export.quantization_config(config.w_group_size, dense, config.format))
        phase_seconds["export"] = time.perf_counter() - t
        lw.close()

        result = AwqResult(
            work_dir=Path(config.work_dir).expanduser().absolute(), source=source,
            method="rtn" if config.is_rtn else "awq", num_layers=lw.num_layers, group_size=config.w_group_size,
            seconds=0.0, size_before_bytes=export.folder_bytes(source), size_after_bytes=export.folder_bytes(temp_dir),
            phase_seconds=phase_seconds, layers=layer_reports, pseudo_quantized=kept)
        result.seconds = time.perf_counter() - start  # quantization time: before the optional evaluation

        evaluate_before_after(result, config, source, temp_dir, result.method.upper(), reporter)
        report = report_json(result, config, seqlen)
        export.save_search_results(temp_dir, scales, clips, report)
        export.publish(temp_dir, config.work_dir, {"kind": "awq", "method": result.method,
                                                   "group_size": config.w_group_size, "source": str(source)})
        return result
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish
