"""Every architecture module against the HF model it describes: tiny random checkpoints saved with
transformers, read back with load_model_spec. Each tensor lands on exactly one engine role; per-layer windows
are what HF's eager attention masks; rope tables and scalings are the HF modules' own buffers; the AWQ map and
KV-calibration hooks name modules that exist. No C++ (engine_config_fields, not the bound ModelConfig)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from lmkit.models import ARCHITECTURES, get_architecture, get_awq_map, load_model_spec
from lmkit.models.architecture import ROPE_GLOBAL, ROPE_LOCAL, ROPE_NONE
from lmkit.models.safetensors_index import index_folder

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}

# case -> (config class, model class, config overrides)
CASES = {
    "llama3-rope": ("Llama", dict(num_hidden_layers=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear-head-dim": ("Llama", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-yarn": ("Llama", dict(num_hidden_layers=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral-nemo-head-dim": ("Mistral", dict(num_hidden_layers=2, head_dim=32, sliding_window=5)),
    "qwen2-sliding": ("Qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1)),
    "qwen3": ("Qwen3", dict(num_hidden_layers=2, head_dim=24, rope_theta=1000000.0)),
    "qwen3-sliding": ("Qwen3", dict(num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1)),
    "gemma2": ("Gemma2", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3": ("Gemma3Text", dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                                  sliding_window_pattern=3, rope_theta=100000.0, rope_local_base_freq=10000.0,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "phi3-longrope-partial": ("Phi3", dict(num_hidden_layers=2, partial_rotary_factor=0.75,
                                           original_max_position_embeddings=64, rope_scaling=LONGROPE)),
    "phi3-mha-sliding": ("Phi3", dict(num_hidden_layers=2, num_key_value_heads=4, sliding_window=5)),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=5)),
    "gpt-oss": ("GptOss", dict(num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=5, rope_parameters={
                                   "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
}


def _build(folder, case: str):
    import transformers

    prefix, overrides = CASES[case]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger than the default init, so that attention weights are not flat
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(str(folder))
    return model_cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (folder, HF model read back from it, eager attention); built once per module."""
    cache = {}

    def get(case: str):
        if case not in cache:
            folder = tmp_path_factory.mktemp(case)
            cache[case] = (folder, _build(folder, case))
        return cache[case]

    return get


def _module(model, path: str):
    for name in path.split("."):
        model = getattr(model, name)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tensor_lands_on_exactly_one_role(case, built):
    folder, model = built(case)
    spec = load_model_spec(folder)
    tensors = index_folder(folder)
    name_of = {(e.path, e.offset): name for name, e in tensors.items()}
    roles_of: dict[str, list[str]] = {}
    for role, entry in spec.sources.items():
        roles_of.setdefault(name_of[(entry.path, entry.offset)], []).append(role)
    assert all(len(roles) == 1 for roles in roles_of.values()), roles_of
    left = set(tensors) - set(roles_of)
    assert left <= ({"lm_head.weight"} if spec.tie_word_embeddings else set()), left
    # every HF parameter of the model is read (tied lm_head through the embedding)
    params = {name for name, _ in model.named_parameters()}
    assert params - set(tensors) <= {"lm_head.weight"}, params - set(tensors)
    # shapes as the contract writes them
    q, kv, h, i = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.intermediate_size
    expected = {"input_norm": (h,), "pre_mlp_norm": (h,), "post_attention_norm": (h,), "post_mlp_norm": (h,),
                "q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,), "q_proj": (q, h), "k_proj": (kv, h),
                "v_proj": (kv, h), "qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "q_bias": (q,), "k_bias": (kv,),
                "v_bias": (kv,), "gate_proj": (i, h), "up_proj": (i, h), "gate_up_proj": (2 * i, h),
                "down_proj": (h, i), "o_bias": (h,), "sinks": (spec.num_heads,), "router": (spec.num_experts, h),
                "router_bias": (spec.num_experts,)}
    # gpt-oss's experts, stored together as transformers holds them (inputs first)
    e, mi = spec.num_experts, spec.moe_intermediate_size
    experts = {"gate_up_proj": (e, h, 2 * mi), "down_proj": (e, mi, h), "gate_up_bias": (e, 2 * mi),
               "down_bias": (e, h)}
    for role, entry in spec.sources.items():
        short = role.split(".")[-1]
        if role.startswith("layers."):
            want = experts[short] if ".experts." in role else expected[short]
            assert tuple(entry.shape) == want, (role, entry.shape)
    has = {role.split(".")[-1] for role in spec.sources if role.startswith("layers.0.")}
    assert ("q_norm" in has) == spec.has_qk_norm and ("q_bias" in has) == spec.has_qkv_bias, has
    assert ("sinks" in has) == spec.attention_sinks and ("o_bias" in has) == spec.has_o_bias, has
    assert {"post_attention_norm", "post_mlp_norm"} <= has if spec.architecture.family == "gemma" \
        else not has & {"post_attention_norm", "post_mlp_norm"}


