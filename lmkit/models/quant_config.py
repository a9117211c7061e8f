"""A checkpoint's ``quantization_config`` -> how its linears' weights are quantized: an int4 layout
(csrc/model/int4_layouts.h: AutoAWQ GEMM, GPTQ v1/v2, compressed-tensors pack-quantized; the FP4 ones:
compressed-tensors nvfp4- / mxfp4-pack-quantized and NVIDIA ModelOpt's NVFP4, also read from hf_quant_config.json)
and its group size, or compressed-tensors int8 (W8A8 / W8A16: int8 ``weight`` and a float ``weight_scale`` per
channel or group, read by csrc/model/weights.cpp into the int8 kernels' blocks), or FP8 E4M3 (compressed-tensors
``float-quantized`` and the vendor ``quant_method: fp8`` with ``weight_scale_inv`` per block: dequantized at load,
lmkit/models/fp8.py). Every field the engine cannot serve fails here, naming it, before any tensor is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KERNEL_GROUP_SIZES = (32, 64, 128)  # groups the int4 kernels run; larger checkpoint groups are repeated


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's quantized linears are stored."""

    layout: str  # int4: "awq", "gptq", "gptq_v2", "pack_quantized"; int8: "int8"; FP8 E4M3: "fp8"
    group_size: int  # along the inputs; 0: one group per row (per-channel)
    method: str  # quantization_config.quant_method as written (for messages and the start-up line)
    # int4: the checkpoint's tensor names of one linear ("<module>.<name>"), handed to the engine as the roles
    # "<linear>.values", ".zeros", ".scales", ".g_idx" (None: the layout has none). int8: ("weight", None,
    # "weight_scale", None): the int8 weight keeps the linear's role, its scales go as "<linear>.scales"
    tensor_names: tuple[str, str | None, str, str | None]
    # per-linear tensors that carry nothing the engine needs (compressed-tensors' weight_shape: the shape the
    # layer's config already gives)
    extra_suffixes: tuple[str, ...] = ()
    bits: int = 4
    activations: str = ""  # what the checkpoint says of activations: "" (weight-only) or "int8 per token, dynamic"
    # fp8: what one weight scale covers: "tensor", "channel" or (rows, columns) of a block (lmkit/models/fp8.py)
    fp8_scales: str | tuple[int, int] = ""
    # int4 NVFP4: the checkpoint's name of a linear's one global scale ("<module>.<name>"), handed to the engine as
    # the role "<linear>.global_scale"
    global_scale_name: str | None = None
    # int4 FP4: the safetensors dtype its one-byte scales may be stored as besides U8 (NVFP4: F8_E4M3; MXFP4:
    # F8_E8M0), handed to the engine as the bytes they are
    scale_bytes_dtype: str = ""

    @property
    def int4_layout(self) -> str:
        """The engine's ModelConfig.int4_layout: the layout for int4, "" for int8 (read by dtype)."""
        return self.layout if self.bits == 4 else ""

    def describe(self) -> str:
        if self.layout == "fp8":
            scales = (f"per {self.fp8_scales}" if isinstance(self.fp8_scales, str) else
                      f"per {self.fp8_scales[0]}x{self.fp8_scales[1]} block")
            acts = f"; activations {self.activations}, not applied on the CPU" if self.activations else ""
            return f"{self.method} fp8 e4m3, scales {scales} (dequantized at load{acts})"
        if self.layout in _FP4_LAYOUTS:
            acts = f"; activations {self.activations}, not applied on the CPU" if self.activations else ""
            return f"{self.method} {_FP4_LAYOUTS[self.layout]} (e2m1 weights, scales per {self.group_size}{acts})"
        group = "per-channel" if self.group_size == 0 else f"g{self.group_size}"
        acts = f", activations {self.activations}" if self.activations else ""
        return f"{self.method} int{self.bits} {group} ({self.layout} layout{acts})"


# engine layout -> format
_FP4_LAYOUTS = {"mxfp4_pack_quantized": "mxfp4", "nvfp4_pack_quantized": "nvfp4", "nvfp4_modelopt": "nvfp4"}
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


def _awq(qc: dict, where: str) -> WeightQuant:
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
    return WeightQuant("awq", int(group), "awq", _AWQ_NAMES)


def _gptq(qc: dict, where: str) -> WeightQuant:
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
    return WeightQuant(fmt, group, "gptq", _GPTQ_NAMES)


