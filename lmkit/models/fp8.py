"""FP8 E4M3 checkpoints -> dense weights for the engine: each FP8 linear (``<role>`` an ``F8_E4M3`` tensor [N, K],
``<role>.scales`` its float scales, lmkit/models/quant_config.py's ``fp8`` layout) is decoded once at load, times
its scales, into the engine's dense weight dtype (BF16 where the CPU backend computes in bfloat16 and on CUDA, else
F32), written to an unlinked temporary file the engine maps like any dense checkpoint. The CPU has no FP8
arithmetic: activations are never quantized to FP8, the model runs as its dequantized float weights.

Scales, by shape (the three granularities compressed-tensors and the vendor form write)::

    per tensor   []  [1]  [1, 1]                       W[n, k] = e4m3(q[n, k]) * s
    per channel  [N]  [N, 1]                           W[n, k] = e4m3(q[n, k]) * s[n]
    per block    [ceil(N / bn), ceil(K / bk)]          W[n, k] = e4m3(q[n, k]) * s[n // bn, k // bk]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from lmkit.models.safetensors_index import TensorEntry

FP8_DTYPE = "F8_E4M3"  # the one FP8 safetensors dtype served
_REFUSED_FP8 = {"F8_E5M2": "FP8 E5M2", "F8_E8M0": "FP8 E8M0", "F8_E4M3FNUZ": "FP8 E4M3FNUZ",
                "F8_E5M2FNUZ": "FP8 E5M2FNUZ"}
_FLOAT_SCALES = ("F32", "F16", "BF16")
_ALIGN_BYTES = 64
_CHUNK_VALUES = 1 << 18  # weights decoded at a time (1 MiB of float32)


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 E4M3 (OCP "fn": bias 7, no infinities, S.1111.111 is NaN) codes."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((codes & 0x7F) == 0x7F, np.nan, sign * value)
    return value.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def _cover(weight_shape: tuple[int, ...], scales_cover: str | tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of weight each scale covers."""
    n, k = weight_shape
    return (n, k) if scales_cover == "tensor" else (1, k) if scales_cover == "channel" else tuple(scales_cover)


