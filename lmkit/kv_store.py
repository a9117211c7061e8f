"""The disk store's identity: what the K/V bytes of a block depend on besides the layout the engine knows.

The C++ store (csrc/engine/kv_store.h) names every file by this identity (hashed with the block size, the bytes per
block and its format version) and checks it in the file's header, so a store directory shared by several models,
tokenizers, dtypes or KV policies never serves one's blocks to another. Blocks are keyed by token ids, so the
tokenizer is part of it; the K/V values depend on the weights and on every setting that changes the arithmetic
that computed them (compute dtype, int8 activations, the KV precision per layer, the CPU's kernel ISA, lmkit's
version).

The weights are identified without reading them whole: each weight file's name, size and modification time, its
first and last 64 KiB (a safetensors or GGUF header names every tensor with its shape and offset) and 16 samples
of 4 KiB spread over it. A checkpoint rewritten in place gets a new identity (its files' times change, and a
whole new set of weights changes every sample too); a folder copied without keeping times starts a store of its
own. A restart on the same files keeps the identity: that is what the store is for.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_HEAD_BYTES = 64 * 1024
_SAMPLE_BYTES = 4 * 1024
_NUM_SAMPLES = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")


def file_fingerprint(path: Path, h) -> None:
    """Feeds path's name, size, modification time, head, tail and evenly spread samples into hash h."""
    st = path.stat()
    size = st.st_size
    h.update(f"{path.name}:{size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        if size > 2 * _HEAD_BYTES:
            for i in range(1, _NUM_SAMPLES + 1):
                f.seek(size * i // (_NUM_SAMPLES + 2))
                h.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _HEAD_BYTES)
            h.update(f.read(_HEAD_BYTES))


def store_identity(spec, config, device: str, kv_layer_bits: list[int] | None, cpu_isa: str) -> str:
    """A hex digest of the model (config.json, the weight files' fingerprints, the tokenizer files) and the
    settings that change the K/V bytes (spec: lmkit.models.loader.ModelSpec; config: lmkit.EngineConfig)."""
    from lmkit import __version__

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(spec.config, sort_keys=True).encode())
    files = sorted({Path(entry.path) for entry in spec.sources.values()} | ({Path(spec.gguf)} if spec.gguf else set()))
    for path in files:
        file_fingerprint(path, h)
    folder = Path(spec.path)
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(name.encode())
            h.update((folder / name).read_bytes())
    bits = list(kv_layer_bits) if kv_layer_bits else [config.quant_policy] * spec.num_layers
    settings = dict(device=device, dtype=config.resolved_dtype(device), int8_activations=bool(config.int8_activations),
                    quantization=config.quantization, kv_layer_bits=bits, kv_bf16=config.resolved_kv_bf16(device),
                    cpu_isa=cpu_isa, lmkit=__version__,
                    num_layers=spec.num_layers, mtp_layer=config.speculative == "mtp")  # the MTP head's K/V in blocks
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def store_file_count(directory: str | os.PathLike) -> int:
    """The block files in a store directory (every identity's)."""
    return sum(1 for p in Path(directory).glob("*.kvb"))
