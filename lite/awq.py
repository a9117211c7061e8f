"""AWQ (activation-aware weight quantization), layer by layer through the decoder.

    checks (architecture, not quantized, group size divides every linear, work dir writable)
    calibration windows X [samples, seq] -> embeddings X0 [samples, seq, hidden] (fp32)
    for each decoder layer (only this layer's weights and one activation buffer in memory):
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
        inputs' second moments (default), or round-to-nearest (--rounding nearest, plain AWQ), optionally
        with a least-squares refinement of (scale, zero) (--refine)
      6 next layer's input: this layer's output with its quantized weights (--propagate fp: fp output)
    checkpoint + search results -> temp folder -> marker -> rename to work_dir

``calib_samples == 0`` skips 1-4 and 6: plain round-to-nearest (the RTN baseline).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lmkit.lite import export
from lmkit.lite.apply import can_absorb, fold_scales, input_features
from lmkit.lite.calib import mixed_windows
from lmkit.lite.config import AwqConfig, PplConfig, resolve_device
from lmkit.lite.corpora import calibration_corpora
from lmkit.lite.gptq import gptq_quantize
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.moe import expert_of
from lmkit.lite.observer import GroupInputObserver, InputStats
from lmkit.lite.quantizer import PACK_NUM, SUPPORTED_GROUP_SIZES, QuantizedWeight, quantize
from lmkit.lite.search import refine_quantization, search_clip, search_scale, shrink_grid
from lmkit.lite.threads import torch_threads
from lmkit.models import AwqMap

CHUNK_TOKENS = 4096  # tokens per forward chunk of the layer passes


class Reporter(Protocol):
    """Progress callbacks of ``quantize_awq`` (the CLI renders them with rich)."""

    def phase(self, description: str) -> None: ...

    def start_layers(self, num_layers: int) -> None: ...

    def layer_done(self, index: int, report: dict) -> None: ...


class _SilentReporter:
    def phase(self, description: str) -> None:
        pass

    def start_layers(self, num_layers: int) -> None:
        pass

    def layer_done(self, index: int, report: dict) -> None:
        pass


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
    tasks_before: Any = None  # TaskResult when config.eval_tasks
    tasks_after: Any = None
    layers: list[dict] = field(default_factory=list)
    # name -> float32 [out, in] dequantized weight as computed in memory (keep_pseudo_quantized=True only)
    pseudo_quantized: dict[str, torch.Tensor] | None = None


def check_group_size(shapes: dict[str, tuple[int, int]], group_size: int) -> None:
    """ValueError naming the first linear whose input size ``group_size`` does not divide, and the
    supported group sizes that divide every linear; also checks output sizes pack into int32."""
    for name, (out_features, in_features) in shapes.items():
        if out_features % PACK_NUM:
            raise ValueError(f"{name} has {out_features} output channels, not a multiple of {PACK_NUM}: "
                             "it cannot be packed in the AWQ GEMM format")
        if in_features % group_size:
            working = [g for g in SUPPORTED_GROUP_SIZES if all(i % g == 0 for _, i in shapes.values())]
            hint = (f"group sizes that divide every quantized layer of this model: {', '.join(map(str, working))}"
                    if working else f"none of {', '.join(map(str, SUPPORTED_GROUP_SIZES))} divides every layer "
                                    "of this model, so it cannot be quantized in this format")
            raise ValueError(f"--w-group-size {group_size} does not divide the {in_features} input channels of "
                             f"{name} ({in_features} / {group_size} = {in_features / group_size:g}); {hint}")


def _dense_linears(awq_map: AwqMap) -> list[str]:
    """The linear modules a checkpoint keeps in fp16, as compressed-tensors' ``ignore`` names them: the lm_head
    and an MoE layer's router."""
    dense = ["lm_head"]
    if awq_map.moe is not None:
        dense.append(f"re:.*{awq_map.moe.block}\\.{awq_map.moe.router}$")
    return dense


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _residual_block_of(awq_map: AwqMap, name: str) -> str | None:
    """The residual block that module ``name`` is or lies inside (None: neither)."""
    for _, block in awq_map.residual_blocks:
        if name == block or name.startswith(block + "."):
            return block
    return None


