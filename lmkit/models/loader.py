"""HF folder -> ModelSpec: the engine's model config (shape, norms, rope tables, per-layer windows and rope), the
weight source of every engine role, the eos ids and the model's generation defaults. Reads JSON and
safetensors headers only; what depends on the architecture comes from its module (lmkit/models/<arch>.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from lmkit.models import gguf_file
from lmkit.models.fp8 import check_fp8_sources
from lmkit.models.architecture import Architecture, ModelFields
from lmkit.models.quant_config import WeightQuant, weight_quant
from lmkit.models.registry import get_architecture
from lmkit.models.safetensors_index import TensorEntry, index_folder

# ModelFields copied as they are onto the engine's ModelConfig (the rope tables are converted)
_PLAIN_ENGINE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                        "head_dim", "rms_norm_eps", "norm_weight_offset", "embed_scale", "hidden_act", "attn_scale",
                        "attn_logit_softcap", "final_logit_softcap", "has_qkv_bias", "has_qk_norm", "rotary_dim",
                        "tie_word_embeddings", "max_position_embeddings", "qk_norm_whole", "num_experts",
                        "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel", "attn_output_gate",
                        "swiglu_alpha", "swiglu_limit", "has_o_bias", "attention_sinks", "moe_biases",
                        "experts_interleaved", "has_v_norm", "has_layer_scalar", "moe_beside_mlp",
                        "per_layer_input_size", "mtp_num_layers")
# checkpoint tensors that are not weights (rotary buffers some exporters save)
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(kw_only=True)
class ModelSpec(ModelFields):
    """Everything the C++ engine needs to load a model folder: the ModelFields of its config.json and these."""

    path: Path
    architecture: Architecture
    config: dict  # config.json as read
    eos_token_ids: list[int]
    quant: WeightQuant | None = None  # how the quantized linears are stored; None: a float checkpoint
    gguf: Path | None = None  # the GGUF file the tensors come from (path is then its view folder, gguf_file.py)
    qk_rotary_interleaved: bool = False  # q/k rows in llama.cpp's interleaved rotary order (GGUF llama files)
    linear_value_heads_tiled: bool = False  # GGUF qwen35: value-indexed tensors in tiled head order (ModelConfig)
    linear_decay_rate_stored: bool = False  # GGUF qwen35: the A_log role holds -exp(A_log) (ModelConfig)
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

    def engine_config_fields(self, session_len: int | None = None) -> dict:
        """Field name -> value of the engine's ModelConfig (names as in C++). ``session_len``: the engine's
        tokens per session; it picks longrope's table (the long factors when it exceeds the pretraining length;
        None: the short ones, see RopeTable.for_session)."""
        values = {name: getattr(self, name) for name in _PLAIN_ENGINE_FIELDS}
        local = self.rope_local
        values.update(
            architecture=self.architecture.name,
            family=self.architecture.family,
            inv_freq=[float(x) for x in self.rope.for_session(session_len)],
            attention_scaling=float(self.rope.attention_scaling),
            inv_freq_local=[] if local is None else [float(x) for x in local.for_session(session_len)],
            attention_scaling_local=1.0 if local is None else float(local.attention_scaling),
            layer_rope=list(self.layer_rope),
            layer_sliding_window=list(self.layer_sliding_window),
            layer_moe=list(self.layer_moe),
            layer_recurrent=list(self.layer_recurrent),
            layer_head_dim=list(self.layer_head_dim),
            layer_num_kv_heads=list(self.layer_num_kv_heads),
            layer_v_from_k=list(self.layer_v_from_k),
            layer_kv_source=list(self.layer_kv_source),
            layer_intermediate_size=list(self.layer_intermediate_size),
            int4_layout=self.quant.int4_layout if self.quant else "",
            int4_group_size=self.quant.group_size if self.quant and self.quant.bits == 4 else 0,
            qk_rotary_interleaved=self.qk_rotary_interleaved,
            linear_value_heads_tiled=self.linear_value_heads_tiled,
            linear_decay_rate_stored=self.linear_decay_rate_stored,
        )
        return values

    def to_engine_config(self, session_len: int | None = None):
        """The lmkit._engine.ModelConfig for this spec in sessions of ``session_len`` tokens (see
        engine_config_fields; pass the engine's resolved session length)."""
        from lmkit._ext import _engine

        c = _engine.ModelConfig()
        for name, value in self.engine_config_fields(session_len).items():
            setattr(c, name, value)
        return c


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
    quant = weight_quant(cfg, cfg_path)
    try:
        fields = arch.model_fields(cfg)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None

    text_config = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    eos = _as_id_list(cfg["eos_token_id"] if "eos_token_id" in cfg else text_config.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else None
    if gen is not None:
        eos += [t for t in _as_id_list(gen.get("eos_token_id")) if t not in eos]
    generation_defaults = read_generation_defaults(path, cfg, gen)

    gguf = None
    hybrid_layout = False
    if gguf_file.is_view(path):
        gguf = gguf_file.view_source(path)
        if quant is not None:
            raise ValueError(f"{cfg_path}: a GGUF view has a quantization_config")
        sources = gguf_sources(arch, path, gguf, fields.num_layers, fields.num_experts,
                               int(cfg.get("mtp_num_hidden_layers") or 0))
        hybrid_layout = gguf_file.gguf_arch_of(cfg) in gguf_file.HYBRID_LAYOUT
        if hybrid_layout:  # its (1 + w) norms stored as 1 + w (gguf_file.HYBRID_LAYOUT)
            fields.norm_weight_offset = 0.0
        fields.experts_interleaved = False  # llama.cpp splits gpt-oss's gate and up apart
    else:
        sources = map_tensors(arch, index_folder(path), fields.num_layers, quant, path, fields.num_experts)
        check_fp8_sources(sources, quant.fp8_scales if quant is not None and quant.layout == "fp8" else None, path)
    if fields.tie_word_embeddings:
        sources.pop("lm_head", None)  # HF uses the embedding even when a copy was saved
    return ModelSpec(
        **vars(fields),
        path=path,
        architecture=arch,
        config=cfg,
        eos_token_ids=eos,
        quant=quant,
        gguf=gguf,
        qk_rotary_interleaved=gguf is not None and gguf_file.gguf_arch_of(cfg) in gguf_file.QK_INTERLEAVED,
        linear_value_heads_tiled=gguf is not None and gguf_file.gguf_arch_of(cfg) in gguf_file.TILED_VALUE_HEADS,
        linear_decay_rate_stored=hybrid_layout,
        generation_defaults=generation_defaults,
        sources=sources,
    )


def expanded(role: str, key: str, num_layers: int, num_experts: int = 0):
    """(role, checkpoint name) of one key-map entry for every layer ("{i}") and expert ("{e}") it names."""
    for e in range(num_experts) if "{e}" in role else [None]:
        r, k = (role, key) if e is None else (role.replace("{e}", str(e)), key.replace("{e}", str(e)))
        for i in range(num_layers) if "{i}" in r else [None]:
            yield (r, k) if i is None else (r.format(i=i), k.format(i=i))


def map_tensors(arch: Architecture, tensors: dict[str, TensorEntry], num_layers: int, quant: WeightQuant | None,
                path: Path, num_experts: int = 0) -> dict[str, TensorEntry]:
    """Engine role -> checkpoint tensor by the architecture's key map. An int4 linear (``<module>.qweight`` etc.,
    the layout's tensor names in ``quant``, in place of ``<module>.weight``) maps to ``<role>.values``,
    ``.zeros``, ``.scales`` and ``.g_idx`` (NVFP4: ``.global_scale`` too; FP4 scales as U8 bytes); an int8
    or FP8 one keeps its ``<module>.weight`` as ``<role>`` and adds ``<module>.weight_scale`` (FP8 vendor form:
    ``weight_scale_inv``) as ``<role>.scales``. Raises ValueError naming
    the tensors no role takes (rotary buffers aside): a weight lmkit would silently drop."""
    sources: dict[str, TensorEntry] = {}
    used: set[str] = set()
    int4 = quant if quant is not None and quant.bits == 4 else None
    int8 = quant if quant is not None and quant.bits == 8 else None
    values_name = int4.tensor_names[0] if int4 else None
    # ModelOpt's NVFP4 keeps its codes under ``weight`` (U8): the int4 path below, not a dense weight
    codes_in_weight = int4 is not None and values_name == "weight"
    for role, key in arch.key_map.items():
        for r, k in expanded(role, key, num_layers, num_experts):
            if k in tensors and not (codes_in_weight and tensors[k].dtype == "U8"):
                sources[r] = tensors[k]
                used.add(k)
                scale = k[: -len("weight")] + int8.tensor_names[2] if int8 and k.endswith(".weight") else None
                if scale is not None and scale in tensors:
                    sources[f"{r}.scales"] = tensors[scale]
                    used.add(scale)
                elif int8 and tensors[k].dtype in ("I8", "F8_E4M3"):
                    kind = "int8" if tensors[k].dtype == "I8" else "FP8"
                    raise ValueError(f"{path}: {kind} layer {k[: -len('.weight')]} has no {int8.tensor_names[2]}")
            elif int4 and k.endswith(".weight") and k[: -len("weight")] + values_name in tensors:
                base = k[: -len("weight")]
                for part, name in zip(("values", "zeros", "scales", "g_idx"), int4.tensor_names):
                    if name is not None and base + name in tensors:
                        sources[f"{r}.{part}"] = tensors[base + name]
                        used.add(base + name)
                if f"{r}.scales" not in sources:
                    raise ValueError(f"{path}: int4 layer {base[:-1]} has {values_name} but no {int4.tensor_names[2]}")
                if sources[f"{r}.scales"].dtype == int4.scale_bytes_dtype:  # FP4 scales: bytes decoded in C++
                    sources[f"{r}.scales"] = replace(sources[f"{r}.scales"], dtype="U8")
                if int4.global_scale_name:
                    name = base + int4.global_scale_name
                    if name not in tensors:
                        raise ValueError(f"{path}: NVFP4 layer {base[:-1]} has no {int4.global_scale_name}")
                    entry = tensors[name]  # ModelOpt's is a scalar: one value, as the engine reads it
                    sources[f"{r}.global_scale"] = replace(entry, shape=(1,)) if not entry.shape else entry
                    used.add(name)
                used.update(base + extra for extra in int4.extra_suffixes if base + extra in tensors)
    if int4 is not None and int4.layout == "nvfp4_modelopt":  # its KV / activation scales, also of layers it excluded
        used.update(name for name in tensors if name.endswith(tuple("." + s for s in int4.extra_suffixes)))
    unknown = sorted(name for name in tensors if name not in used and not name.endswith(_IGNORED_TENSOR_SUFFIXES)
                     and not name.startswith(arch.unused_tensors or ("\0",)))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(f"{path}: tensors that lmkit's {arch.name} does not use: {', '.join(unknown[:5])}{more} "
                         "(a checkpoint variant its module lmkit/models/ does not know)")
    return sources


def gguf_sources(arch: Architecture, view: Path, gguf: Path, num_layers: int, num_experts: int = 0,
                 mtp_layers: int = 0) -> dict[str, TensorEntry]:
    """Engine role -> tensor of GGUF file ``gguf`` (of view folder ``view``): the architecture's key map (role -> HF
    name) through the gguf package's name table (HF name -> GGUF name); a layer's experts come as one tensor each
    for gate, up and down (the experts.*_exps roles). The ``mtp_layers`` blocks after the decoder's (llama.cpp's
    nextn blocks of a multi-token-prediction head) are read as the mtp.* roles (gguf_file.mtp_to_gguf_names).
    Raises ValueError naming the tensors no role takes."""
    gguf_arch = gguf_file.gguf_arch_of_architecture(arch.name)
    hf_names = [k for role, key in arch.key_map.items() for _, k in expanded(role, key, num_layers)]
    gguf_of = gguf_file.hf_to_gguf_names([n for n in hf_names if not n.startswith("mtp.")], gguf_arch, num_layers)
    mtp_of, skipped = gguf_file.mtp_to_gguf_names(hf_names, gguf_arch, num_layers, mtp_layers)
    gguf_of.update(mtp_of)
    # rope_freqs (Llama 3's scaling, Gemma 4's proportional RoPE) is read into the view's config (gguf_file)
    folded = {"rope_freqs.weight"}
    tensors = {name: entry for name, entry in gguf_file.view_tensors(view, gguf).items()
               if name not in folded and name not in skipped}
    by_hf = {gguf_name: hf for hf, gguf_name in gguf_of.items()}
    renamed = {by_hf[name]: entry for name, entry in tensors.items() if name in by_hf}
    unknown = sorted(name for name in tensors if name not in by_hf)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise gguf_file.GgufError(f"{gguf}: tensors that lmkit's {arch.name} does not use: {', '.join(unknown[:5])}"
                                  f"{more}")
    sources = map_tensors(arch, renamed, num_layers, None, gguf, num_experts)
    for role, entry in sources.items():  # llama.cpp squeezes the shared expert's gate [1, hidden] to [hidden]
        if role.endswith(".shared_expert_gate") and len(entry.shape) == 1:
            sources[role] = replace(entry, shape=(1, entry.shape[0]))
    return sources