def check_fp8_sources(sources: dict[str, TensorEntry], scales_cover: str | tuple[int, int] | None,
                      path: Path) -> None:
    """Checks every FP8 tensor of a checkpoint's role map before anything is read: E4M3 only, only in an FP8
    checkpoint (``scales_cover``: WeightQuant.fp8_scales, None for any other checkpoint), a 2-D weight with float
    scales of the granularity the config declares. Raises ValueError naming the tensor and the fix."""
    for role, entry in sources.items():
        if entry.dtype in _REFUSED_FP8:
            raise ValueError(f"{path}: tensor '{role}' is {_REFUSED_FP8[entry.dtype]} ({entry.dtype}); lmkit serves "
                             f"FP8 E4M3 ({FP8_DTYPE}) weights only")
        if entry.dtype != FP8_DTYPE:
            continue
        if scales_cover is None:
            raise ValueError(f"{path}: tensor '{role}' is {FP8_DTYPE} but config.json has no FP8 quantization_config "
                             "(compressed-tensors 'float-quantized' or quant_method 'fp8')")
        scales = sources.get(f"{role}.scales")
        if scales is None:
            raise ValueError(f"{path}: FP8 tensor '{role}' has no scales (weight_scale / weight_scale_inv)")
        if len(entry.shape) != 2:
            raise ValueError(f"{path}: FP8 tensor '{role}' has shape {list(entry.shape)}; lmkit serves 2-D FP8 "
                             "linear weights")
        if scales.dtype not in _FLOAT_SCALES:
            raise ValueError(f"{path}: the scales of FP8 tensor '{role}' are {scales.dtype}; they must be F32, F16 "
                             "or BF16")
        n, k = entry.shape
        if scales_cover == "tensor":
            ok, want = scales.shape in ((), (1,), (1, 1)), "[1] (per tensor)"
        elif scales_cover == "channel":
            ok, want = scales.shape in ((n,), (n, 1)), f"[{n}, 1] (per output channel)"
        else:
            bn, bk = scales_cover
            want = f"[{-(-n // bn)}, {-(-k // bk)}] (per {bn}x{bk} block)"
            ok = scales.shape == (-(-n // bn), -(-k // bk))
        if not ok:
            raise ValueError(f"{path}: the scales of FP8 tensor '{role}' {list(entry.shape)} have shape "
                             f"{list(scales.shape)}; its quantization_config implies {want}")


def _read(entry: TensorEntry) -> np.ndarray:
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[entry.dtype]
    a = np.fromfile(entry.path, dtype=dtype, count=int(np.prod(entry.shape, dtype=np.int64)), offset=entry.offset)
    if entry.dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False).reshape(entry.shape)


def dequantized_rows(weight: TensorEntry, scales: TensorEntry, scales_cover: str | tuple[int, int],
                     role: str = "", dtype: str = "F32") -> Iterator[np.ndarray]:
    """The [N, K] weight of an FP8 tensor and its scales (shapes checked by check_fp8_sources) in ``dtype`` ("F32":
    float32; "BF16": bfloat16 bits as uint16, rounded to nearest even), in chunks of whole rows (of whole scale
    blocks), so that each chunk's decode, scaling and rounding stay in cache. Raises ValueError on a scale that is
    NaN or infinite or a NaN weight code (a corrupt checkpoint) before the first chunk."""
    s = _read(scales)
    if not np.isfinite(s).all():
        raise ValueError(f"{scales.path}: the scales of FP8 tensor '{role}' hold NaN or infinite values "
                         f"(first at flat index {int(np.flatnonzero(~np.isfinite(s))[0])}): a corrupt checkpoint")
    n, k = weight.shape
    codes = np.memmap(weight.path, dtype=np.uint8, mode="r", offset=weight.offset, shape=(n, k))
    if ((codes & 0x7F) == 0x7F).any():
        raise ValueError(f"{weight.path}: FP8 tensor '{role}' holds NaN codes: a corrupt checkpoint")
    bn, bk = _cover(weight.shape, scales_cover)
    s = s.reshape(-(-n // bn), -(-k // bk))
    if k % bk:  # a partial block of columns at the right edge: scales per column
        s = np.repeat(s, bk, axis=1)[:, :k]
        bk = 1
    step = bn if bn < n else 1  # chunks of whole block rows
    rows = step * max(1, _CHUNK_VALUES // (step * k))
    for r0 in range(0, n, rows):
        chunk = E4M3_VALUES[codes[r0:r0 + rows]]  # float32 [r, K]
        r, sb = chunk.shape[0], s[r0 // bn: -(-(r0 + rows) // bn)]
        if bn >= n:  # one block row
            chunk.reshape(r, -1, bk)[...] *= sb[0][None, :, None]
        else:
            full_rows = r // bn * bn
            if full_rows:
                chunk[:full_rows].reshape(-1, bn, k // bk, bk)[...] *= sb[: full_rows // bn, None, :, None]
            if full_rows < r:
                chunk[full_rows:].reshape(r - full_rows, -1, bk)[...] *= sb[-1][None, :, None]
        if dtype == "BF16":
            u = chunk.view(np.uint32)
            u += 0x7FFF + ((u >> 16) & 1)
            yield (u >> 16).astype(np.uint16)
        else:
            yield chunk


def dequantize(weight: TensorEntry, scales: TensorEntry, scales_cover: str | tuple[int, int],
               role: str = "") -> np.ndarray:
    """The float32 [N, K] weight of an FP8 tensor and its scales (dequantized_rows, whole)."""
    return np.concatenate(list(dequantized_rows(weight, scales, scales_cover, role)))


@contextlib.contextmanager
def dense_sources(sources: dict[str, tuple], entries: dict[str, TensorEntry], scales_cover, dtype: str, where: Path):
    """``sources`` (role -> the engine's (path, offset, dtype, shape)) with every FP8 weight of ``entries`` replaced
    by its dequantized ``dtype`` ("F32" or "BF16") copy (``scales_cover``: WeightQuant.fp8_scales) and its
    ``.scales`` dropped; the copies lie in one temporary file under ``where``, unlinked on exit (the engine keeps its
    mapping). Yields ``sources`` unchanged when there is no FP8 weight."""
    fp8 = [role for role, e in entries.items() if e.dtype == FP8_DTYPE]
    if not fp8:
        yield sources
        return
    where.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="fp8-dequantized-", suffix=".bin", dir=where)
    try:
        out, offsets, end = dict(sources), {}, 0
        for role in fp8:  # the layout first: each tensor's place is known, so the tensors convert in parallel
            end += -end % _ALIGN_BYTES
            offsets[role] = end
            out[role] = (name, end, dtype, list(entries[role].shape))
            out.pop(f"{role}.scales", None)
            end += int(np.prod(entries[role].shape)) * (2 if dtype == "BF16" else 4)
        os.ftruncate(fd, end)

        def convert(role: str) -> None:
            at = offsets[role]
            for chunk in dequantized_rows(entries[role], entries[f"{role}.scales"], scales_cover, role, dtype):
                data = memoryview(np.ascontiguousarray(chunk)).cast("B")
                while data:
                    written = os.pwrite(fd, data, at)
                    data, at = data[written:], at + written

        with ThreadPoolExecutor(max_workers=min(len(os.sched_getaffinity(0)), 16)) as pool:
            for done in [pool.submit(convert, role) for role in fp8]:
                done.result()  # the first corrupt tensor's ValueError
        os.close(fd)
        fd = -1
        yield out
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
