"""Rotary tables from config.json, as transformers 5 computes them (fp32): the standardized rope parameters
of one table, then its inverse frequencies [rotary_dim / 2] and attention scaling (the factor HF multiplies
cos and sin by).

Numerics follow transformers' torch code op by op in float32; the powers ``base ** (2j / dim)`` are rounded
from float64 (torch's vectorised float32 pow is within one ulp of that, not always equal to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# rope types whose pretraining length HF reads from original_max_position_embeddings
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeTable:
    """One rotary table. ``inv_freq_long`` (longrope only) replaces ``inv_freq`` in sessions longer than
    ``original_max_position_embeddings`` tokens; see ``for_session``."""

    inv_freq: np.ndarray  # float32 [rotary_dim / 2]
    attention_scaling: float
    inv_freq_long: np.ndarray | None = None  # float32 [rotary_dim / 2]
    original_max_position_embeddings: int = 0

    def for_session(self, session_len: int | None) -> np.ndarray:
        """The inverse frequencies the engine uses for sessions of ``session_len`` tokens. HF switches longrope's
        factors by the current sequence length; lmkit (as llama.cpp) chooses once: the long factors when the
        session may exceed the pretraining length, else (and for None) the short ones."""
        if self.inv_freq_long is not None and session_len is not None and \
                session_len > self.original_max_position_embeddings:
            return self.inv_freq_long
        return self.inv_freq


def standard_rope_parameters(params: dict | None, cfg: dict, default_theta: float, nested: bool = False) -> dict:
    """One table's rope parameters as transformers 5 standardizes them: ``params`` (the table's dict from
    rope_scaling / rope_parameters) completed with rope_theta (config's top-level value, else ``default_theta``),
    partial_rotary_factor, rope_type (legacy "type"), and for llama3/yarn/longrope the pretraining length: a
    top-level original_max_position_embeddings (a config field of Phi-3) wins over the dict's, which wins over
    max_position_embeddings. ``nested``: ``params`` is one layer type's dict (HF then ignores the top level's
    rope_theta and original_max_position_embeddings)."""
    p = dict(params or {})
    p.setdefault("rope_theta", default_theta if nested else cfg.get("rope_theta", default_theta))
    if cfg.get("partial_rotary_factor") is not None:
        p.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    p.setdefault("rope_type", p.get("type", "default"))
    if p["rope_type"] in _NEEDS_ORIGINAL_MAX:
        if not nested and cfg.get("original_max_position_embeddings") is not None:
            p["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            p.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return p


def rotary_dim_of(params: dict, head_dim: int) -> int:
    """int(head_dim * partial_rotary_factor), as HF; ValueError unless even and within the head. Proportional
    RoPE (Gemma 4) spans the whole head: its unrotated part has zero frequencies."""
    if params.get("rope_type") == "proportional":
        return head_dim
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor={params.get('partial_rotary_factor')!r} gives rotary dim {dim} of "
                         f"head_dim {head_dim}; it must be even and in (0, head_dim]")
    return dim


def _powers(base: float, dim: int) -> np.ndarray:
    """float32 base ** (arange(0, dim, 2) / dim): exponents in float32, the power rounded from float64."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.float64(np.float32(base)) ** exponents.astype(np.float64)
    return powers.astype(np.float32)


def _recip(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / x).astype(np.float32)


def rope_table(params: dict, head_dim: int, max_position_embeddings: int) -> RopeTable:
    """The table of one standardized parameter dict (see standard_rope_parameters). ValueError naming the
    rope type when it is not one of SUPPORTED_ROPE_TYPES ("dynamic" rescales with the sequence length).
    ``freq_factors`` (a GGUF file's rope_freqs tensor, llama.cpp's form of Llama 3's scaling): one divisor per
    rotary angle, applied to the table of the rope type as llama.cpp applies it."""
    table = _rope_type_table(params, head_dim, max_position_embeddings)
    factors = params.get("freq_factors")
    if factors is None:
        return table
    factors = np.asarray(factors, dtype=np.float32)
    if factors.shape != table.inv_freq.shape or not np.all(np.isfinite(factors) & (factors > 0)):
        raise ValueError(f"freq_factors has {factors.size} entries (finite, > 0 each); the rotary dim needs "
                         f"{table.inv_freq.size}")
    return replace(table, inv_freq=(table.inv_freq / factors).astype(np.float32),
                   inv_freq_long=None if table.inv_freq_long is None else
                   (table.inv_freq_long / factors).astype(np.float32))


def _rope_type_table(params: dict, head_dim: int, max_position_embeddings: int) -> RopeTable:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    dim = rotary_dim_of(params, head_dim)
    base = float(params["rope_theta"])
    inv_freq = _recip(_powers(base, dim))
    f32 = np.float32
    if rope_type == "default":
        return RopeTable(inv_freq, 1.0)
    if rope_type == "linear":
        return RopeTable((inv_freq / f32(params["factor"])).astype(f32), 1.0)
    if rope_type == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = (_recip(inv_freq) * f32(2 * math.pi)).astype(f32)  # torch: scalar / t == reciprocal(t) * scalar
        scaled = np.where(wavelen > f32(low_wavelen), (inv_freq / f32(factor)).astype(f32), inv_freq)
        smooth = ((_recip(wavelen) * f32(old_ctx) - f32(low)) / f32(high - low)).astype(f32)
        smoothed = ((f32(1) - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
        is_medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
        return RopeTable(np.where(is_medium, smoothed, scaled).astype(f32), 1.0)
    if rope_type == "proportional":  # the first partial_rotary_factor of the head's angles rotate, the rest do not
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)  # (dim is head_dim here)
        table = np.concatenate([inv_freq[:angles], np.zeros(head_dim // 2 - angles, dtype=f32)])
        return RopeTable((table / f32(params.get("factor", 1.0))).astype(f32), 1.0)
    if rope_type == "yarn":
        return _yarn(params, dim, base, max_position_embeddings)
    return _longrope(params, dim, base, max_position_embeddings)


def _yarn(params: dict, dim: int, base: float, max_position_embeddings: int) -> RopeTable:
    f32 = np.float32
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation_factor = (f32(1) - ramp).astype(f32)
    pos_freqs = _powers(base, dim)
    extrapolation = _recip(pos_freqs)
    interpolation = _recip((f32(factor) * pos_freqs).astype(f32))
    inv_freq = (interpolation * (f32(1) - extrapolation_factor) + extrapolation * extrapolation_factor).astype(f32)
    return RopeTable(inv_freq, float(attention_factor))


def _longrope(params: dict, dim: int, base: float, max_position_embeddings: int) -> RopeTable:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    powers = _powers(base, dim)

    def table(name: str) -> np.ndarray:
        factors = np.asarray(params[name], dtype=np.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(f"rope {name} has {factors.size} entries; rotary dim {dim} needs {dim // 2}")
        return _recip((factors * powers).astype(np.float32))

    return RopeTable(table("short_factor"), float(attention_factor), table("long_factor"), original)