def block_function(layer: nn.Module, awq_map: AwqMap, name: str, kwargs: dict):
    """x -> what block ``name`` of ``layer`` contributes to the residual stream: its output, through the
    post norm of the residual block it is, or whose output it computes (Gemma: o_proj's output is
    self_attn's, normed by post_attention_layernorm before the add; ``_self_check`` verifies the nesting).
    The attention block gets the layer's kwargs."""
    module = layer.get_submodule(name)
    post = awq_map.post_norms.get(_residual_block_of(awq_map, name))
    norm = layer.get_submodule(post) if post else nn.Identity()
    if name == awq_map.attention:
        return lambda x: norm(_first(module(hidden_states=x, **kwargs)))
    return lambda x: norm(_first(module(x)))


def decomposed_layer(layer: nn.Module, awq_map: AwqMap, kwargs: dict, x: torch.Tensor) -> torch.Tensor:
    """The layer's output rebuilt from its residual blocks (``x = x + post(block(norm(x)))``) as the
    searches call them; must equal ``layer(x, **kwargs)``."""
    for norm, block in awq_map.residual_blocks:
        x = x + block_function(layer, awq_map, block, kwargs)(layer.get_submodule(norm)(x))
    return x


class _LayerRunner:
    """Runs one decoder layer over all calibration windows in chunks, with per-batch-size layer kwargs."""

    def __init__(self, model: LayerwiseModel, seqlen: int):
        self.model = model
        self.seqlen = seqlen
        self.chunk = max(1, CHUNK_TOKENS // seqlen)
        self._kwargs: dict[int, list[dict]] = {}

    def kwargs(self, index: int, batch_size: int) -> dict:
        if batch_size not in self._kwargs:
            self._kwargs[batch_size] = self.model.capture_layer_kwargs(batch_size, self.seqlen)
        return self._kwargs[batch_size][index]

    @torch.no_grad()
    def run(self, layer: nn.Module, index: int, x: torch.Tensor, out: torch.Tensor,
            observer: GroupInputObserver | None = None) -> None:
        """out[i] = layer(x[i]) for every window (``out`` may be ``x``: computed chunk by chunk)."""
        for start in range(0, x.shape[0], self.chunk):
            end = min(start + self.chunk, x.shape[0])
            if observer is not None:
                observer.begin_chunk(start)
            out[start:end] = _first(layer(x[start:end], **self.kwargs(index, end - start)))


def _check_tolerance(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, tolerance) of a layer output rebuilt from its parts."""
    return float((got - expected).abs().max()), 1e-5 * (1.0 + float(expected.abs().max()))


def _table_error(awq_map: AwqMap, name: str, what: str) -> RuntimeError:
    return RuntimeError(f"{name}: {what}; the AWQ map of {awq_map.architecture} (its AWQ table in lmkit/models/) "
                        "is wrong")


@torch.no_grad()
def _self_check(layer, awq_map, kwargs, x, name) -> torch.Tensor:
    """RuntimeError unless the decomposition the searches use reproduces the HF layer output and every
    group scored through a post norm computes its residual block's output; returns the layer output."""
    expected = _first(layer(x, **kwargs))
    outputs: dict[str, torch.Tensor] = {}
    nested = {group.block for group in awq_map.groups  # e.g. o_proj inside Gemma's self_attn
              if group.block not in awq_map.post_norms
              and _residual_block_of(awq_map, group.block) in awq_map.post_norms}
    handles = [layer.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: outputs.__setitem__(n, _first(out))) for n in nested | set(awq_map.post_norms)]
    try:
        got = decomposed_layer(layer, awq_map, kwargs, x)
    finally:
        for handle in handles:
            handle.remove()
    err, tol = _check_tolerance(got, expected)
    if not math.isfinite(err) or err > tol:
        raise _table_error(awq_map, name, f"the decomposition does not reproduce the decoder layer (max abs "
                                          f"difference {err:.3g} > {tol:.3g})")
    for block in sorted(nested):
        outer = _residual_block_of(awq_map, block)
        if block not in outputs or not torch.equal(outputs[block], outputs[outer]):
            raise _table_error(awq_map, name, f"{block} is scored through the post norm of {outer} but does not "
                                              f"compute {outer}'s output")
    return expected