def _compressed_tensors(qc: dict, where: str) -> WeightQuant:
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
    targets = scheme.get("targets") or []
    if targets not in (["Linear"], ["re:.*"]) and not all(str(t).startswith("re:") for t in targets):
        raise ValueError(f"{at}.targets={targets!r} is not supported; lmkit serves schemes that target 'Linear'")
    if weights.get("dynamic"):
        raise ValueError(f"{at}.weights.dynamic=true is not supported for weights")
    if fmt == "float-quantized" or (fmt == "naive-quantized" and str(weights.get("type", "")).lower() == "float"):
        return _compressed_tensors_fp8(scheme, at, fmt)
    if fmt in _INT8_FORMATS:
        return _compressed_tensors_int8(scheme, at, fmt)
    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        return _compressed_tensors_fp4(scheme, at, fmt)
    acts = scheme.get("input_activations")
    if acts:
        raise ValueError(f"{at}.input_activations is set ({acts.get('num_bits')}-bit {acts.get('type')}) with format "
                         f"{fmt!r}; lmkit serves weight-only int4 (W4A16) pack-quantized and int8 "
                         f"({', '.join(_INT8_FORMATS)}) compressed-tensors checkpoints")
    if fmt != "pack-quantized":
        raise ValueError(f"{at}: format {fmt!r} is not supported; lmkit serves compressed-tensors "
                         f"'pack-quantized' int4, 'mxfp4-pack-quantized' and 'nvfp4-pack-quantized' fp4, "
                         f"{', '.join(repr(f) for f in _INT8_FORMATS)} int8 and 'float-quantized' fp8 weights")
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
    return WeightQuant("pack_quantized", group, "compressed-tensors", _PACKED_NAMES,
                       extra_suffixes=("weight_shape",))


def _compressed_tensors_fp4(scheme: dict, at: str, fmt: str) -> WeightQuant:
    """compressed-tensors FP4 weights (llm-compressor's NVFP4A16 / NVFP4 and MXFP4A16 / MXFP4 presets): e2m1 codes
    packed two a byte, symmetric; NVFP4 with an FP8 E4M3 scale per 16 inputs and a global scale per tensor, MXFP4
    with an e8m0 scale per 32. FP4 activations, where the scheme has them, are not applied on the CPU (activations
    run in the compute dtype, or int8 with int8_activations)."""
    nv = fmt == "nvfp4-pack-quantized"
    name, block, strategy = ("NVFP4", 16, "tensor_group") if nv else ("MXFP4", 32, "group")
    weights = scheme.get("weights") or {}
    if str(weights.get("type", "")).lower() != "float" or int(weights.get("num_bits", 0)) != 4:
        raise ValueError(f"{at}.weights: {weights.get('num_bits')}-bit {weights.get('type')} is not supported with "
                         f"format {fmt!r}; it holds 4-bit float (e2m1) weights")
    if not weights.get("symmetric", True):
        raise ValueError(f"{at}.weights.symmetric=false is not supported; {name} weights are symmetric")
    if weights.get("actorder"):
        raise ValueError(f"{at}.weights.actorder={weights['actorder']!r} is not supported for {name}")
    if str(weights.get("strategy", "")).lower() != strategy or int(weights.get("group_size") or 0) != block:
        raise ValueError(f"{at}.weights: strategy {weights.get('strategy')!r} with group_size "
                         f"{weights.get('group_size')!r} is not {name}; it has strategy {strategy!r} and group_size "
                         f"{block}")
    acts = scheme.get("input_activations")
    activations = ""
    if acts:
        if str(acts.get("type", "")).lower() != "float" or int(acts.get("num_bits", 0)) != 4:
            raise ValueError(f"{at}.input_activations: {acts.get('num_bits')}-bit {acts.get('type')} is not "
                             f"supported with {name} weights; lmkit serves them with fp4 or no activation "
                             "quantization")
        activations = f"fp4 per {acts.get('group_size')}, dynamic"
    layout = "nvfp4_pack_quantized" if nv else "mxfp4_pack_quantized"
    return WeightQuant(layout, block, "compressed-tensors", ("weight_packed", None, "weight_scale", None),
                       extra_suffixes=("weight_shape", "input_global_scale"), activations=activations,
                       global_scale_name="weight_global_scale" if nv else None,
                       scale_bytes_dtype="F8_E4M3" if nv else "F8_E8M0")


_INT8_FORMATS = ("int-quantized", "naive-quantized")  # int8 weights stored as int8 tensors (llm-compressor W8A8)
_INT8_NAMES = ("weight", None, "weight_scale", None)


def _compressed_tensors_int8(scheme: dict, at: str, fmt: str) -> WeightQuant:
    """compressed-tensors int8 weights (W8A8 int8 as llm-compressor's SmoothQuant/GPTQ presets write it, or W8A16):
    symmetric, per channel or in groups of a multiple of 16 inputs; activations, if the scheme quantizes them,
    int8 dynamic per token (the engine's int8_activations quantizes per 32 values at run time: finer)."""
    weights = scheme.get("weights") or {}
    if str(weights.get("type", "int")).lower() != "int" or int(weights.get("num_bits", 0)) != 8:
        raise ValueError(f"{at}.weights: {weights.get('num_bits')}-bit {weights.get('type')} is not supported with "
                         f"format {fmt!r}; lmkit serves 8-bit int weights there (int4: 'pack-quantized')")
    if not weights.get("symmetric", True):
        raise ValueError(f"{at}.weights.symmetric=false is not supported; lmkit serves symmetric int8 weights")
    strategy = str(weights.get("strategy", "")).lower()
    if strategy == "channel":
        group = 0
    elif strategy == "group" and int(weights.get("group_size") or 0) > 0 and int(weights["group_size"]) % 16 == 0:
        group = int(weights["group_size"])
    else:
        raise ValueError(f"{at}.weights.strategy={strategy!r} (group_size {weights.get('group_size')!r}) is not "
                         "supported for int8; use 'channel', or 'group' with a multiple of 16")
    acts = scheme.get("input_activations")
    activations = ""
    if acts:
        if str(acts.get("type", "int")).lower() != "int" or int(acts.get("num_bits", 0)) != 8:
            raise ValueError(f"{at}.input_activations: {acts.get('num_bits')}-bit {acts.get('type')} is not "
                             "supported; lmkit runs int8 activations")
        if not acts.get("dynamic", False):
            raise ValueError(f"{at}.input_activations.dynamic=false (static activation scales, input_scale) is not "
                             "supported; lmkit quantizes activations at run time (dynamic, per token or finer)")
        if not acts.get("symmetric", True):
            raise ValueError(f"{at}.input_activations.symmetric=false is not supported; lmkit's int8 activations "
                             "are symmetric")
        activations = f"int8 per {str(acts.get('strategy', 'token')).lower()}, dynamic"
    return WeightQuant("int8", group, "compressed-tensors", _INT8_NAMES, bits=8, activations=activations)


_FP8_NAMES = ("weight", None, "weight_scale", None)


def _compressed_tensors_fp8(scheme: dict, at: str, fmt: str) -> WeightQuant:
    """compressed-tensors FP8 E4M3 weights (llm-compressor's FP8_DYNAMIC, FP8 weight-only and FP8_BLOCK): symmetric,
    ``weight_scale`` per tensor, channel or block; activations none or FP8 dynamic per token (not applied on the CPU:
    the weights are dequantized at load and activations run in the compute dtype)."""
    weights = scheme.get("weights") or {}
    if str(weights.get("type", "")).lower() != "float" or int(weights.get("num_bits", 0)) != 8:
        raise ValueError(f"{at}.weights: {weights.get('num_bits')}-bit {weights.get('type')} is not supported with "
                         f"format {fmt!r}; lmkit serves 8-bit float (FP8 E4M3) weights there")
    if not weights.get("symmetric", True):
        raise ValueError(f"{at}.weights.symmetric=false is not supported; FP8 weights must be symmetric")
    strategy = str(weights.get("strategy", "")).lower()
    if strategy in ("tensor", "channel"):
        cover: str | tuple[int, int] = strategy
    elif strategy == "block" and _is_block(weights.get("block_structure")):
        cover = tuple(int(b) for b in weights["block_structure"])
    else:
        raise ValueError(f"{at}.weights.strategy={strategy!r} (block_structure {weights.get('block_structure')!r}) "
                         "is not supported for FP8; use 'tensor', 'channel' or 'block' with [rows, columns]")
    acts = scheme.get("input_activations")
    activations = ""
    if acts:
        if str(acts.get("type", "")).lower() != "float" or int(acts.get("num_bits", 0)) != 8:
            raise ValueError(f"{at}.input_activations: {acts.get('num_bits')}-bit {acts.get('type')} is not "
                             "supported with FP8 weights; lmkit serves FP8 weights with FP8 dynamic or no activation "
                             "quantization")
        if acts.get("dynamic") is not True:
            raise ValueError(f"{at}.input_activations.dynamic={acts.get('dynamic')!r} (static FP8 activation scales, "
                             "input_scale) is not supported; use a dynamic scheme (llm-compressor FP8_DYNAMIC)")
        activations = f"fp8 per {str(acts.get('strategy', 'token')).lower()}, dynamic"
    return WeightQuant("fp8", 0, "compressed-tensors", _FP8_NAMES, bits=8, activations=activations,
                       fp8_scales=cover)