def _hf_tables(model, case: str) -> dict[str, tuple[torch.Tensor, float]]:
    rotary = model.model.rotary_emb
    if case.startswith("gemma3"):
        return {t: (getattr(rotary, f"{t}_inv_freq"), getattr(rotary, f"{t}_attention_scaling"))
                for t in ("full_attention", "sliding_attention")}
    return {"full_attention": (rotary.inv_freq, rotary.attention_scaling)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_tables_are_hf_buffers(case, built):
    folder, model = built(case)
    spec = load_model_spec(folder)
    tables = _hf_tables(model, case)
    fields = spec.engine_config_fields()
    inv_freq, scaling = tables["full_attention"]
    np.testing.assert_allclose(fields["inv_freq"], inv_freq.numpy(), rtol=1e-6, atol=0)  # 1 ulp: torch's pow
    assert fields["attention_scaling"] == pytest.approx(scaling, rel=1e-12)
    assert len(fields["inv_freq"]) * 2 == (fields["rotary_dim"] or spec.head_dim)
    if "sliding_attention" in tables:
        local, local_scaling = tables["sliding_attention"]
        np.testing.assert_allclose(fields["inv_freq_local"], local.numpy(), rtol=1e-6, atol=0)
        assert fields["attention_scaling_local"] == pytest.approx(local_scaling, rel=1e-12)
    else:
        assert fields["inv_freq_local"] == []
    # per layer: which table (Gemma 3 by layer type, SmolLM3 without RoPE on no_rope_layers)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if not getattr(attn, "use_rope", True):
            want = ROPE_NONE
        elif case.startswith("gemma3"):
            want = ROPE_LOCAL if model.config.layer_types[i] == "sliding_attention" else ROPE_GLOBAL
        else:
            want = ROPE_GLOBAL
        assert spec.layer_rope[i] == want, (i, spec.layer_rope)


@pytest.mark.parametrize("case", sorted(CASES))
def test_scalars_are_what_hf_modules_use(case, built):
    folder, model = built(case)
    spec = load_model_spec(folder)
    cfg = model.config
    attn = model.model.layers[0].self_attn
    assert spec.head_dim == attn.head_dim
    assert (spec.attn_scale or spec.head_dim ** -0.5) == pytest.approx(attn.scaling, rel=1e-12)
    assert spec.rms_norm_eps == cfg.rms_norm_eps
    embed_scale = getattr(model.model.embed_tokens, "embed_scale", None)
    assert spec.embed_scale == (1.0 if embed_scale is None else float(embed_scale.to(torch.float32)))
    assert spec.final_logit_softcap == (getattr(cfg, "final_logit_softcapping", None) or 0.0)
    # HF applies the attention soft-cap in Gemma 2 only (Gemma 3 keeps the field but never passes it on)
    assert spec.attn_logit_softcap == (cfg.attn_logit_softcapping if case.startswith("gemma2") else 0.0)
    assert spec.norm_weight_offset == (1.0 if spec.architecture.family == "gemma" else 0.0)
    if case.startswith("gpt-oss"):  # its experts' clamped SwiGLU, with the experts' own constants
        experts = model.model.layers[0].mlp.experts
        assert (spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit) == ("clamped_swiglu", experts.alpha,
                                                                           experts.limit)
    else:
        assert spec.hidden_act == ("gelu_tanh" if spec.architecture.family == "gemma" else "silu")
    assert spec.tie_word_embeddings == cfg.tie_word_embeddings


@pytest.mark.parametrize("case", sorted(CASES))
def test_windows_are_what_hf_attention_masks(case, built):
    """Eager attention weights are exactly 0 where HF masks: a query at p sees keys k <= p with p - k < w."""
    folder, model = built(case)
    spec = load_model_spec(folder)
    seq = 12
    with torch.no_grad():
        out = model(torch.arange(seq)[None] % spec.vocab_size, output_attentions=True)
    q_pos, k_pos = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    for i, weights in enumerate(out.attentions):
        w = spec.layer_sliding_window[i]
        visible = (k_pos <= q_pos) & ((q_pos - k_pos < w) if w else True)
        assert torch.equal(weights[0] > 0, visible.expand_as(weights[0])), (case, i, w)
    assert any(spec.layer_sliding_window) == ("sliding" in case or
                                              case.startswith(("mistral", "gemma", "smollm3", "gpt-oss")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_awq_map_and_kv_hooks_name_hf_modules(case, built):
    folder, model = built(case)
    arch = load_model_spec(folder).architecture
    awq = arch.awq_map
    if awq is None:  # lite cannot quantize it yet, and says so by name (gpt-oss); it calibrates its KV cache
        with pytest.raises(ValueError, match=f"does not quantize {arch.name} yet"):
            get_awq_map(arch.name)
        check_kv_hooks(arch.kv_calib, model)
        return
    assert get_awq_map(arch.name) is awq
    layer = _module(model, awq.layers)[0]
    assert _module(model, awq.embed_tokens) is model.model.embed_tokens
    for group in awq.groups:
        for name in (group.prev, group.block, *group.linears):
            _module(layer, name)
        assert all(isinstance(_module(layer, n), torch.nn.Linear) for n in group.linears), group
    for norm, block in awq.residual_blocks:
        _module(layer, norm), _module(layer, block)
    for block, norm in awq.post_norms.items():
        _module(layer, block), _module(layer, norm)
    _module(layer, awq.attention)
    assert sorted(awq.linears) == sorted(n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear))
    assert set(awq.no_clip) <= set(awq.linears)
    check_kv_hooks(arch.kv_calib, model)


def check_kv_hooks(hooks, model) -> None:
    """The KV-calibration hooks name the model's modules (the first layer with attention: a hybrid's first is
    recurrent)."""
    layers = _module(model, hooks.layers)
    i, layer = next((i, layer) for i, layer in enumerate(layers) if hasattr(layer, hooks.attention))
    attn = _module(layer, hooks.attention)
    assert attn.layer_idx == i and isinstance(_module(attn, hooks.o_proj), torch.nn.Linear)
    _module(model, hooks.final_norm), _module(model, hooks.lm_head)
    if "." in hooks.attention_function:
        import importlib

        module, _, function = hooks.attention_function.rpartition(".")
        assert callable(getattr(importlib.import_module(module), function))
    if hooks.final_logit_softcap:
        assert hasattr(model.config, hooks.final_logit_softcap)


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_layer_defaults_follow_the_config_class(case, built, tmp_path):
    """Without layer_types / no_rope_layers in config.json, the module's rule gives what the config class does."""
    from transformers import AutoConfig

    folder, model = built(case)
    spec = load_model_spec(folder)
    cfg = json.loads((folder / "config.json").read_text())
    stripped = {k: v for k, v in cfg.items() if k not in ("layer_types", "no_rope_layers")}
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(stripped))
    assert getattr(AutoConfig.from_pretrained(tmp_path), "layer_types", None) == getattr(model.config, "layer_types",
                                                                                          None)
    again = load_model_spec(tmp_path)
    assert (again.layer_sliding_window, again.layer_rope) == (spec.layer_sliding_window, spec.layer_rope)


def test_longrope_picks_the_table_by_session_length(built):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder, model = built("phi3-longrope-partial")
    spec = load_model_spec(folder)
    assert spec.rotary_dim == 12 and spec.head_dim == 16
    original = model.config.rope_parameters["original_max_position_embeddings"]
    long_freq, long_scaling = ROPE_INIT_FUNCTIONS["longrope"](model.config, seq_len=original + 1)
    short = spec.engine_config_fields()["inv_freq"]
    assert spec.engine_config_fields(original)["inv_freq"] == short
    np.testing.assert_allclose(spec.engine_config_fields(original + 1)["inv_freq"], long_freq.numpy(), rtol=1e-6)
    assert spec.engine_config_fields(original + 1)["attention_scaling"] == pytest.approx(long_scaling, rel=1e-12)
    assert long_scaling != 1.0  # max_position_embeddings 256 over 64: HF's sqrt(1 + ln 4 / ln 64)


def test_gemma3_legacy_layout_reads_the_same(built, tmp_path):
    """transformers 4.x wrote rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern."""
    folder, _ = built("gemma3")
    spec = load_model_spec(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert set(cfg["rope_parameters"]) == {"full_attention", "sliding_attention"}  # transformers 5's layout
    full = cfg["rope_parameters"]["full_attention"]
    legacy = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=full["rope_theta"], rope_local_base_freq=10000.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": full["factor"]})
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    old = load_model_spec(tmp_path)
    assert old.engine_config_fields() == spec.engine_config_fields()
    assert spec.layer_rope == [ROPE_LOCAL, ROPE_LOCAL, ROPE_GLOBAL, ROPE_LOCAL]


def test_awq_checkpoints_map_fused_linears(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = built("phi3-longrope-partial")
    tensors = load_file(str(folder / "model.safetensors"))
    awq = {}
    for name, t in tensors.items():
        if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            base, (out, cols) = name[: -len("weight")], t.shape
            awq[base + "qweight"] = torch.zeros(cols, out // 8, dtype=torch.int32)
            awq[base + "qzeros"] = torch.zeros(cols // 32, out // 8, dtype=torch.int32)
            awq[base + "scales"] = torch.ones(cols // 32, out, dtype=torch.float16)
        else:
            awq[name] = t
    save_file(awq, str(tmp_path / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32,
                                  "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    assert spec.quant.layout == "awq" and spec.quant.group_size == 32
    for i in range(spec.num_layers):
        for role in ("qkv_proj", "gate_up_proj"):
            assert {f"layers.{i}.{role}.{p}" for p in ("values", "zeros", "scales")} <= set(spec.sources)
            assert f"layers.{i}.{role}" not in spec.sources


def test_config_defaults_are_the_config_classes(tmp_path):
    """A key absent from config.json reads as transformers reads it: each module's DEFAULTS are its class's."""
    import transformers

    classes = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
               "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
               "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
               "Phi3ForCausalLM": "Phi3Config", "SmolLM3ForCausalLM": "SmolLM3Config",
               "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig",
               "OlmoeForCausalLM": "OlmoeConfig", "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
               "Qwen3_5ForConditionalGeneration": "Qwen3_5TextConfig",
               "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
               "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeTextConfig", "Qwen3NextForCausalLM": "Qwen3NextConfig",
               "GptOssForCausalLM": "GptOssConfig", "Gemma4ForCausalLM": "Gemma4TextConfig",
               "Gemma4ForConditionalGeneration": "Gemma4TextConfig"}
    assert set(classes) == set(ARCHITECTURES)
    for name, arch in ARCHITECTURES.items():
        cls = getattr(transformers, classes[name])
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, value in arch.config_defaults.items():
            if key in fields and not (key == "rope_parameters" and fields[key] is None):  # set in __post_init__
                assert fields[key] == value, (name, key, fields[key], value)
        if isinstance(cls.default_theta, dict):  # Gemma 3: global and local
            assert arch.config_defaults["rope_theta"] == cls.default_theta["global"]
            assert arch.config_defaults["rope_local_base_freq"] == cls.default_theta["local"]
    from lmkit.models import gpt_oss, qwen3_5, smollm3

    gpt = transformers.GptOssConfig()  # its rope and layer types come from __post_init__
    assert {k: gpt.rope_parameters[k] for k in gpt_oss.DEFAULTS["rope_parameters"]} == gpt_oss.DEFAULTS["rope_parameters"]
    assert gpt.rope_parameters["rope_theta"] == 150000.0

    assert smollm3.DEFAULT_THETA == transformers.SmolLM3Config.default_theta
    # Qwen3.5's defaults that are no dataclass fields (its __post_init__ sets them)
    qwen = transformers.Qwen3_5TextConfig(num_hidden_layers=8)
    assert qwen.rope_parameters["partial_rotary_factor"] == qwen3_5.DEFAULTS["partial_rotary_factor"]
    interval = qwen3_5.DEFAULTS["full_attention_interval"]
    assert qwen.layer_types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(8)]
    # Gemma 4's from its __post_init__: the global layers' head_dim and both layer types' rope
    from lmkit.models import gemma4

    g4 = transformers.Gemma4TextConfig(num_hidden_layers=6)
    assert g4.per_layer_config[5].head_dim == gemma4.GLOBAL_HEAD_DIM and g4.rope_parameters == gemma4.DEFAULT_ROPE


def test_unknown_architecture_lists_the_known_ones():
    for lookup in (get_architecture, get_awq_map):
        with pytest.raises(ValueError) as e:
            lookup("FalconForCausalLM")
        assert all(name in str(e.value) for name in ARCHITECTURES)


@pytest.mark.parametrize("case,edit,field", [
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("llama3-rope", {"mlp_bias": True}, "mlp_bias"),
    ("gemma3", {"model_type": "gemma3"}, "model_type"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("llama-yarn", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("phi3-longrope-partial", {"partial_rotary_factor": 0.7}, "partial_rotary_factor"),
])
def test_unsupported_flags_name_the_field(case, edit, field, built, tmp_path):
    folder, _ = built(case)
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    if case == "phi3-longrope-partial":
        cfg["rope_parameters"].pop("partial_rotary_factor")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        load_model_spec(tmp_path)


def test_unknown_tensors_are_refused(built, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = built("llama3-rope")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # an old exporter's buffer: ignored
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"o_proj\.bias") as e:
        load_model_spec(tmp_path)
    assert "inv_freq" not in str(e.value)


def test_awq_maps_of_moe_architectures_and_the_refusal_without_one(monkeypatch):
    """The mixture-of-experts architectures have AWQ tables with their sparse-MLP layout (Mixtral's under its
    checkpoint name block_sparse_moe); an architecture without a table is refused by name, naming what lite
    quantizes."""
    import dataclasses

    from lmkit.models import registry

    for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"):
        assert get_awq_map(name).moe is not None
    assert get_awq_map("MixtralForCausalLM").moe.checkpoint_block == "block_sparse_moe"
    monkeypatch.setitem(registry.ARCHITECTURES, "OlmoeForCausalLM",
                        dataclasses.replace(get_architecture("OlmoeForCausalLM"), awq_map=None))
    with pytest.raises(ValueError, match="does not quantize OlmoeForCausalLM yet.*LlamaForCausalLM"):
        get_awq_map("OlmoeForCausalLM")

@pytest.mark.parametrize("config_class, architecture, kwargs, lacks", [
    ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(use_bidirectional_attention="all"), "bidirectional attention"),
    ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(text_config=dict(use_bidirectional_attention="all")),
     "bidirectional attention"),
    ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(num_hidden_layers=4, num_kv_shared_layers=4),
     "num_kv_shared_layers"),
])
def test_models_lmkit_cannot_run_yet_name_what_they_lack(tmp_path, config_class, architecture, kwargs, lacks):
    """The Gemma 4 variants lmkit lacks a part for (transformers' own config.json of each) are refused at load
    naming that part, never run to a wrong answer."""
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=f"not supported for {architecture}: gemma4: {lacks}"):
        load_model_spec(tmp_path)