@torch.no_grad()
def _trial_fold_error(layer: nn.Module, awq_map: AwqMap, group, compute, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, tolerance) between ``compute()`` after a trial fold of scales in [0.5, 2] into
    ``group`` (undone after) and ``expected``, its value before."""
    size = input_features(layer, group)
    touched = [layer.get_submodule(n) for n in (group.prev, *group.linears, *group.dense)]
    saved = [[p.detach().clone() for p in module.parameters(recurse=False)] for module in touched]
    order = torch.randperm(size, generator=torch.Generator().manual_seed(0))
    trial = torch.exp(torch.linspace(-0.69, 0.69, size)[order]).to(expected.device)
    try:
        fold_scales(layer, group, trial, awq_map.norm_weight_offset)
        got = compute()
    finally:
        for module, params in zip(touched, saved):
            for p, value in zip(module.parameters(recurse=False), params):
                p.copy_(value)
    return _check_tolerance(got, expected)


@torch.no_grad()
def _can_fold(layer: nn.Module, awq_map: AwqMap, group, kwargs: dict, x: torch.Tensor, expected: torch.Tensor,
              name: str) -> bool:
    """Whether scales can be folded into ``group.prev``: its shape allows it and a trial fold (scales in
    [0.5, 2], undone after) leaves the layer's output on ``x`` unchanged. A fused prev whose last rows are
    not what the group reads (qkv_proj -> o_proj under GQA) is refused; any other failure is a table error."""
    if not can_absorb(layer, group):
        return False
    err, tol = _trial_fold_error(layer, awq_map, group, lambda: decomposed_layer(layer, awq_map, kwargs, x), expected)
    if math.isfinite(err) and err <= 10 * tol:
        return True
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear) and prev.out_features > input_features(layer, group):
        return False
    raise _table_error(awq_map, name, f"folding scales into {group.prev} changes the layer's output (max abs "
                                      f"difference {err:.3g})")


def _is_expert_group(awq_map: AwqMap, group) -> bool:
    """One expert's up -> down group of a sparse layer."""
    return awq_map.moe is not None and group.input_of is None and expert_of(awq_map.moe, group.linears[0]) is not None


@torch.no_grad()
def _can_fold_expert(layer: nn.Module, awq_map: AwqMap, group, name: str) -> bool:
    """``_can_fold`` for one expert's up -> down group, on the expert alone: a trial fold (undone after) must
    leave act(gate x) * up x -> down unchanged on 16 random rows. The layer-wide check costs a layer forward
    per group, 128 per layer of Qwen3-30B-A3B; the fold touches only this expert, so its output is the check."""
    if not can_absorb(layer, group):
        return False
    layout = awq_map.moe
    experts = layer.get_submodule(f"{layout.block}.{layout.experts}")
    e = expert_of(layout, group.linears[0])
    gate, up, down = (experts.linear(e, w) for w in range(3))
    x = torch.randn(16, gate.in_features, generator=torch.Generator().manual_seed(0)).to(gate.weight)

    def expert() -> torch.Tensor:
        return down(experts.act_fn(gate(x)) * up(x))

    err, tol = _trial_fold_error(layer, awq_map, group, expert, expert())
    if math.isfinite(err) and err <= 10 * tol:
        return True
    raise _table_error(awq_map, name, f"folding scales into {group.prev} changes expert {e}'s output (max abs "
                                      f"difference {err:.3g})")


