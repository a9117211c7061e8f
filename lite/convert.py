"""Moving an int4 checkpoint between the formats lmkit writes (``lmkit lite convert``), losslessly: AutoAWQ "GEMM"
and compressed-tensors ``pack-quantized`` W4A16 hold the same numbers (per linear: 4-bit q, a 4-bit zero point
and an fp16 scale per group of inputs), so each linear is unpacked to them and packed again; every other tensor
is copied as stored, the side files (tokenizer, templates, generation config) too, and config.json gets the
target's ``quantization_config``. The folder is written beside ``work_dir`` and renamed into place when whole
(lmkit.lite.export).

What cannot be expressed in the target fails before anything is written: act-order (``g_idx``) compressed-tensors
checkpoints to AutoAWQ (which has no input permutation), and groups of different sizes in one checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from lmkit.lite import export
from lmkit.lite.checkpoint import AWQ_SUFFIXES, CT_NAIVE_FORMATS, CT_SUFFIXES, quantization_settings, tensor_reader
from lmkit.lite.config import CHECKPOINT_FORMATS
from lmkit.lite.layerwise import architecture_of, read_config
from lmkit.lite.quantizer import NUM_BITS, QuantizedWeight, unpack_awq_gemm


@dataclass
class ConvertResult:
    work_dir: Path
    source: Path
    source_format: str
    checkpoint_format: str
    group_size: int
    num_linears: int
    size_bytes: int


def checkpoint_format_of(settings: dict) -> str:
    """``autoawq`` or ``compressed-tensors``: the format of a checked int4 ``quantization_config``."""
    return "compressed-tensors" if settings.get("quant_method") == "compressed-tensors" else "autoawq"


def unpack_compressed_tensors(local: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    """Inverse of ``export.pack_compressed_tensors`` for one linear's local tensors (``weight_packed``,
    ``weight_scale``, ``weight_shape``, and ``weight_zero_point`` unless symmetric); compressed-tensors' own
    unpacker reads the nibbles. Symmetric checkpoints get the zero point 8 (their signed q + 8). Raises
    ValueError naming ``name`` for shapes that do not fit, scales fp16 cannot hold exactly or a ``g_idx`` that
    reorders the inputs."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out_features, in_features = (int(v) for v in local["weight_shape"].tolist())
    scales = local["weight_scale"]
    if scales.ndim != 2 or scales.shape[0] != out_features or in_features % scales.shape[1]:
        raise ValueError(f"{name}: weight_scale {list(scales.shape)} does not fit weight_shape "
                         f"[{out_features}, {in_features}] (group-wise int4 expected)")
    group_size = in_features // scales.shape[1]
    if not torch.equal(scales.to(torch.float16).to(scales.dtype), scales):
        raise ValueError(f"{name}: {scales.dtype} scales that are not exact in fp16 (AutoAWQ stores fp16 scales)")
    g_idx = local.get("weight_g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(in_features, dtype=torch.int64) // group_size):
        raise ValueError(f"{name}: act-order checkpoint (g_idx reorders the inputs): AutoAWQ has no input "
                         "permutation to hold it")
    shape = torch.Size([out_features, in_features])
    q = unpack_from_int32(local["weight_packed"], NUM_BITS, shape)
    if "weight_zero_point" in local:
        zeros = unpack_from_int32(local["weight_zero_point"], NUM_BITS, scales.shape, packed_dim=0)
    else:
        zeros = torch.zeros(scales.shape, dtype=torch.int8)

    def unsigned(v: torch.Tensor) -> torch.Tensor:  # compressed-tensors' -8..7 -> our 0..15
        return (v.to(torch.int16) + 8).to(torch.uint8)

    return QuantizedWeight(q=unsigned(q), zeros=unsigned(zeros), scales=scales.to(torch.float16).contiguous(),
                           group_size=group_size)


def convert_checkpoint(source: str | Path, work_dir: str | Path, checkpoint_format: str,
                       overwrite: bool = False) -> ConvertResult:
    """Write the int4 checkpoint ``source`` to ``work_dir`` in ``checkpoint_format`` (CHECKPOINT_FORMATS).

    Raises ValueError naming the problem: an fp checkpoint, a format lmkit cannot write or read, a source already
    in the target format, what the target cannot hold; export.WorkDirError for an unusable ``work_dir``.
    """
    from lmkit.lite.blocks import dense_linears
    from lmkit.models import get_architecture
    from lmkit.models.safetensors_index import index_folder

    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown checkpoint format {checkpoint_format!r}; lmkit writes "
                         f"{', '.join(CHECKPOINT_FORMATS)}")
    source = Path(source).expanduser().absolute()
    config = read_config(source)
    settings = quantization_settings(config)
    if settings is None:
        raise ValueError(f"{source} holds no int4 quantization_config (an fp checkpoint): quantize it with "
                         f"`lmkit lite awq {source} --format {checkpoint_format}`")
    if str(settings.get("format", "")).lower() in CT_NAIVE_FORMATS:
        kind = "FP8" if any(str((g.get("weights") or {}).get("type", "")).lower() == "float"
                            for g in (settings.get("config_groups") or {}).values()) else "int8"
        raise ValueError(f"{source} is an {kind} checkpoint (compressed-tensors {settings['format']}): lmkit converts "
                         f"between its int4 formats only; {kind} stays compressed-tensors, which lmkit serves as it is")
    source_format = checkpoint_format_of(settings)
    if source_format == checkpoint_format:
        raise ValueError(f"{source} is already a {checkpoint_format} checkpoint")
    arch = get_architecture(architecture_of(config, source))
    awq_map = arch.awq_map
    entries = index_folder(source)
    read = tensor_reader(entries)

    # read and repack everything before the work dir is touched: what the target cannot hold fails here
    marker, companions = (".weight_packed", CT_SUFFIXES) if source_format == "compressed-tensors" else (
        ".qweight", AWQ_SUFFIXES[1:])
    tensors: dict[str, torch.Tensor] = {}
    group_sizes: dict[int, str] = {}
    num_linears = 0
    for name in entries:
        if name.endswith(marker):
            num_linears += 1
            base = name[: -len(marker)]
            if source_format == "compressed-tensors":
                local = {s[1:]: read(base + s) for s in (marker, *companions) if base + s in entries}
                qw = unpack_compressed_tensors(local, base)
            else:
                missing = [base + s for s in companions if base + s not in entries]
                if missing:
                    raise ValueError(f"{source}: {name} has no {', '.join(missing)}")
                qw = unpack_awq_gemm(read(name), read(base + ".qzeros"), read(base + ".scales"))
            group_sizes.setdefault(qw.group_size, base)
            tensors.update(export.linear_tensors(base, qw, None, checkpoint_format))
        elif name.endswith(companions):
            if name.rsplit(".", 1)[0] + marker not in entries:
                raise ValueError(f"{source}: {name} has no matching {marker}")
        else:
            tensors[name] = read(name)
    if not group_sizes:
        raise ValueError(f"{source}: config.json says {settings.get('quant_method')} but no {marker} tensors "
                         "were found")
    if len(group_sizes) > 1:
        sizes = ", ".join(f"{g} ({base})" for g, base in sorted(group_sizes.items()))
        raise ValueError(f"{source}: linears with different group sizes ({sizes}): both formats' configs name one")
    group_size = next(iter(group_sizes))
    declared = settings.get("group_size")
    if source_format == "autoawq" and declared not in (None, -1, group_size):
        raise ValueError(f"{source}: config.json says group_size {declared}, the linears have {group_size}")

    temp_dir = export.prepare_work_dir(Path(work_dir), overwrite)
    try:
        export.save_tensors(tensors, temp_dir)
        del tensors
        # compressed-tensors names the Linear modules it leaves dense (`ignore`); AutoAWQ readers go by the tensors
        dense = None
        if checkpoint_format == "compressed-tensors":
            dense = dense_linears(awq_map, arch.unused_tensors)
            dense += [m for m in settings.get("modules_to_not_convert") or [] if m not in dense]
        config["quantization_config"] = export.quantization_config(group_size, dense, checkpoint_format)
        (temp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        export.copy_side_files(source, temp_dir)
        size = export.folder_bytes(temp_dir)
        export.publish(temp_dir, Path(work_dir), {"kind": "convert", "format": checkpoint_format,
                                                  "source_format": source_format, "group_size": group_size,
                                                  "source": str(source)})
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # gone already after a successful publish
    return ConvertResult(work_dir=Path(work_dir).expanduser().absolute(), source=source, source_format=source_format,
                         checkpoint_format=checkpoint_format, group_size=group_size, num_linears=num_linears,
                         size_bytes=size)
