"""Embeddings from a decoder model: the engine computes a prompt without generating and pools its final hidden
states (after the model's final norm) into one vector (SamplingParams.pooling: the last token's, the mean over
the tokens, or the first token's); the vector is then L2-normalized or not.

How a model pools is what its sentence-transformers files say (``modules.json``, the Pooling module's
``config.json``, a Normalize module): Qwen3-Embedding is a Qwen3 model whose files say last-token pooling,
normalized. A model without them pools its last token and normalizes, as vLLM does for a causal LM it embeds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POOLINGS = ("last", "mean", "first")
"""The poolings the engine computes."""

# sentence-transformers' Pooling config.json field -> lmkit's pooling
_ST_POOLING_FIELDS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                      "pooling_mode_cls_token": "first"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class PoolingConfigError(ValueError):
    """A model's sentence-transformers files ask for what lmkit does not compute."""


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    """last | mean | first: which final hidden states make the vector."""
    normalize: bool = True
    """Whether the vector is scaled to unit L2 norm."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise PoolingConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    @classmethod
    def of_model(cls, folder: str | Path | None) -> "PoolingConfig":
        """The pooling ``folder``'s sentence-transformers files describe (modules.json: a Pooling module, a
        Normalize module), else last-token pooling, normalized. Raises PoolingConfigError for a module or a
        pooling mode lmkit does not compute (Dense layers, max or weighted-mean pooling)."""
        modules_file = Path(folder) / "modules.json" if folder is not None and Path(folder).is_dir() else None
        if modules_file is None or not modules_file.is_file():
            return cls()
        try:
            modules = json.loads(modules_file.read_text())
            kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PoolingConfigError(f"{modules_file} is not a sentence-transformers modules list: {e}") from None
        other = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if other:
            raise PoolingConfigError(f"{modules_file} has modules lmkit does not run: {', '.join(other)}")
        pooling = "last"
        if "Pooling" in kinds:
            config_file = Path(folder) / kinds["Pooling"] / "config.json"
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as e:
                raise PoolingConfigError(f"cannot read the Pooling module's {config_file}: {e}") from None
            unsupported = [name for name in _ST_UNSUPPORTED if config.get(name)]
            modes = [mode for name, mode in _ST_POOLING_FIELDS.items() if config.get(name)]
            if unsupported or len(modes) != 1:
                raise PoolingConfigError(f"{config_file} asks for {', '.join(unsupported) or modes or 'no pooling'}; "
                                         f"lmkit pools one of: {', '.join(_ST_POOLING_FIELDS)}")
            pooling = modes[0]
        return cls(pooling=pooling, normalize="Normalize" in kinds)

    def finish(self, vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
        """The engine's pooled vector as returned: its first ``dimensions`` values (Matryoshka), then
        normalized when the model normalizes (a zero vector stays zero)."""
        v = np.asarray(vector, dtype=np.float32)[:dimensions]
        if self.normalize:
            norm = float(np.linalg.norm(v.astype(np.float64)))
            if norm > 0:
                v = (v / norm).astype(np.float32)
        return v