@torch.no_grad()
def _process_layer(model: LayerwiseModel, runner: _LayerRunner | None, index: int, x: torch.Tensor | None,
                   config: AwqConfig, scales_out: dict, clips_out: dict, kept: dict | None = None):
    """Quantize decoder layer ``index`` given its input ``x`` (None for RTN; with --propagate quantized
    ``x`` is overwritten by the next layer's input) and return (checkpoint tensors, report).
    ``scales_out``/``clips_out`` receive the search results, ``kept`` (when given) the dequantized weights."""
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
        check_kwargs = runner.kwargs(index, 1)  # the checks run before the observer hooks are attached
        expected = _self_check(layer, awq_map, check_kwargs, x[:1], prefix.rstrip("."))
        foldable = [config.search_scale and (
            _can_fold_expert(layer, awq_map, group, prefix.rstrip(".")) if _is_expert_group(awq_map, group) else
            _can_fold(layer, awq_map, group, check_kwargs, x[:1], expected, prefix.rstrip(".")))
            for group in awq_map.groups]
        observer = GroupInputObserver(layer, awq_map, g, num_search, with_moments=config.clip or config.refine,
                                      with_hessian=config.rounding == "gptq")
        try:  # with --propagate fp the fp output is the next layer's input; else it only feeds the observer
            runner.run(layer, index, x, x if config.propagate == "fp" else _Discard(), observer)
        finally:
            observer.remove()
        if any(_is_expert_group(awq_map, group) for group in awq_map.groups):  # a sparse layer
            report["experts"] = _cover_experts(layer, awq_map, observer.stats, g)
        seconds["forward"] += time.perf_counter() - t

        t = time.perf_counter()
        search_kwargs = runner.kwargs(index, num_search)
        chosen: list[torch.Tensor | None] = []
        for group, stats, can_fold in zip(awq_map.groups, observer.stats, foldable):
            entry = {"prev": group.prev, "linears": list(group.linears), "smoothed": False}
            if can_fold:
                block = block_function(layer, awq_map, group.block, search_kwargs)
                linears = [layer.get_submodule(n) for n in group.linears]
                found = search_scale(block, linears, stats.sample_input, stats.abs_mean, g,
                                     num_grid=config.num_grid, form=config.scale_form)
                entry.update(smoothed=found.ratio >= 0, ratio=found.ratio, loss=found.loss,
                             loss_identity=found.loss_identity)
                chosen.append(found.scales if found.ratio >= 0 else None)
            else:
                entry["reason"] = ("disabled" if not config.search_scale else
                                   "prev cannot take the scales (shapes, or v -> o under grouped-query attention)")
                chosen.append(None)
            report["groups"].append(entry)
        for group, stats, scales in zip(awq_map.groups, observer.stats, chosen):
            if scales is not None:
                fold_scales(layer, group, scales, awq_map.norm_weight_offset)
                stats.rescale(scales)
                scales_out[prefix + group.prev] = scales
        seconds["scale_search"] += time.perf_counter() - t

        t = time.perf_counter()
        with torch_threads(1):  # small batched products and element-wise work (see lmkit.lite.threads)
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
    quantized_names = {n + ".weight" for n in awq_map.linears} | {n + ".bias" for n in awq_map.linears}
    for name, value in layer.state_dict().items():
        if name not in quantized_names:
            tensors[model.checkpoint_name(index, name)] = value.detach().to("cpu", torch.float16)
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


