"""A checkpoint's ``quantization_config`` -> the engine's int4 settings: which int4 layout its linears are stored
in (csrc/model/int4_layouts.h: AutoAWQ GEMM, GPTQ v1/v2, compressed-tensors pack-quantized) and their group
size. Every field the engine cannot serve fails here, naming it, before any tensor is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KERNEL_GROUP_SIZES = (32, 64, 128)  # groups the int4 kernels run; larger checkpoint groups are repeated


@dataclass(frozen=True)
class Int4Settings:
    """How a checkpoint's int4 linears are stored."""

    layout: str  # "awq", "gptq", "gptq_v2", "pack_quantized"
    group_size: int  # along the inputs; 0: one group per row (per-channel)
    method: str  # quantization_config.quant_method as written (for messages and the start-up line)
    # the checkpoint's tensor names of one int4 linear ("<module>.<name>"), handed to the engine as the roles
    # "<linear>.values", ".zeros", ".scales", ".g_idx" (g_idx None: the layout has none)
    tensor_names: tuple[str, str, str, str | None]
    # per-linear tensors that carry nothing the engine needs (compressed-tensors' weight_shape: the shape the
    # layer's config already gives)
    extra_suffixes: tuple[str, ...] = ()

    def describe(self) -> str:
        group = "per-channel" if self.group_size == 0 else f"g{self.group_size}"
        return f"{self.method} int4 {group} ({self.layout} layout)"


_AWQ_NAMES = ("qweight", "qzeros", "scales", None)
_GPTQ_NAMES = ("qweight", "qzeros", "scales", "g_idx")
_PACKED_NAMES = ("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx")


def _check_group(group, where: str, allow_channel: bool) -> int:
    """The group size as the engine reads it (0: per channel); ValueError unless it is a multiple of 32."""
    try:
        g = int(group)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={group!r} is not a group size") from None
    if allow_channel and g in (-1, 0):
        return 0
    if g <= 0 or g % 32:
        raise ValueError(f"{where}={group!r} is not supported; int4 groups must be a multiple of 32 "
                         f"({', '.join(map(str, KERNEL_GROUP_SIZES))}, or larger multiples"
                         f"{', or -1 for per-channel' if allow_channel else ''})")
    return g


def _awq(qc: dict, where: str) -> Int4Settings:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}.version={qc.get('version')!r} is not supported; only AutoAWQ 'gemm' packing is")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits is None or int(bits) != 4:
        raise ValueError(f"{where}.bits={bits!r} is not supported; AWQ checkpoints must be 4-bit")
    if not qc.get("zero_point", True):
        raise ValueError(f"{where}.zero_point=false is not supported; lmkit serves asymmetric AWQ (zero_point true)")
    if qc.get("desc_act"):
        raise ValueError(f"{where}.desc_act=true (act-order) is not supported by AWQ GEMM checkpoints")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group is None or int(group) not in KERNEL_GROUP_SIZES:
        raise ValueError(f"{where}.group_size={group!r} is not supported; use one of {KERNEL_GROUP_SIZES}")
    return Int4Settings("awq", int(group), "awq", _AWQ_NAMES)


def _gptq(qc: dict, where: str) -> Int4Settings:
    bits = qc.get("bits")
    if bits is None or int(bits) != 4:
        raise ValueError(f"{where}.bits={bits!r} is not supported; lmkit serves 4-bit GPTQ checkpoints")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}.checkpoint_format={fmt!r} is not supported; lmkit reads 'gptq' and 'gptq_v2' "
                         "(GPTQModel's marlin/bitblas/ipex formats are repacks of these: convert back with GPTQModel)")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head=true (a quantized lm_head) is not supported; quantize without it")
    group = _check_group(qc.get("group_size", 128), f"{where}.group_size", allow_channel=True)
    return Int4Settings(fmt, group, "gptq", _GPTQ_NAMES)


def _compressed_tensors(qc: dict, where: str) -> Int4Settings:
    status = str(qc.get("quantization_status", "compressed")).lower()
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status={status!r} is not supported; save the model compressed "
                         "(llm-compressor: save_compressed=True)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}.config_groups has {len(groups)} schemes ({', '.join(groups) or 'none'}); "
                         "lmkit serves checkpoints quantized with one scheme")
    (name, scheme), = groups.items()
    at = f"{where}.config_groups.{name}"
    fmt = str(scheme.get("format") or qc.get("format") or "").lower()
    weights = scheme.get("weights") or {}
    acts = scheme.get("input_activations")
    if acts:
        raise ValueError(f"{at}.input_activations is set ({acts.get('num_bits')}-bit {acts.get('type')}); "
                         "lmkit serves weight-only int4 (W4A16) compressed-tensors checkpoints")
    if fmt != "pack-quantized":
        raise ValueError(f"{at}: format {fmt!r} is not supported; lmkit serves compressed-tensors "
                         "'pack-quantized' int4 weights")
    if str(weights.get("type", "int")).lower() != "int" or int(weights.get("num_bits", 0)) != 4:
        raise ValueError(f"{at}.weights: {weights.get('num_bits')}-bit {weights.get('type')} is not supported; "
                         "pack-quantized checkpoints must be 4-bit int")
    strategy = str(weights.get("strategy", "")).lower()
    if strategy == "channel":
        group = 0
    elif strategy == "group":
        group = _check_group(weights.get("group_size"), f"{at}.weights.group_size", allow_channel=False)
    else:
        raise ValueError(f"{at}.weights.strategy={strategy!r} is not supported; use 'group' or 'channel'")
    if weights.get("dynamic"):
        raise ValueError(f"{at}.weights.dynamic=true is not supported for weights")
    targets = scheme.get("targets") or []
    if targets not in (["Linear"], ["re:.*"]) and not all(str(t).startswith("re:") for t in targets):
        raise ValueError(f"{at}.targets={targets!r} is not supported; lmkit serves schemes that target 'Linear'")
    return Int4Settings("pack_quantized", group, "compressed-tensors", _PACKED_NAMES,
                        extra_suffixes=("weight_shape",))


_READERS = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}


def int4_settings(cfg: dict, cfg_path: Path) -> Int4Settings | None:
    """The checked int4 settings of a checkpoint's ``quantization_config`` (None for a float checkpoint).

    Raises ValueError naming the field this engine cannot serve.
    """
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return None
    where = f"{cfg_path}: quantization_config"
    method = str(qc.get("quant_method", "")).lower()
    reader = _READERS.get(method)
    if reader is None:
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; lmkit serves "
                         f"{', '.join(repr(m) for m in _READERS)} int4 checkpoints")
    return reader(qc, where)
