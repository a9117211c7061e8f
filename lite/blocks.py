"""A decoder layer as the layer-by-layer quantizers (``lite awq``, ``lite smooth_quant``) see it: its residual
blocks, the checks that the model's smoothing table (lmkit/models/) describes it, the calibration inputs and a
runner over them, and the tensors outside the layers that a checkpoint carries over.

    layer(x) == x + post(block(norm(x))) for each residual block (norm, block) in turn   (``self_check``)
    a smoothing group's scales fold into its prev without changing the layer            (``can_fold``)
    block_function(name): x -> what block ``name`` adds to the residual stream           (the searches' loss)
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from lmkit.lite import export
from lmkit.lite.apply import can_absorb, fold_scales, input_features
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.moe import PER_LAYER_INPUT_BLOCK, expert_of
from lmkit.lite.observer import GroupInputObserver, InputStats
from lmkit.models import AwqMap

CHUNK_TOKENS = 4096  # tokens per forward chunk of the layer passes


def dense_linears(awq_map: AwqMap, unused: tuple[str, ...] = ()) -> list[str]:
    """The linear modules a checkpoint keeps in fp16, as compressed-tensors' ``ignore`` names them: the lm_head,
    an MoE layer's router, a group's dense readers, and what lies under the ``unused`` prefixes (the vision tower
    of a multimodal checkpoint, Architecture.unused_tensors)."""
    dense = ["lm_head"]
    dense += ["re:" + re.escape(prefix) + ".*" for prefix in unused]
    if awq_map.moe is not None:
        dense.append("re:.*" + re.escape(awq_map.moe.path(awq_map.moe.router)) + "$")
        if awq_map.moe.shared_expert_gate is not None:
            dense.append(f"re:.*{awq_map.moe.block}\\.{awq_map.moe.shared_expert_gate}$")
    for name in sorted({n for group in awq_map.groups for n in group.dense}):  # Qwen3.5's gate inputs b and a
        dense.append("re:.*" + re.escape(name) + "$")
    for name in awq_map.fp_linears:  # Gemma 4's per-layer-input linears
        dense.append("re:.*" + re.escape(name) + "$")
    return dense


def first_output(output):
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
    self_attn's, normed by post_attention_layernorm before the add; ``self_check`` verifies the nesting).
    The attention block gets the layer's kwargs."""
    module = layer.get_submodule(name)
    post = awq_map.post_norms.get(_residual_block_of(awq_map, name))
    norm = layer.get_submodule(post) if post else nn.Identity()
    if name == awq_map.attention:
        attention_kwargs = {k: v for k, v in kwargs.items() if k != "per_layer_input"}
        return lambda x: norm(first_output(module(hidden_states=x, **attention_kwargs)))
    if name == PER_LAYER_INPUT_BLOCK:  # Gemma 4's E-models: the layer's per-layer input, in its kwargs
        return lambda x: norm(module(x, kwargs["per_layer_input"]))
    return lambda x: norm(first_output(module(x)))


def decomposed_layer(layer: nn.Module, awq_map: AwqMap, kwargs: dict, x: torch.Tensor) -> torch.Tensor:
    """The layer's output rebuilt from its residual blocks (``x = x + post(block(norm(x)))``) as the
    searches call them; must equal ``layer(x, **kwargs)``."""
    for norm, block in awq_map.residual_blocks:
        x = x + block_function(layer, awq_map, block, kwargs)(layer.get_submodule(norm)(x))
    if awq_map.layer_scalar is not None:  # Gemma 4: the layer's output times a stored scalar
        x = x * getattr(layer, awq_map.layer_scalar)
    return x


@contextlib.contextmanager
def linears_in(module: nn.Module, dtype: torch.dtype, names: Iterable[str]):
    """Inside the block the nn.Linear submodules ``names`` of ``module`` (a layer's quantized linears: not a router,
    whose top-k a rounding could flip) multiply in ``dtype``: their weight and bias as they are at each call (cast
    again when the weight's data changed: the scale search swaps weights), and their input (once for the linears
    that read one tensor, q/k/v or gate/up), cast to ``dtype``, the output cast back to the input's dtype; their
    hooks see what they saw before (the input as given). float32: nothing changes."""
    if dtype == torch.float32:
        yield
        return
    linears = [module.get_submodule(name) for name in names]
    if any(type(m) is not nn.Linear for m in linears):  # a subclass may compute something else
        raise TypeError(f"linears_in: {[type(m).__name__ for m in linears]} are not all nn.Linear")
    saved = {id(m): vars(m)["forward"] for m in linears if "forward" in vars(m)}
    last: list = []  # [input, its version, its cast]: the last input cast, while the next linear may read it

    def cast(x: torch.Tensor) -> torch.Tensor:
        if not last or last[0] is not x or last[1] != x._version:  # _version: an in-place change since
            last[:] = [x, x._version, x.to(dtype)]
        return last[2]

    def forward(linear: nn.Linear):
        kept: list = []  # [weight data, its version, weight cast, bias cast]: recast when the search swaps weights

        def run(x: torch.Tensor) -> torch.Tensor:
            w = linear.weight.data
            if not kept or kept[0].data_ptr() != w.data_ptr() or kept[1] != w._version:  # kept[0] holds the storage
                bias = None if linear.bias is None else linear.bias.detach().to(dtype)
                kept[:] = [w, w._version, w.to(dtype), bias]
            return nn.functional.linear(cast(x), kept[2], kept[3]).to(x.dtype)
        return run

    try:
        for linear in linears:
            linear.forward = forward(linear)
        yield
    finally:
        last.clear()
        for linear in linears:
            vars(linear).pop("forward", None)  # the class's forward again, or the one the instance had
            if id(linear) in saved:
                linear.forward = saved[id(linear)]