@torch.no_grad()
def _cover_experts(layer: nn.Module, awq_map: AwqMap, stats: list[InputStats], group_size: int) -> dict:
    """Calibration tokens routed to each expert of a sparse layer. An expert that fewer tokens than one
    quantization group reached has its down projection's statistics rebuilt from every token of the search
    windows run through its gate and up (as if routed to it; the shared gate/up statistics are every token's
    already): its smoothing, clipping and rounding are then searched on the union of tokens, not on a handful
    of rows or none. Returns the report entry (tokens per expert, those handled so)."""
    layout = awq_map.moe
    shared = next(i for i, group in enumerate(awq_map.groups) if group.input_of == layout.block)
    x = stats[shared].sample_input
    x = x.reshape(-1, x.shape[-1])
    experts = layer.get_submodule(f"{layout.block}.{layout.experts}")
    tokens, union = [], []
    for i, group in enumerate(awq_map.groups):
        if not _is_expert_group(awq_map, group):
            continue
        e = expert_of(layout, group.linears[0])
        tokens.append(stats[i].num_tokens)
        if stats[i].num_tokens >= group_size:
            continue
        union.append(e)
        h = experts.act_fn(experts.linear(e, 0)(x)) * experts.linear(e, 1)(x)
        old = stats[i]
        rebuilt = InputStats(torch.zeros_like(old.abs_sum), None if old.moments is None else torch.zeros_like(old.moments),
                             None if old.hessian is None else torch.zeros_like(old.hessian))
        rebuilt.accumulate(h.float(), group_size)
        if rebuilt.hessian is not None:
            rebuilt.moments_from_hessian(group_size)
        rebuilt.samples = [h.float()]
        stats[i] = rebuilt
    return {"tokens_per_expert": tokens, "min_tokens": group_size, "searched_on_all_tokens": union}


def _quantize_calibrated(layer: nn.Module, awq_map: AwqMap, stats: list, config: AwqConfig, prefix: str,
                         clips_out: dict) -> dict[str, QuantizedWeight]:
    """Clip search (and least-squares refinement) per linear from the observed input moments, then int4."""
    grid = shrink_grid(config.clip_grid, config.clip_max_shrink)
    g = config.w_group_size
    quantized = {}
    for group, group_stats in zip(awq_map.groups, stats):
        for name in group.linears:
            weight = layer.get_submodule(name).weight
            w_min = w_max = None
            if config.clip and (name not in awq_map.no_clip or config.clip_qk):
                w_min, w_max = search_clip(weight, group_stats.moments, g, grid)
                clips_out[prefix + name + ".min"] = w_min
                clips_out[prefix + name + ".max"] = w_max
            if config.rounding == "gptq":
                ratio_min = ratio_max = None
                if w_min is not None:
                    full = weight.float().view(weight.shape[0], -1, g)
                    full_min, full_max = full.amin(dim=2), full.amax(dim=2)
                    ratio_min = torch.where(full_min < 0, w_min / full_min, torch.ones_like(w_min))
                    ratio_max = torch.where(full_max > 0, w_max / full_max, torch.ones_like(w_max))
                quantized[name] = gptq_quantize(weight, group_stats.hessian, g, ratio_min, ratio_max)
            elif config.refine:
                quantized[name] = refine_quantization(weight, group_stats.moments, g, w_min, w_max)
            else:
                quantized[name] = quantize(weight, g, w_min, w_max)
    return quantized


