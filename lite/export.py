"""Writing a quantized checkpoint folder, atomically: int4 in one of two formats (CHECKPOINT_FORMATS), or
SmoothQuant W8A8 int8 as compressed-tensors int-quantized (``int8_linear_tensors``):

    work_dir.parent/.<name>.tmp-XXXX/      everything is written here first
        model.safetensors (or shards + model.safetensors.index.json)
            autoawq:            <linear>.qweight int32 [in, out/8], .qzeros int32 [in/g, out/8], .scales fp16 [in/g, out]
            compressed-tensors: <linear>.weight_packed int32 [out, in/8], .weight_zero_point int32 [out/8, in/g],
                                .weight_scale fp16 [out, in/g], .weight_shape int64 [2] (llm-compressor's
                                pack-quantized W4A16 asymmetric, packed by compressed-tensors' own pack_to_int32)
            W8A8:               <linear>.weight int8 [out, in], .weight_scale fp16 [out, 1] (IntQuantizationCompressor's)
            <linear>.bias fp16; every other tensor fp16 (norm weights with the smoothing scales folded in, ...)
        config.json            + quantization_config: {quant_method: awq, version: gemm, bits: 4, group_size,
                               zero_point} or compressed-tensors' QuantizationConfig (one scheme, targets Linear)
        tokenizer / generation config / chat template   copied from the source
        awq/search.safetensors  search results: scales/<layer>.<prev> [in], clip/<linear>.min|max [out, in/g]
                                (the clipped ranges of the weight rounded: with an fp-model target, W + W B)
        awq/report.json         settings, per-group exponents and losses, timings, sizes, perplexities
                                (in a subfolder, so weight readers that glob *.safetensors never see them)
                                (``lite smooth_quant``: smooth_quant/, the scales and the report)
        .lmkit-complete         written last
    -> renamed to work_dir
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lmkit.lite.config import CHECKPOINT_FORMATS  # noqa: F401  (re-exported: the formats written here)
from lmkit.lite.int8 import NUM_BITS as INT8_BITS
from lmkit.lite.int8 import Int8Weight
from lmkit.lite.quantizer import NUM_BITS, QuantizedWeight, pack_awq_gemm

COMPLETE_MARKER = ".lmkit-complete"  # the name lmkit.model_path uses for finished folders
SEARCH_DIR = "awq"
SEARCH_FILE = "search.safetensors"
REPORT_FILE = "report.json"
_SKIP_COPY = {"config.json", "model.safetensors.index.json", COMPLETE_MARKER}
MAX_SHARD_BYTES = 4 * 2**30


class WorkDirError(ValueError):
    """The output folder cannot be used (exists and is not empty, or is not writable)."""


def quantization_config(group_size: int, modules_to_not_convert: list[str] | None = None,
                        checkpoint_format: str = "autoawq") -> dict:
    """The ``quantization_config`` entry of an int4 checkpoint (asymmetric, ``group_size`` inputs per group) in
    ``checkpoint_format``; ``modules_to_not_convert``: linears left in fp16 (compressed-tensors' ``ignore``:
    names, or "re:" patterns)."""
    if checkpoint_format == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig(config_groups={"group_0": _ct_scheme(group_size)}, format="pack-quantized",
                                    quantization_status="compressed",
                                    ignore=list(modules_to_not_convert or [])).model_dump()
        config["quant_method"] = "compressed-tensors"
        return config
    config = {"quant_method": "awq", "version": "gemm", "bits": NUM_BITS, "group_size": group_size,
              "zero_point": True}
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return config


def w8a8_quantization_config(modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` of a SmoothQuant W8A8 checkpoint: compressed-tensors ``int-quantized``, int8
    symmetric weights per output channel and int8 symmetric dynamic per-token input activations (llm-compressor's
    W8A8 preset), ``modules_to_not_convert`` in its ``ignore`` list."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=INT8_BITS, type="int", symmetric=True, strategy="channel"),
        input_activations=QuantizationArgs(num_bits=INT8_BITS, type="int", symmetric=True, strategy="token",
                                           dynamic=True))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized",
                                quantization_status="compressed", ignore=list(modules_to_not_convert)).model_dump()
    config["quant_method"] = "compressed-tensors"
    return config


def _ct_scheme(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=NUM_BITS, type="int", symmetric=False, strategy="group", group_size=group_size))


def pack_compressed_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors of one int4 weight (local names). Its signed values are ours
    minus 8 (q - 8 and zero - 8: the same (q - zero) * scale); compressed-tensors' pack_to_int32 packs them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = (qw.q.to(torch.int16) - 8).to(torch.int8)
    zeros = (qw.zeros.to(torch.int16) - 8).to(torch.int8)
    return {"weight_packed": pack_to_int32(q, NUM_BITS),
            "weight_zero_point": pack_to_int32(zeros, NUM_BITS, packed_dim=0).contiguous(),
            "weight_scale": qw.scales.to(torch.float16).contiguous(),
            "weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64)}


def prepare_work_dir(work_dir: Path, overwrite: bool) -> Path:
    """Check ``work_dir`` and create the temp folder beside it; return the temp folder.

    Raises WorkDirError when ``work_dir`` is a non-empty folder (and not ``overwrite``), a file, or its
    parent cannot be created or written.
    """
    work_dir = Path(work_dir).expanduser().absolute()
    if work_dir.exists() and not work_dir.is_dir():
        raise WorkDirError(f"work dir {work_dir} exists and is not a folder")
    if work_dir.is_dir() and any(work_dir.iterdir()) and not overwrite:
        raise WorkDirError(f"work dir {work_dir} exists and is not empty (pass --overwrite to replace it)")
    try:
        work_dir.parent.mkdir(parents=True, exist_ok=True)
        for stale in work_dir.parent.glob(f".{work_dir.name}.tmp-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".{work_dir.name}.tmp-", dir=work_dir.parent))
    except OSError as e:
        raise WorkDirError(f"cannot write the work dir {work_dir}: {e.strerror or e}") from None


def publish(temp_dir: Path, work_dir: Path, marker: dict) -> None:
    """Write the completion marker last, then move ``temp_dir`` to ``work_dir`` (replacing it)."""
    work_dir = Path(work_dir).expanduser().absolute()
    for path in (temp_dir, *temp_dir.rglob("*")):  # mkdtemp and safetensors create owner-only modes
        path.chmod(0o755 if path.is_dir() else 0o644)
    (temp_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if work_dir.exists():
        shutil.rmtree(work_dir)
    os.replace(temp_dir, work_dir)


def linear_tensors(name: str, qw: QuantizedWeight, bias: torch.Tensor | None,
                   checkpoint_format: str = "autoawq") -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one quantized linear ``name`` (without the ``.weight`` suffix), on the host
    whichever device quantized it."""
    qw = dataclasses.replace(qw, q=qw.q.cpu(), zeros=qw.zeros.cpu(), scales=qw.scales.cpu())
    packed = pack_compressed_tensors(qw) if checkpoint_format == "compressed-tensors" else pack_awq_gemm(qw)
    tensors = {f"{name}.{key}": value for key, value in packed.items()}
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to("cpu", torch.float16)
    return tensors