class LayerRunner:
    """Runs one decoder layer over all calibration windows in chunks, with per-batch-size layer kwargs; for Gemma 4's
    E-models also each window's per-layer input (``LayerwiseModel.per_layer_inputs``) and the keys and values a layer
    stores for later layers to read (kept per window from its last run: with --propagate quantized, the quantized
    layer's). With ``compute_dtype`` bfloat16 the layer's quantized linears multiply in it (``linears_in``);
    attention, norms, routers, the residual stream and the windows between layers stay float32."""

    def __init__(self, model: LayerwiseModel, seqlen: int, compute_dtype: torch.dtype = torch.float32):
        self.model = model
        self.seqlen = seqlen
        self.compute_dtype = compute_dtype
        self.chunk = max(1, CHUNK_TOKENS // seqlen)
        self._kwargs: dict[int, list[dict]] = {}
        # (stream, layer type) -> K, V of every window; stream: "" or "reference" (the fp model's pass)
        self._shared_kv: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def kwargs(self, index: int, batch_size: int, start: int = 0, stream: str = "") -> dict:
        """Layer ``index``'s kwargs for windows [start, start + batch_size) of ``stream``."""
        if batch_size not in self._kwargs:
            self._kwargs[batch_size] = self.model.capture_layer_kwargs(batch_size, self.seqlen)
        kwargs = dict(self._kwargs[batch_size][index])
        end = start + batch_size
        if self.model.per_layer_inputs is not None:
            kwargs["per_layer_input"] = self.model.per_layer_inputs[start:end, :, index].to(self.model.device)
        sharing = self.model.kv_sharing(index)
        if sharing is not None:
            role, layer_type = sharing
            shared = {}
            if role == "reuse":
                if (stream, layer_type) not in self._shared_kv:
                    raise RuntimeError(f"layer {index} reads the {layer_type} KV no earlier layer stored")
                k, v = self._shared_kv[stream, layer_type]
                shared[layer_type] = (k[start:end], v[start:end])
            kwargs["shared_kv_states"] = shared
        return kwargs

    @torch.no_grad()
    def run(self, layer: nn.Module, index: int, x: torch.Tensor, out: torch.Tensor,
            observer: GroupInputObserver | None = None,
            reference: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """out[i] = layer(x[i]) for every window (``out`` may be ``x``: computed chunk by chunk). ``reference``
        (x_ref, out_ref): the same windows as the fp model sees them, out_ref[i] = layer(x_ref[i]) (in place too),
        each chunk run just before x's, with the observer recording its inputs to pair x's with."""
        with linears_in(layer, self.compute_dtype, self.model.layer_awq_map(index).linears):
            self._run(layer, index, x, out, observer, reference)

    def _run(self, layer, index, x, out, observer, reference) -> None:
        for start in range(0, x.shape[0], self.chunk):
            end = min(start + self.chunk, x.shape[0])
            if observer is not None:
                observer.begin_chunk(start, x.shape[1])
            if reference is not None:
                if observer is not None:
                    observer.recording_reference = True
                try:
                    self._run_chunk(layer, index, reference[0], reference[1], start, end, "reference")
                finally:
                    if observer is not None:
                        observer.recording_reference = False
            self._run_chunk(layer, index, x, out, start, end, "")
            if reference is not None and observer is not None:
                observer.check_paired()

    def _run_chunk(self, layer: nn.Module, index: int, x: torch.Tensor, out: torch.Tensor, start: int, end: int,
                   stream: str) -> None:
        sharing = self.model.kv_sharing(index)
        kwargs = self.kwargs(index, end - start, start, stream)
        out[start:end] = first_output(layer(x[start:end], **kwargs))
        if sharing is not None and sharing[0] == "store":  # what the layer stored, for the layers that read it
            k, v = kwargs["shared_kv_states"][sharing[1]]
            key = (stream, sharing[1])
            if start == 0:
                self._shared_kv[key] = (k.new_empty(x.shape[0], *k.shape[1:]), v.new_empty(x.shape[0], *v.shape[1:]))
            self._shared_kv[key][0][start:end] = k
            self._shared_kv[key][1][start:end] = v


def check_tolerance(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, tolerance) of a layer output rebuilt from its parts."""
    return float((got - expected).abs().max()), 1e-5 * (1.0 + float(expected.abs().max()))


def table_error(awq_map: AwqMap, name: str, what: str) -> RuntimeError:
    return RuntimeError(f"{name}: {what}; the AWQ map of {awq_map.architecture} (its AWQ table in lmkit/models/) "
                        "is wrong")


@torch.no_grad()
def self_check(layer, awq_map, kwargs, x, name) -> torch.Tensor:
    """RuntimeError unless the decomposition the searches use reproduces the HF layer output and every
    group scored through a post norm computes its residual block's output; returns the layer output."""
    expected = first_output(layer(x, **kwargs))
    outputs: dict[str, torch.Tensor] = {}
    nested = {group.block for group in awq_map.groups  # e.g. o_proj inside Gemma's self_attn
              if group.block not in awq_map.post_norms
              and _residual_block_of(awq_map, group.block) in awq_map.post_norms}
    handles = [layer.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: outputs.__setitem__(n, first_output(out))) for n in nested | set(awq_map.post_norms)]
    try:
        got = decomposed_layer(layer, awq_map, kwargs, x)
    finally:
        for handle in handles:
            handle.remove()
    err, tol = check_tolerance(got, expected)
    if not math.isfinite(err) or err > tol:
        raise table_error(awq_map, name, f"the decomposition does not reproduce the decoder layer (max abs "
                                          f"difference {err:.3g} > {tol:.3g})")
    for block in sorted(nested):
        outer = _residual_block_of(awq_map, block)
        if block not in outputs or not torch.equal(outputs[block], outputs[outer]):
            raise table_error(awq_map, name, f"{block} is scored through the post norm of {outer} but does not "
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
    return check_tolerance(got, expected)


@torch.no_grad()
def can_fold(layer: nn.Module, awq_map: AwqMap, group, kwargs: dict, x: torch.Tensor, expected: torch.Tensor,
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
    raise table_error(awq_map, name, f"folding scales into {group.prev} changes the layer's output (max abs "
                                      f"difference {err:.3g})")


def is_expert_group(awq_map: AwqMap, group) -> bool:
    """One expert's up -> down group of a sparse layer."""
    return awq_map.moe is not None and group.input_of is None and expert_of(awq_map.moe, group.linears[0]) is not None


@torch.no_grad()
def can_fold_expert(layer: nn.Module, awq_map: AwqMap, group, name: str) -> bool:
    """``can_fold`` for one expert's up -> down group, on the expert alone: a trial fold (undone after) must
    leave act(gate x) * up x -> down unchanged on 16 random rows. The layer-wide check costs a layer forward
    per group, 128 per layer of Qwen3-30B-A3B; the fold touches only this expert, so its output is the check."""
    if not can_absorb(layer, group):
        return False
    layout = awq_map.moe
    experts = layer.get_submodule(layout.path(layout.experts))
    e = expert_of(layout, group.linears[0])
    gate, up, down = (experts.linear(e, w) for w in range(3))
    x = torch.randn(16, gate.in_features, generator=torch.Generator().manual_seed(0)).to(gate.weight)

    def expert() -> torch.Tensor:
        return down(experts.glu(gate(x), up(x)))

    err, tol = _trial_fold_error(layer, awq_map, group, expert, expert())
    if math.isfinite(err) and err <= 10 * tol:
        return True
    raise table_error(awq_map, name, f"folding scales into {group.prev} changes expert {e}'s output (max abs "
                                      f"difference {err:.3g})")


class Discard:
    """An output buffer that drops what is written to it (the fp pass only feeds the observer)."""

    def __setitem__(self, key, value) -> None:
        pass


@torch.no_grad()
def cover_experts(layer: nn.Module, awq_map: AwqMap, stats: list[InputStats], min_tokens: int, group_size: int) -> dict:
    """Calibration tokens routed to each expert of a sparse layer. An expert that fewer than ``min_tokens``
    tokens reached (AWQ: one quantization group) has its down projection's statistics rebuilt from every token of the search
    windows run through its gate and up (as if routed to it; the shared gate/up statistics are every token's
    already): its smoothing, clipping and rounding are then searched on the union of tokens, not on a handful
    of rows or none. ``group_size``: of the stats' per-group moments. Returns the report entry (tokens per
    expert, those handled so)."""
    layout = awq_map.moe
    shared = next(i for i, group in enumerate(awq_map.groups) if group.input_of == layout.shared_input)
    x = stats[shared].sample_input
    x = x.reshape(-1, x.shape[-1])
    experts = layer.get_submodule(layout.path(layout.experts))
    tokens, union = [], []
    for i, group in enumerate(awq_map.groups):
        if not is_expert_group(awq_map, group):
            continue
        e = expert_of(layout, group.linears[0])
        tokens.append(stats[i].num_tokens)
        if stats[i].num_tokens >= min_tokens:
            continue
        union.append(e)
        h = experts.glu(experts.linear(e, 0)(x), experts.linear(e, 1)(x))
        old = stats[i]
        rebuilt = InputStats(torch.zeros_like(old.abs_sum), None if old.moments is None else torch.zeros_like(old.moments),
                             None if old.hessian is None else torch.zeros_like(old.hessian))
        rebuilt.accumulate(h.float(), group_size)
        if rebuilt.hessian is not None and old.moments is not None:
            rebuilt.moments_from_hessian(group_size)
        rebuilt.samples = [h.float()]
        stats[i] = rebuilt
    return {"tokens_per_expert": tokens, "min_tokens": min_tokens, "searched_on_all_tokens": union}


def calibration_inputs(model: LayerwiseModel, config) -> tuple[torch.Tensor, int]:
    """(embeddings [samples, seqlen, hidden] fp32, seqlen) of ``config``'s calibration windows (calib_dataset,
    calib_samples, calib_seqlen clipped to the model's context, seed), tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    from lmkit.lite.calib import mixed_windows
    from lmkit.lite.corpora import calibration_corpora

    tokenizer = AutoTokenizer.from_pretrained(model.folder)
    seqlen = min(config.calib_seqlen, model.max_seqlen) if model.max_seqlen else config.calib_seqlen
    windows = mixed_windows(tokenizer, calibration_corpora(config.calib_dataset), config.calib_samples, seqlen,
                            config.seed)
    return model.embed(windows), seqlen


def write_checkpoint(model: LayerwiseModel, tensors: dict[str, torch.Tensor], folder: Path,
                     quant_config: dict) -> None:
    """The quantizers' common end: ``tensors`` (the layers', emptied once written) and the model's outer ones
    as safetensors shards in ``folder``, config.json with ``quant_config``, the tokenizer and other side files."""
    tensors.update(outer_tensors(model))
    export.save_tensors(tensors, folder)
    tensors.clear()
    export.write_config(model.folder, folder, quant_config)
    export.copy_side_files(model.folder, folder)


def outer_tensors(model: LayerwiseModel) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors outside the decoder layers (embeddings, final norm, lm_head; a multimodal
    checkpoint's vision tower), floats as fp16."""
    prefix = model.arch.to_checkpoint(model.awq_map.layers + ".")
    tensors = {}
    for name in model.entries:
        if not name.startswith(prefix):
            value = model.read_tensor(name)
            tensors[name] = value.to(torch.float16) if value.is_floating_point() else value
    return tensors


def foldable_groups(layer: nn.Module, awq_map: AwqMap, kwargs: dict, x: torch.Tensor, name: str,
                    enabled: bool) -> list[bool]:
    """Per smoothing group of ``layer``, whether scales may be folded into its prev (``can_fold``, or
    ``can_fold_expert`` for one expert's group), after ``self_check`` of the table on ``x`` (one window, the
    layer's ``kwargs`` for it); all False when smoothing is not ``enabled`` (the self check still runs)."""
    expected = self_check(layer, awq_map, kwargs, x, name)
    return [enabled and (can_fold_expert(layer, awq_map, group, name) if is_expert_group(awq_map, group) else
                         can_fold(layer, awq_map, group, kwargs, x, expected, name)) for group in awq_map.groups]


@torch.no_grad()
def fold_chosen(layer: nn.Module, awq_map: AwqMap, stats: list[InputStats], chosen: list, prefix: str,
                scales_out: dict) -> None:
    """Folds each group's chosen scales (None: none) into ``layer``, rescales its input statistics to match and
    records the scales in ``scales_out`` under ``prefix + prev``."""
    for group, group_stats, scales in zip(awq_map.groups, stats, chosen):
        if scales is not None:
            fold_scales(layer, group, scales, awq_map.norm_weight_offset)
            group_stats.rescale(scales)
            scales_out[prefix + group.prev] = scales


def layer_other_tensors(model: LayerwiseModel, index: int, layer: nn.Module, awq_map: AwqMap) -> dict[str, torch.Tensor]:
    """Layer ``index``'s tensors other than its quantized linears' weights and biases (norms, a router, ...), under
    the checkpoint's names, in fp16."""
    quantized = {n + ".weight" for n in awq_map.linears} | {n + ".bias" for n in awq_map.linears}
    return {model.checkpoint_name(index, name): value.detach().to("cpu", torch.float16)
            for name, value in layer.state_dict().items() if name not in quantized}
