"""Reads safetensors headers (no tensor data) and checks them, so a corrupt or truncated file is
refused with a message naming it before the engine maps anything."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1,  # FP8: E4M3 served, E5M2 refused by name (lmkit/models/fp8.py)
                "F8_E8M0": 1}  # MXFP4's scales (lmkit/models/loader.py), refused as weights (fp8.py)
# GGUF block types the engine runs (lmkit/models/gguf_file.py): values per block, bytes per block
BLOCK_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "MXFP4": (32, 17)}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: absolute ``offset`` in ``path``."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor as stored (block types: whole blocks)."""
        numel = 1
        for d in self.shape:
            numel *= d
        if self.dtype in BLOCK_TYPES:
            values, size = BLOCK_TYPES[self.dtype]
            return numel // values * size
        return numel * _DTYPE_BYTES[self.dtype]

    def as_source(self) -> tuple:
        """The (path, offset, dtype, shape) tuple lmkit._engine.Engine takes."""
        return (self.path, self.offset, self.dtype, list(self.shape))


class CorruptCheckpointError(ValueError):
    """A safetensors file whose header or size does not hold together."""


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Tensor name -> entry for one file. Raises CorruptCheckpointError naming the file and the fault."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptCheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len == 0 or header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CorruptCheckpointError(
                f"{path}: corrupt safetensors header (declares {header_len} header bytes in a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _DTYPE_BYTES:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * _DTYPE_BYTES[dtype] or begin < 0:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} of shape {list(shape)} {dtype} spans bytes [{begin}, {end}), "
                f"which does not match its size"
            )
        if data_start + end > size:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes "
                "(truncated download?)"
            )
        entries[name] = TensorEntry(str(path), data_start + begin, dtype, shape)
    return entries


def index_folder(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint folder: sharded (model.safetensors.index.json) or not."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        shard = folder / name
        if not shard.exists():
            raise FileNotFoundError(f"{folder}: shard {name} listed in the index is missing")
        entries.update(read_header(shard))
    return entries
