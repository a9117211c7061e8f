"""Writing the AWQ checkpoint folder, atomically.

    work_dir.parent/.<name>.tmp-XXXX/      everything is written here first
        model.safetensors (or shards + model.safetensors.index.json)
            <linear>.qweight int32 [in, out/8], .qzeros int32 [in/g, out/8], .scales fp16 [in/g, out], .bias fp16
            every other tensor fp16 (norm weights with the smoothing scales folded in, embeddings, ...)
        config.json            + quantization_config {quant_method: awq, version: gemm, bits: 4, group_size, zero_point}
        tokenizer / generation config / chat template   copied from the source
        awq/search.safetensors  search results: scales/<layer>.<prev> [in], clip/<linear>.min|max [out, in/g]
        awq/report.json         settings, per-group exponents and losses, timings, sizes, perplexities
                                (in a subfolder, so weight readers that glob *.safetensors never see them)
        .lmkit-complete         written last
    -> renamed to work_dir
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lmkit.lite.quantizer import NUM_BITS, QuantizedWeight, pack_awq_gemm

COMPLETE_MARKER = ".lmkit-complete"  # the name lmkit.model_path uses for finished folders
SEARCH_DIR = "awq"
SEARCH_FILE = "search.safetensors"
REPORT_FILE = "report.json"
_SKIP_COPY = {"config.json", "model.safetensors.index.json", COMPLETE_MARKER}
MAX_SHARD_BYTES = 4 * 2**30


class WorkDirError(ValueError):
    """The output folder cannot be used (exists and is not empty, or is not writable)."""


def quantization_config(group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """The ``quantization_config`` entry of an AutoAWQ GEMM checkpoint."""
    config = {"quant_method": "awq", "version": "gemm", "bits": NUM_BITS, "group_size": group_size,
              "zero_point": True}
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return config


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


def linear_tensors(name: str, qw: QuantizedWeight, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one quantized linear ``name`` (without the ``.weight`` suffix)."""
    tensors = {f"{name}.{key}": value for key, value in pack_awq_gemm(qw).items()}
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
                        report: dict) -> None:
    """awq/search.safetensors (plain tensors keyed by module name) and awq/report.json."""
    from safetensors.torch import save_file

    folder = folder / SEARCH_DIR
    folder.mkdir(exist_ok=True)
    tensors = {f"scales/{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in scales.items()}
    tensors.update({f"clip/{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in clips.items()})
    if tensors:
        save_file(tensors, str(folder / SEARCH_FILE), metadata={"format": "pt"})
    (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def folder_bytes(folder: Path) -> int:
    """Bytes of the safetensors files of ``folder`` (the weights)."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
