"""HF folder -> ModelSpec: the engine's model config (shape, rope, sliding window), the weight
source of every engine role, the eos ids and the model's generation defaults. Reads JSON and safetensors
headers only."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmkit.models.registry import Architecture, get_architecture
from lmkit.models.safetensors_index import TensorEntry, index_folder


@dataclass
class ModelSpec:
    """Everything the C++ engine needs to load a model folder."""

    path: Path
    architecture: Architecture
    config: dict  # config.json as read
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    inv_freq: np.ndarray  # float32 [head_dim / 2], scaling applied
    attention_scaling: float
    sliding_window: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: list[int]
    awq_group_size: int = 0  # > 0: an AWQ int4 checkpoint
    generation_defaults: dict = field(default_factory=dict)
    """GenerationConfig fields the model's generation_config.json sets (see read_generation_defaults)."""
    sources: dict[str, TensorEntry] = field(repr=False, default_factory=dict)

    def generation_config(self, **overrides):
        """A GenerationConfig of this model's generation_defaults with ``overrides`` (GenerationConfig fields) on
        top. An override of None keeps the model's value, so that unset CLI options and request fields pass
        through as they come. temperature=0 means greedy; a temperature > 0 given without do_sample turns
        sampling on. Raises ValueError (GenerationConfigError) naming a field whose value is invalid."""
        from lmkit.messages import GenerationConfig

        given = {name: value for name, value in overrides.items() if value is not None}
        if "temperature" in given and "do_sample" not in given:
            given["do_sample"] = given["temperature"] > 0
        merged = {**self.generation_defaults, **given}
        if merged.get("temperature") == 0:  # "greedy", as OpenAI and transformers read it
            merged.update(do_sample=False, temperature=1.0)
        return GenerationConfig(**merged)

    def to_engine_config(self):
        """The lmkit._engine.ModelConfig for this spec."""
        from lmkit import _engine

        c = _engine.ModelConfig()
        c.architecture = self.architecture.name
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "rms_norm_eps", "attention_scaling", "sliding_window", "tie_word_embeddings",
                     "max_position_embeddings", "awq_group_size"):
            setattr(c, name, getattr(self, name))
        c.inv_freq = [float(x) for x in self.inv_freq]
        c.has_qkv_bias = self.architecture.qkv_bias
        return c


def _rope_parameters(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict with 'rope_type') across transformers 4.x and 5.x config layouts."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    # transformers 5 reads rope_parameters first; a top-level rope_theta is the 4.x layout. Tools on 4.x that
    # re-save a 5.x config (AutoAWQ) write their default 10000 there beside the real value in rope_parameters.
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default"))
    return float(theta), merged


def compute_inv_freq(cfg: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """Rotary inverse frequencies and attention scaling, as transformers computes them (fp32)."""
    theta, scaling = _rope_parameters(cfg)
    rope_type = scaling["rope_type"]
    dim = int(head_dim * float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))
    if dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rotary dim {dim} of head_dim {head_dim}) are not supported")
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32), 1.0
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


# the generation_config.json keys read as a model's generation defaults (transformers' names = GenerationConfig's)
GENERATION_DEFAULT_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                             "max_new_tokens")


