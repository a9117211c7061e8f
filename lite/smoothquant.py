"""SmoothQuant W8A8 (Xiao et al. 2023), layer by layer through the decoder, into compressed-tensors int8.

Per-token int8 activations lose the small channels of a token to its few outlier channels. SmoothQuant
divides each input channel j by s_j (folded into the previous norm or linear, as AWQ's scales are) and
multiplies the weights' column j by it, moving the outliers' range into the weights, which are quantized per
output channel and take it well:

    s_j = max_t |x_tj| ^ alpha / max_o |W_oj| ^ (1 - alpha)        (W: every linear of the group, stacked)

    checks (architecture, not quantized, work dir writable)
    calibration windows X [samples, seq] -> embeddings (fp32)
    for each decoder layer (only this layer's weights and one activation buffer in memory):
      1 fp pass over all windows; the observer gathers per group max |x| per channel (and sum x x^T for GPTQ)
      2 per smoothing group: alpha on the grid 0, 1/n, ..., 1 (or the one given), scored by the MSE of what the
        block adds to the residual stream on the search windows, with the group's linears W8A8 fake-quantized
        (x -> Q_token(x / s), W -> Q_channel(W * s): lmkit.lite.int8); no smoothing is a candidate too, so a
        group is never worse off than unsmoothed W8A8
      3 fold the chosen scales into the previous norm / linear (checked to leave the fp layer unchanged)
      4 per linear: int8 per output channel, round-to-nearest (default) or GPTQ rounding under the smoothed
        inputs' second moments
      5 next layer's input: this layer's output with int8 weights and per-token int8 activations
        (--propagate fp: the fp output)
    -> compressed-tensors int-quantized W8A8 (weights int8 channel, activations int8 token dynamic) in a temp
       folder -> marker -> rename to work_dir
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmkit.lite import export
from lmkit.lite.blocks import (Discard, LayerRunner, block_function, calibration_inputs, cover_experts, dense_linears,
                               fold_chosen, foldable_groups, is_expert_group, layer_other_tensors, write_checkpoint)
from lmkit.lite.config import SmoothQuantConfig, resolve_device
from lmkit.lite.gptq import gptq_quantize_int8
from lmkit.lite.int8 import Int8Weight, fake_quant_tokens, quantize_int8
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.observer import GroupInputObserver
from lmkit.lite.progress import Reporter, SilentReporter, evaluate_before_after, report_json
from lmkit.lite.requirements import require_quantizer
from lmkit.lite.threads import elementwise_threads, torch_threads

REPORT_DIR = "smooth_quant"  # the scales and report.json, beside the weights
INPUT_MULTIPLE = 32  # lmkit's int8 kernels take a row's inputs in blocks of 32 (csrc/model/weights.cpp)
MIN_EXPERT_TOKENS = 32  # an expert reached by fewer calibration tokens is searched on every token (cover_experts)


@dataclass
class SmoothQuantResult:
    """What ``quantize_smooth_quant`` did."""

    work_dir: Path
    source: Path
    method: str  # "smooth_quant"
    num_layers: int
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


def smoothing_scales(x_abs_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """float32 [in]: s = max|x|^alpha / max|W|^(1 - alpha) per input channel (``weights``: [out_i, in] each),
    normalised to max(s) * min(s) = 1 (a common factor changes nothing under per-token and per-channel scales).
    A channel no token or weight reaches gets 1."""
    w_max = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    x = x_abs_max.float().to(w_max.device)
    s = x.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    s = torch.where((x > 0) & (w_max > 0), s, torch.ones_like(s))
    return s / (s.max() * s.min()).sqrt()


def check_input_sizes(shapes: dict[str, tuple[int, int]]) -> None:
    """ValueError naming the first linear whose input size is not a multiple of ``INPUT_MULTIPLE``."""
    for name, (_, in_features) in shapes.items():
        if in_features % INPUT_MULTIPLE:
            raise ValueError(f"{name} has {in_features} input channels: lmkit's int8 kernels need a multiple of "
                             f"{INPUT_MULTIPLE}, so this model cannot be served as W8A8 (lmkit lite awq quantizes "
                             "it to int4 with a group size that divides it)")


@contextmanager
def w8a8_linears(linears: list[nn.Linear], scales: torch.Tensor | None, weights: list[Int8Weight] | None = None):
    """Within the block, ``linears`` compute as the W8A8 checkpoint will after folding ``scales`` (None: none):
    input Q_token(x / s) and weight Q_channel(W * s) (or the given int8 ``weights``, already smoothed), i.e.
    weight Q(W * s) / s and input Q_token(x / s) * s on the unfolded model. Restored on exit."""
    originals = [lin.weight.data for lin in linears]
    s = None if scales is None else scales.to(originals[0].device, torch.float32).view(1, -1)

    def hook(module, args):
        x = args[0]
        return (fake_quant_tokens(x) if s is None else fake_quant_tokens(x / s) * s,) + args[1:]

    handles = [lin.register_forward_pre_hook(hook) for lin in linears]
    try:
        with torch_threads(elementwise_threads(max(w.numel() for w in originals))):  # see lmkit.lite.threads
            for i, (lin, w) in enumerate(zip(linears, originals)):
                if weights is not None:
                    lin.weight.data = weights[i].dequantize().to(w.device)
                elif s is None:
                    lin.weight.data = quantize_int8(w).dequantize()
                else:
                    lin.weight.data = quantize_int8(w * s).dequantize() / s
        yield
    finally:
        for handle in handles:
            handle.remove()
        for lin, w in zip(linears, originals):
            lin.weight.data = w


@dataclass(frozen=True)
class AlphaSearchResult:
    """The chosen migration strength of one group and how it scored."""

    scales: torch.Tensor | None  # float32 [in]; None when no smoothing won
    alpha: float  # -1.0 when no smoothing won
    loss: float
    loss_identity: float  # block-output MSE of W8A8 without smoothing


@torch.no_grad()
def search_alpha(block, linears: list[nn.Linear], x: torch.Tensor, x_abs_max: torch.Tensor,
                 alphas: tuple[float, ...], with_identity: bool = True) -> AlphaSearchResult:
    """The migration strength among ``alphas`` whose W8A8 ``block(x)`` is closest (MSE) to the fp one;
    ``with_identity``: no smoothing competes too. The module is unchanged on return."""
    reference = block(x)

    def score(scales: torch.Tensor | None) -> float:
        with w8a8_linears(linears, scales):
            return float((block(x) - reference).float().pow(2).mean())

    loss_identity = score(None) if with_identity else float("inf")
    best = AlphaSearchResult(None, -1.0, loss_identity, loss_identity)
    weights = [lin.weight for lin in linears]
    for alpha in alphas:
        scales = smoothing_scales(x_abs_max, weights, alpha)
        loss = score(scales)
        if loss < best.loss:
            best = AlphaSearchResult(scales, alpha, loss, loss_identity)
    return best


@torch.no_grad()
def _process_layer(model: LayerwiseModel, runner: LayerRunner, index: int, x: torch.Tensor,
                   config: SmoothQuantConfig, scales_out: dict, kept: dict | None = None):
    """Smooth and quantize decoder layer ``index`` given its input ``x`` (overwritten by the next layer's input)
    and return (checkpoint tensors, report). ``scales_out`` receives the chosen scales, ``kept`` (when given)
    the dequantized weights."""
    prefix = model.layer_prefix(index)
    name = prefix.rstrip(".")
    layer = model.load_layer(index)
    awq_map = model.layer_awq_map(index)
    report: dict[str, Any] = {"layer": index, "groups": []}
    seconds = {"forward": 0.0, "alpha_search": 0.0, "quantize": 0.0}

    t = time.perf_counter()
    num_search = min(config.search_samples, x.shape[0])
    # the checks run before the observer hooks are attached
    foldable = foldable_groups(layer, awq_map, runner.kwargs(index, 1), x[:1], name, config.smooth)
    observer = GroupInputObserver(layer, awq_map, 1, num_search, with_moments=False,
                                  with_hessian=config.rounding == "gptq")
    try:
        runner.run(layer, index, x, x if config.propagate == "fp" else Discard(), observer)
    finally:
        observer.remove()
    if any(is_expert_group(awq_map, group) for group in awq_map.groups):  # a sparse layer
        report["experts"] = cover_experts(layer, awq_map, observer.stats, MIN_EXPERT_TOKENS, 1)
    seconds["forward"] += time.perf_counter() - t

    t = time.perf_counter()
    search_kwargs = runner.kwargs(index, num_search)
    chosen: list[torch.Tensor | None] = []
    for group, stats, is_foldable in zip(awq_map.groups, observer.stats, foldable):
        entry: dict[str, Any] = {"prev": group.prev, "linears": list(group.linears), "smoothed": False}
        if is_foldable:
            block = block_function(layer, awq_map, group.block, search_kwargs)
            linears = [layer.get_submodule(n) for n in group.linears]
            found = search_alpha(block, linears, stats.sample_input, stats.abs_max, config.alphas,
                                 with_identity=config.alpha is None)
            entry.update(smoothed=found.scales is not None, alpha=found.alpha, loss=found.loss,
                         loss_identity=found.loss_identity)
            chosen.append(found.scales)
        else:
            entry["reason"] = ("disabled" if not config.smooth else
                               "prev cannot take the scales (shapes, or v -> o under grouped-query attention)")
            chosen.append(None)
        report["groups"].append(entry)
    fold_chosen(layer, awq_map, observer.stats, chosen, prefix, scales_out)
    seconds["alpha_search"] += time.perf_counter() - t

    t = time.perf_counter()
    quantized: dict[str, Int8Weight] = {}
    for group, stats in zip(awq_map.groups, observer.stats):
        for linear_name in group.linears:
            weight = layer.get_submodule(linear_name).weight
            with torch_threads(elementwise_threads(weight.numel())):  # see lmkit.lite.threads
                quantized[linear_name] = (gptq_quantize_int8(weight, stats.hessian) if config.rounding == "gptq"
                                          else quantize_int8(weight))
    del observer
    tensors: dict[str, torch.Tensor] = {}
    for linear_name in awq_map.linears:  # under the checkpoint's names (Mixtral's experts: block_sparse_moe.)
        linear = layer.get_submodule(linear_name)
        stored = model.checkpoint_name(index, linear_name)
        tensors.update(export.int8_linear_tensors(stored, quantized[linear_name], linear.bias))
        if kept is not None:
            kept[stored + ".weight"] = quantized[linear_name].dequantize()
    tensors.update(layer_other_tensors(model, index, layer, awq_map))
    seconds["quantize"] += time.perf_counter() - t

    if config.propagate == "quantized":
        t = time.perf_counter()
        names = list(awq_map.linears)
        with w8a8_linears([layer.get_submodule(n) for n in names], None, [quantized[n] for n in names]):
            runner.run(layer, index, x, x)
        seconds["forward"] += time.perf_counter() - t
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    del layer
    return tensors, report


def quantize_smooth_quant(model: str | Path | None, config: SmoothQuantConfig, reporter: Reporter | None = None,
                          keep_pseudo_quantized: bool = False) -> SmoothQuantResult:
    """Quantize the HF checkpoint ``model`` (a folder, a hub id, or None/"smollm2" for the bundled SmolLM2) to
    SmoothQuant W8A8 int8 and write it to ``config.work_dir`` as compressed-tensors ``int-quantized``.

    Nothing is written to ``work_dir`` unless the whole checkpoint is finished (temp folder, marker last,
    rename). Raises ValueError / FileNotFoundError naming the problem (missing model, unsupported
    architecture, already quantized input, calibration data, work dir). ``keep_pseudo_quantized`` returns the
    dequantized weights as computed in memory too (to verify the checkpoint against; small models).
    """
    from lmkit.model_path import resolve_model

    reporter = reporter or SilentReporter()
    require_quantizer("smooth_quant", config)
    start = time.perf_counter()
    phase_seconds: dict[str, float] = {}
    source = resolve_model(model)
    device = resolve_device(config.device)

    t = time.perf_counter()
    reporter.phase("reading the model")
    lw = LayerwiseModel(source, device)
    check_input_sizes(lw.linear_shapes())
    temp_dir = export.prepare_work_dir(config.work_dir, config.overwrite)
    try:
        reporter.phase(f"tokenizing calibration data ({config.calib_dataset})")
        x, seqlen = calibration_inputs(lw, config)
        phase_seconds["prepare"] = time.perf_counter() - t

        t = time.perf_counter()
        runner = LayerRunner(lw, seqlen)
        tensors: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        layer_reports = []
        kept: dict[str, torch.Tensor] | None = {} if keep_pseudo_quantized else None
        reporter.start_layers(lw.num_layers)
        for index in range(lw.num_layers):
            layer_tensors, report = _process_layer(lw, runner, index, x, config, scales, kept)
            tensors.update(layer_tensors)
            layer_reports.append(report)
            reporter.layer_done(index, report)
        del x
        phase_seconds["layers"] = time.perf_counter() - t

        t = time.perf_counter()
        reporter.phase("writing the checkpoint")
        write_checkpoint(lw, tensors, temp_dir,
                         export.w8a8_quantization_config(dense_linears(lw.awq_map, lw.arch.unused_tensors)))
        phase_seconds["export"] = time.perf_counter() - t
        lw.close()

        result = SmoothQuantResult(
            work_dir=Path(config.work_dir).expanduser().absolute(), source=source, method="smooth_quant",
            num_layers=lw.num_layers, seconds=0.0, size_before_bytes=export.folder_bytes(source),
            size_after_bytes=export.folder_bytes(temp_dir), phase_seconds=phase_seconds, layers=layer_reports,
            pseudo_quantized=kept)
        result.seconds = time.perf_counter() - start  # quantization time: before the optional evaluation

        evaluate_before_after(result, config, source, temp_dir, "W8A8", reporter)
        report = report_json(result, config, seqlen)
        export.save_search_results(temp_dir, scales, {}, report, subfolder=REPORT_DIR)
        export.publish(temp_dir, config.work_dir, {"kind": "smooth_quant", "method": result.method,
                                                   "source": str(source)})
        return result
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish
