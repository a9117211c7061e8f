"""The reference reader: any HF folder (fp, AWQ "GEMM" int4, compressed-tensors pack-quantized int4,
int-quantized / naive-quantized int8, float-quantized / naive-quantized FP8 E4M3, nvfp4- / mxfp4-pack-quantized FP4,
written by lmkit or another tool)
-> an fp32 ``transformers`` model. AWQ linears are unpacked and dequantized in torch, W[o, i] = (q[i, o] -
zero[i / g, o]) * scale[i / g, o]; compressed-tensors linears by that library's own decompressor: both independently
of lmkit's engine. A compressed-tensors scheme with dynamic input activations (W8A8, FP8_DYNAMIC) gets them too: each
quantized linear's input goes through compressed-tensors' own fake quantization first, so the reference computes
what the checkpoint declares. A mixture of experts' per-expert linears are stacked into transformers' 3D expert
tensors (lmkit.lite.moe).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmkit.lite.layerwise import architecture_of, attention_implementation, read_config, text_model_config
from lmkit.lite.quantizer import NUM_BITS, unpack_awq_gemm
from lmkit.models.safetensors_index import index_folder

AWQ_SUFFIXES = (".qweight", ".qzeros", ".scales")


CT_SUFFIXES = (".weight_zero_point", ".weight_scale", ".weight_shape", ".weight_g_idx", ".weight_global_scale",
               ".input_global_scale")
CT_INT_FORMATS = ("int-quantized", "naive-quantized")  # int8 weights stored as int8 ``.weight``
CT_NAIVE_FORMATS = (*CT_INT_FORMATS, "float-quantized")  # 8-bit weights stored as such: int8, or FP8 E4M3
CT_FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")  # e2m1 codes packed two a byte


def quantization_settings(config: dict) -> dict | None:
    """The checked ``quantization_config`` of a checkpoint this reader dequantizes (AWQ GEMM, compressed-tensors
    pack-quantized, int-quantized, naive-quantized or float-quantized), None for an fp checkpoint.

    Raises ValueError for quantization this reader does not understand.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors" and str(qc.get("format", "")).lower() in ("pack-quantized", *CT_NAIVE_FORMATS,
                                                                                 *CT_FP4_FORMATS):
        return qc
    version = str(qc.get("version", "gemm")).lower()
    if method != "awq" or version != "gemm" or int(qc.get("bits", qc.get("w_bit", 0))) != NUM_BITS:
        raise ValueError(f"unsupported quantization_config {qc}: this reader handles AWQ GEMM 4-bit and "
                         f"compressed-tensors pack-quantized, {', '.join(CT_NAIVE_FORMATS + CT_FP4_FORMATS)} only")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")
    return qc


def _ct_scheme(settings: dict):
    """The one weight scheme of a compressed-tensors config (compressed-tensors' own QuantizationConfig)."""
    from compressed_tensors.quantization import QuantizationConfig

    groups = QuantizationConfig.model_validate(settings).config_groups
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors config with {len(groups)} schemes: this reader handles one")
    return next(iter(groups.values()))


def _ct_compressor(fmt: str):
    """compressed-tensors' own compressor class of a format: int-quantized / naive-quantized / float-quantized (one
    decompression: weight times scale), pack-quantized, or the FP4 formats' (registered under their names)."""
    if fmt in CT_NAIVE_FORMATS:
        from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor

        return IntQuantizationCompressor
    if fmt in CT_FP4_FORMATS:
        from compressed_tensors.compressors import BaseCompressor

        return BaseCompressor.get_value_from_registry(fmt)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor


def tensor_reader(entries: dict):
    """name -> the stored tensor, for the entries of safetensors_index.index_folder (each file opened once)."""
    from safetensors import safe_open

    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        path = entries[name].path
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    return read


def read_state_dict(folder: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """fp32 state dict of ``folder`` with every quantized linear dequantized to ``<name>.weight``;
    and the quantization settings (None for an fp checkpoint)."""
    folder = Path(folder)
    settings = quantization_settings(read_config(folder))
    entries = index_folder(folder)
    read = tensor_reader(entries)

    is_ct = settings is not None and settings.get("quant_method") == "compressed-tensors"
    scheme = _ct_scheme(settings) if is_ct else None
    ct_format = str(settings.get("format", "")).lower() if is_ct else ""
    ct_int = ct_format in CT_NAIVE_FORMATS
    ct_marker = ".weight" if ct_int else ".weight_packed"  # a compressed-tensors linear's quantized weight
    state: dict[str, torch.Tensor] = {}
    for name in entries:
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            missing = [base + s for s in (".qzeros", ".scales") if base + s not in entries]
            if missing:
                raise ValueError(f"{folder}: {name} has no {', '.join(missing)}")
            qw = unpack_awq_gemm(read(name), read(base + ".qzeros"), read(base + ".scales"))
            if settings is not None and int(settings.get("group_size", qw.group_size)) not in (qw.group_size, -1):
                raise ValueError(f"{folder}: {base} has group size {qw.group_size}, config says "
                                 f"{settings.get('group_size')}")
            state[base + ".weight"] = qw.dequantize()
        elif is_ct and name.endswith(".weight_scale"):  # one per quantized linear, whatever the format
            base = name[: -len(".weight_scale")]
            if base + ct_marker not in entries:
                raise ValueError(f"{folder}: {name} has no matching {ct_marker[1:]}")
            local = {s[1:]: read(base + s) for s in (ct_marker, *CT_SUFFIXES) if base + s in entries}
            if local["weight_scale"].dtype == torch.float8_e8m0fnu:  # MXFP4 exponents stored as F8_E8M0: their bytes
                local["weight_scale"] = local["weight_scale"].view(torch.uint8)
            local["weight_scale"] = local["weight_scale"].float()  # dequantize in fp32
            local.pop("input_global_scale", None)  # FP4 activations' calibration: no part of the weight
            state[base + ".weight"] = _ct_compressor(ct_format).decompress(local, scheme)["weight"].float()
        elif is_ct and name.endswith(ct_marker) and name[: -len(ct_marker)] + ".weight_scale" in entries:
            pass  # the quantized weight: dequantized with its scale above
        elif is_ct and name.endswith(".weight_packed"):
            raise ValueError(f"{folder}: {name} has no matching weight_scale")
        elif name.endswith((".qzeros", ".scales")):
            if name.rsplit(".", 1)[0] + ".qweight" not in entries:
                raise ValueError(f"{folder}: {name} has no matching .qweight")
        elif is_ct and name.endswith(CT_SUFFIXES):
            if name.rsplit(".", 1)[0] + ct_marker not in entries:
                raise ValueError(f"{folder}: {name} has no matching {ct_marker[1:]}")
        else:
            tensor = read(name)
            state[name] = tensor.float() if tensor.is_floating_point() else tensor
    marker = ".weight_scale" if is_ct else ".qweight"
    if settings is not None and not any(n.endswith(marker) for n in entries):
        raise ValueError(f"{folder}: config.json says {settings.get('quant_method')} but no {marker} tensors "
                         "were found")
    return state, settings


def load_causal_lm(folder: Path, device: torch.device | str = "cpu", quantize_activations: bool = True):
    """An fp32, eval-mode ``transformers`` causal LM of ``folder`` (fp, AWQ GEMM, compressed-tensors int4 or int8,
    with the scheme's dynamic per-token activation quantization where it has one; a multimodal checkpoint: its text
    model), sdpa attention (eager where transformers has no sdpa for the architecture: Gemma 2's soft-capping). ``quantize_activations`` False: the
    dequantized weights only.

    Raises ValueError when tensors are missing or left over.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from lmkit.lite.moe import stack_experts
    from lmkit.models import get_architecture

    folder = Path(folder)
    architecture = architecture_of(read_config(folder), folder)
    state, settings = read_state_dict(folder)
    arch = get_architecture(architecture)
    awq_map = arch.awq_map
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized here; transformers must not re-quantize
    quantized_names = {n[: -len(".weight_scale")] for n in index_folder(folder) if n.endswith(".weight_scale")}
    config = text_model_config(config, arch)
    if arch.text_prefix != "model.":  # a multimodal checkpoint: its text model's tensors, named as transformers does
        state = {text: t for name, t in state.items() if (text := arch.from_checkpoint(name)) is not None}
        quantized_names = {text for n in quantized_names if (text := arch.from_checkpoint(n)) is not None}
    if awq_map is not None and awq_map.moe is not None:  # per-expert linears -> transformers' 3D experts
        state = stack_experts(state, awq_map.moe, awq_map.layers + ".")
    with no_init_weights():  # fp32 buffers too: ones computed at construction in the saved dtype (fp16) stay rounded
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config),
                                                 dtype=torch.float32)
    model = model.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [n for n in missing if not (tied and n == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not match {type(model).__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    if quantize_activations and settings is not None and settings.get("quant_method") == "compressed-tensors":
        fake_quantize_inputs(model, quantized_names, _ct_scheme(settings))
    return model.to(device).eval()


def fake_quantize_inputs(model, linears: set[str], scheme) -> int:
    """Registers on each linear named in ``linears`` (checkpoint names; a mixture of experts' per-expert linears
    are stacked in transformers and left out) a pre-hook that sends its input through compressed-tensors' own
    fake quantization of ``scheme.input_activations`` when they are dynamic per token; returns the number of
    linears hooked (0: the scheme quantizes weights only)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.input_activations
    if args is None:
        return 0
    if not (args.dynamic is True and str(getattr(args.strategy, "value", args.strategy)) == "token"):
        raise ValueError(f"input activations {args.strategy} (dynamic={args.dynamic}): the reference fake-quantizes "
                         "dynamic per-token activations only")

    def hook(module, inputs):
        x = inputs[0]
        scale, zero_point = calculate_qparams(x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True), args)
        return (fake_quantize(x, scale, zero_point, args),) + inputs[1:]

    count = 0
    for name, module in model.named_modules():
        if name in linears and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook)
            count += 1
    return count