class _Discard:
    """An output buffer that drops what is written to it (the fp pass only feeds the observer)."""

    def __setitem__(self, key, value) -> None:
        pass


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
    from transformers import AutoTokenizer

    from lmkit.model_path import resolve_model

    reporter = reporter or _SilentReporter()
    start = time.perf_counter()
    phase_seconds: dict[str, float] = {}
    source = resolve_model(model)
    device = resolve_device(config.device)

    t = time.perf_counter()
    reporter.phase("reading the model")
    lw = LayerwiseModel(source, device)
    check_group_size(lw.linear_shapes(), config.w_group_size)
    temp_dir = export.prepare_work_dir(config.work_dir, config.overwrite)
    try:
        x = None
        seqlen = 0
        if not config.is_rtn:
            reporter.phase(f"tokenizing calibration data ({config.calib_dataset})")
            tokenizer = AutoTokenizer.from_pretrained(source)
            seqlen = min(config.calib_seqlen, lw.max_seqlen) if lw.max_seqlen else config.calib_seqlen
            windows = mixed_windows(tokenizer, calibration_corpora(config.calib_dataset), config.calib_samples,
                                    seqlen, config.seed)
            x = lw.embed(windows)
        phase_seconds["prepare"] = time.perf_counter() - t

        t = time.perf_counter()
        runner = _LayerRunner(lw, seqlen) if x is not None else None
        tensors: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        clips: dict[str, torch.Tensor] = {}
        layer_reports = []
        kept: dict[str, torch.Tensor] | None = {} if keep_pseudo_quantized else None
        reporter.start_layers(lw.num_layers)
        for index in range(lw.num_layers):
            layer_tensors, report = _process_layer(lw, runner, index, x, config, scales, clips, kept)
            tensors.update(layer_tensors)
            layer_reports.append(report)
            reporter.layer_done(index, report)
        del x
        phase_seconds["layers"] = time.perf_counter() - t

        t = time.perf_counter()
        reporter.phase("writing the checkpoint")
        layers_prefix = lw.awq_map.layers + "."
        for name in lw.entries:
            if not name.startswith(layers_prefix):
                value = lw.read_tensor(name)
                tensors[name] = value.to(torch.float16) if value.is_floating_point() else value
        export.save_tensors(tensors, temp_dir)
        del tensors
        dense = _dense_linears(lw.awq_map) if config.format == "compressed-tensors" else None
        export.write_config(source, temp_dir, export.quantization_config(config.w_group_size, dense, config.format))
        export.copy_side_files(source, temp_dir)
        phase_seconds["export"] = time.perf_counter() - t
        lw.close()

        result = AwqResult(
            work_dir=Path(config.work_dir).expanduser().absolute(), source=source,
            method="rtn" if config.is_rtn else "awq", num_layers=lw.num_layers, group_size=config.w_group_size,
            seconds=0.0, size_before_bytes=export.folder_bytes(source), size_after_bytes=export.folder_bytes(temp_dir),
            phase_seconds=phase_seconds, layers=layer_reports, pseudo_quantized=kept)
        result.seconds = time.perf_counter() - start  # quantization time: before the optional evaluation

        if config.eval:
            from lmkit.lite.ppl import evaluate_perplexity

            ppl_config = PplConfig(dataset=config.eval_dataset, seqlen=config.eval_seqlen,
                                   max_tokens=config.eval_max_tokens, device=config.device)
            reporter.phase(f"perplexity of the source on {config.eval_dataset}")
            result.ppl_before = evaluate_perplexity(source, ppl_config)
            reporter.phase(f"perplexity of the AWQ checkpoint on {config.eval_dataset}")
            result.ppl_after = evaluate_perplexity(temp_dir, ppl_config)
        if config.eval_tasks:
            from lmkit.lite.config import EvalConfig
            from lmkit.lite.evaluate import evaluate_tasks

            eval_config = EvalConfig(tasks=tuple(config.eval_tasks), limit=config.eval_limit)
            reporter.phase(f"tasks {', '.join(config.eval_tasks)}: the source")
            result.tasks_before = evaluate_tasks(source, eval_config)
            reporter.phase(f"tasks {', '.join(config.eval_tasks)}: the {result.method.upper()} checkpoint")
            result.tasks_after = evaluate_tasks(temp_dir, eval_config)

        report = {
            "source": str(source), "method": result.method, "settings": config.as_dict(),
            "calib_seqlen_used": seqlen, "seconds": round(result.seconds, 2),
            "phase_seconds": {k: round(v, 2) for k, v in phase_seconds.items()},
            "size_before_bytes": result.size_before_bytes, "size_after_bytes": result.size_after_bytes,
            "ppl_before": _ppl_dict(result.ppl_before), "ppl_after": _ppl_dict(result.ppl_after),
            "tasks_before": result.tasks_before.as_dict() if result.tasks_before else None,
            "tasks_after": result.tasks_after.as_dict() if result.tasks_after else None,
            "layers": layer_reports,
        }
        export.save_search_results(temp_dir, scales, clips, report)
        export.publish(temp_dir, config.work_dir, {"kind": "awq", "method": result.method,
                                                   "group_size": config.w_group_size, "source": str(source)})
        return result
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish


def _ppl_dict(result) -> dict | None:
    if result is None:
        return None
    return {"dataset": result.dataset, "ppl": result.ppl, "num_tokens": result.num_tokens}