def _is_block(block) -> bool:
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def _fp8(qc: dict, where: str) -> WeightQuant:
    """The vendor FP8 form (Qwen3-*-FP8, DeepSeek-V3; transformers' FineGrainedFP8): E4M3 ``weight`` with a
    ``weight_scale_inv`` per ``weight_block_size`` block (a multiplier despite its name: W = q * scale_inv),
    activations dynamic (not applied on the CPU); ``modules_to_not_convert`` are stored in bf16/fp16 and load as
    dense layers."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt={qc.get('fmt')!r} is not supported; lmkit serves FP8 E4M3 weights only")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(f"{where}.activation_scheme={qc.get('activation_scheme')!r} (static FP8 activation scales, "
                         "input_scale) is not supported; lmkit serves activation_scheme 'dynamic'")
    block = qc.get("weight_block_size")
    if not _is_block(block):
        raise ValueError(f"{where}.weight_block_size={block!r} is not supported; lmkit serves FP8 checkpoints "
                         "with weight_scale_inv per block, e.g. [128, 128]")
    return WeightQuant("fp8", 0, "fp8", ("weight", None, "weight_scale_inv", None), bits=8,
                       activations="fp8 per token group, dynamic", fp8_scales=(int(block[0]), int(block[1])))


_MODELOPT_NVFP4 = {"NVFP4": "fp4 per 16, dynamic", "W4A16_NVFP4": ""}  # quant_algo -> its activations


def _modelopt(qc: dict, where: str) -> WeightQuant:
    """NVIDIA ModelOpt's NVFP4 (its unified HF export: Llama/Qwen/DeepSeek *-FP4 checkpoints): per linear ``weight``
    U8 (e2m1 codes two a byte, as compressed-tensors' weight_packed), ``weight_scale`` E4M3 per 16 inputs and
    ``weight_scale_2`` a per-tensor multiplier (compressed-tensors' 1 / weight_global_scale); ``input_scale`` (its
    static FP4 activation scale) and FP8 KV scales are not applied on the CPU; ``ignore`` / ``exclude_modules``
    layers are stored in bf16 and load as dense layers."""
    algo = str(qc.get("quant_algo", "")).upper()
    if algo not in _MODELOPT_NVFP4:
        raise ValueError(f"{where}.quant_algo={qc.get('quant_algo')!r} is not supported; lmkit serves ModelOpt's "
                         f"{', '.join(_MODELOPT_NVFP4)} checkpoints (FP8 ones: use their compressed-tensors form)")
    group = qc.get("group_size", 16)
    if not isinstance(group, int) or isinstance(group, bool) or group != 16:
        raise ValueError(f"{where}.group_size={group!r} is not NVFP4's 16")
    return WeightQuant("nvfp4_modelopt", 16, "modelopt", ("weight", None, "weight_scale", None),
                       extra_suffixes=("input_scale", "k_scale", "v_scale"), activations=_MODELOPT_NVFP4[algo],
                       global_scale_name="weight_scale_2", scale_bytes_dtype="F8_E4M3")


def _mxfp4(qc: dict, where: str) -> None:
    """MXFP4 (gpt-oss as shipped): only the experts are quantized, as ``*_blocks`` / ``*_scales`` tensors their
    architecture's key map names (lmkit/models/gpt_oss.py); every other linear is a float one. An architecture without
    those roles refuses the blocks as tensors it does not use."""
    return None


_READERS = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "mxfp4": _mxfp4, "fp8": _fp8,
            "modelopt": _modelopt}


def _hf_quant_config(folder: Path) -> dict | None:
    """ModelOpt's older exports keep their quantization in hf_quant_config.json only ({"quantization": {...}}):
    as a quantization_config of quant_method modelopt, or None where the folder has none."""
    import json

    path = folder / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        quantization = json.loads(path.read_text(encoding="utf-8")).get("quantization")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a ModelOpt quantization file ({e})") from None
    return {"quant_method": "modelopt", **quantization} if isinstance(quantization, dict) else None


def weight_quant(cfg: dict, cfg_path: Path) -> WeightQuant | None:
    """The checked weight quantization of a checkpoint's ``quantization_config`` (None for a float checkpoint).

    Raises ValueError naming the field this engine cannot serve.
    """
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    where = f"{cfg_path}: quantization_config"
    if not qc:
        qc, where = _hf_quant_config(cfg_path.parent), f"{cfg_path.parent / 'hf_quant_config.json'}: quantization"
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    reader = _READERS.get(method)
    if reader is None:
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; lmkit serves "
                         f"{', '.join(repr(m) for m in _READERS)} checkpoints")
    return reader(qc, where)