def int8_linear_tensors(name: str, qw: Int8Weight, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one W8A8 linear ``name`` (without ``.weight``), on the host: what compressed-tensors'
    IntQuantizationCompressor writes for a symmetric per-channel int8 weight."""
    tensors = {f"{name}.weight": qw.q.to("cpu", torch.int8).contiguous(),
               f"{name}.weight_scale": qw.scales.to("cpu", torch.float16).reshape(-1, 1).contiguous()}
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to("cpu", torch.float16)
    return tensors


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Save as model.safetensors, or as shards with an index when larger than ``max_shard_bytes``."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, str(folder / file), metadata=metadata)
        weight_map.update({n: file for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def copy_side_files(source: Path, folder: Path) -> None:
    """Copy tokenizer, generation config, chat template and other non-weight files of the source."""
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _SKIP_COPY:
            shutil.copy2(path, folder / path.name)


def write_config(source: Path, folder: Path, quant_config: dict) -> None:
    """config.json of the source with ``quantization_config`` added and dtype float16."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quant_config
    config["dtype"] = "float16"
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_search_results(folder: Path, scales: dict[str, torch.Tensor], clips: dict[str, torch.Tensor],
                        report: dict, subfolder: str = SEARCH_DIR) -> None:
    """<subfolder>/search.safetensors (plain tensors keyed by module name) and <subfolder>/report.json."""
    from safetensors.torch import save_file

    folder = folder / subfolder
    folder.mkdir(exist_ok=True)
    tensors = {f"scales/{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in scales.items()}
    tensors.update({f"clip/{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in clips.items()})
    if tensors:
        save_file(tensors, str(folder / SEARCH_FILE), metadata={"format": "pt"})
    (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def folder_bytes(folder: Path) -> int:
    """Bytes of the safetensors files of ``folder`` (the weights)."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