def read_generation_defaults(path: Path, cfg: dict | None = None, gen: dict | None = None) -> dict:
    """GenerationConfig fields a model folder sets: the GENERATION_DEFAULT_FIELDS its generation_config.json holds
    (not null), or, without that file, those in config.json (transformers' fallback; ``cfg`` and ``gen`` are
    config.json and generation_config.json when already read). Keys left out keep GenerationConfig's defaults (greedy; do_sample false unless set, as in
    transformers); max_new_tokens counts only when set explicitly (max_length is not read).

    Raises ValueError naming the file when a value is not one GenerationConfig accepts.
    """
    from lmkit.messages import GenerationConfig

    gen_path = path / "generation_config.json"
    source = gen_path if gen_path.exists() else path / "config.json"
    if gen_path.exists():
        data = gen if gen is not None else _read_json(gen_path)
    else:
        data = cfg if cfg is not None else _read_json(source)
    defaults = {name: data[name] for name in GENERATION_DEFAULT_FIELDS if data.get(name) is not None}
    if defaults.get("temperature") == 0:  # transformers: 0 is not a temperature; greedy is what it means
        defaults.pop("temperature")
        defaults["do_sample"] = False
    try:
        GenerationConfig(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: a generation default is invalid: {e}") from None
    return defaults


AWQ_GROUP_SIZES = (32, 64, 128)


def awq_settings(cfg: dict, cfg_path: Path) -> dict | None:
    """The checked ``quantization_config`` of an AWQ "GEMM" checkpoint (None for a float one).

    Raises ValueError naming the field this engine cannot serve (method, version, bits, zero_point,
    group_size, desc_act).
    """
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    where = f"{cfg_path}: quantization_config"
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; "
                         "this engine serves AWQ int4 checkpoints (quant_method 'awq')")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}.version={qc.get('version')!r} is not supported; only AutoAWQ 'gemm' packing is")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits is None or int(bits) != 4:
        raise ValueError(f"{where}.bits={bits!r} is not supported; AWQ checkpoints must be 4-bit")
    if not qc.get("zero_point", True):
        raise ValueError(f"{where}.zero_point=false is not supported; lmkit serves asymmetric AWQ (zero_point true)")
    if qc.get("desc_act"):
        raise ValueError(f"{where}.desc_act=true (act-order) is not supported by AWQ GEMM kernels")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group is None or int(group) not in AWQ_GROUP_SIZES:
        raise ValueError(f"{where}.group_size={group!r} is not supported; use one of {AWQ_GROUP_SIZES}")
    return {"group_size": int(group), "modules_to_not_convert": list(qc.get("modules_to_not_convert") or [])}


def load_model_spec(path: Path) -> ModelSpec:
    """Reads config.json, generation_config.json and the safetensors headers of an HF folder.

    Raises FileNotFoundError / ValueError naming the file or field when the folder cannot be served.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model folder?)")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{cfg_path}: no 'architectures' entry; cannot tell which model this is")
    arch = get_architecture(archs[0])
    awq = awq_settings(cfg, cfg_path)

    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inv_freq, attention_scaling = compute_inv_freq(cfg, head_dim)
    sliding = 0
    if arch.uses_sliding_window == "always" or (
        arch.uses_sliding_window == "if_use_sliding_window" and cfg.get("use_sliding_window")
    ):
        sliding = int(cfg.get("sliding_window") or 0)
    if arch.uses_sliding_window == "if_use_sliding_window" and sliding:
        raise ValueError(f"{cfg_path}: Qwen2 per-layer sliding window attention is not supported yet")

    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else None
    if gen is not None:
        eos += [t for t in _as_id_list(gen.get("eos_token_id")) if t not in eos]
    generation_defaults = read_generation_defaults(path, cfg, gen)

    tensors = index_folder(path)
    num_layers = int(cfg["num_hidden_layers"])
    sources: dict[str, TensorEntry] = {}
    for role, key in arch.key_map.items():
        for i in range(num_layers) if "{i}" in role else [None]:
            r, k = (role, key) if i is None else (role.format(i=i), key.format(i=i))
            if k in tensors:
                sources[r] = tensors[k]
            elif awq and k.endswith(".weight") and k[: -len("weight")] + "qweight" in tensors:
                base = k[: -len("weight")]
                for part in ("qweight", "qzeros", "scales"):
                    if base + part not in tensors:
                        raise ValueError(f"{path}: AWQ layer {base[:-1]} has qweight but no {part}")
                    sources[f"{r}.{part}"] = tensors[base + part]
    tie = bool(cfg.get("tie_word_embeddings", False))
    if tie:
        sources.pop("lm_head", None)  # HF uses the embedding even when a copy was saved
    return ModelSpec(
        path=path,
        architecture=arch,
        config=cfg,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
        sliding_window=sliding,
        tie_word_embeddings=tie,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=eos,
        awq_group_size=awq["group_size"] if awq else 0,
        generation_defaults=generation_defaults,
        sources=sources,
    )
