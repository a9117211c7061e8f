"""kv_policy.json: the per-layer KV cache precision of one model, written by ``lmkit lite calibrate`` and
read by the engine (``EngineConfig(kv_policy=PATH)``).

The file::

    {
      "format": "lmkit.kv_policy", "version": 1,
      "model": {"architecture": "LlamaForCausalLM", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
      "layers": [8, 4, 4, ...],            # per decoder layer: 0 fp, 8 int8, 4 int4 (the only field the engine uses)
      ...                                  # anything else: what the policy was chosen from (statistics, perplexity)
    }

KV quantization (engine and calibration agree on it bit for bit): per token and KV head, asymmetric over
head_dim, K after RoPE. ``scale = fp16((max - min) / (2**bits - 1))``, ``zero = fp16(min)``,
``q = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)`` (q = 0 where scale == 0),
dequantized ``q * scale + zero`` in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "lmkit.kv_policy"
VERSION = 1
KV_BITS = (0, 8, 4)  # 0: fp (no quantization)


def save_kv_policy(path: str | Path, layers: list[int], model: dict[str, Any], **extra: Any) -> Path:
    """Writes a policy file. ``model`` needs architecture, num_layers, num_kv_heads, head_dim."""
    for key in ("architecture", "num_layers", "num_kv_heads", "head_dim"):
        if key not in model:
            raise ValueError(f"kv policy: model description lacks {key!r}")
    _check_layers(layers, int(model["num_layers"]), str(path))
    doc = {"format": FORMAT, "version": VERSION, "model": dict(model), "layers": [int(b) for b in layers], **extra}
    path = Path(path)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def load_kv_policy(path: str | Path, num_layers: int | None = None, num_kv_heads: int | None = None,
                   head_dim: int | None = None) -> list[int]:
    """The per-layer bits of a policy file, checked against the model when its shape is given.

    Raises FileNotFoundError, or ValueError naming the field that is wrong (a policy for another model
    is rejected by its layer count, KV heads or head_dim).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"kv_policy file {path} does not exist")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_policy file {path}: invalid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"kv_policy file {path}: 'format' must be {FORMAT!r} (write it with `lmkit lite calibrate`)")
    if doc.get("version") != VERSION:
        raise ValueError(f"kv_policy file {path}: unsupported version {doc.get('version')!r}; this build reads {VERSION}")
    layers = doc.get("layers")
    model = doc.get("model") or {}
    expect = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for key, want in expect.items():
        if want is not None and key in model and int(model[key]) != int(want):
            raise ValueError(f"kv_policy file {path} was calibrated for a model with {key}={model[key]}, "
                             f"this model has {key}={want}")
    _check_layers(layers, num_layers, str(path))
    return [int(b) for b in layers]


def _check_layers(layers: Any, num_layers: int | None, where: str) -> None:
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"kv_policy {where}: 'layers' must be a non-empty list of 0, 8 or 4 per layer")
    bad = [b for b in layers if not isinstance(b, int) or isinstance(b, bool) or b not in KV_BITS]
    if bad:
        raise ValueError(f"kv_policy {where}: 'layers' entries must be 0 (fp), 8 or 4, got {bad[0]!r}")
    if num_layers is not None and len(layers) != num_layers:
        raise ValueError(f"kv_policy {where}: has {len(layers)} layers, the model has {num_layers}")
