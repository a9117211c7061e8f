"""lmkit lite awq on Qwen3.5 (dense text model), as a tiny random hybrid: three Gated DeltaNet layers for one
gated-attention layer. Each layer's AWQ map is its kind's (lmkit.lite.moe.layer_awq_map): the layer-wise
decomposition reproduces HF's layers (checked inside the quantizer); the saved smoothing scales leave the fp model
unchanged; in_proj_b / in_proj_a (beta's and the decay's inputs) stay fp16 and out_proj is never smoothed; the
checkpoint's logits through the engine equal the dequantized torch reference, in the AutoAWQ layout and in
compressed-tensors (with its ignore list); and so for the checkpoint Qwen ships (Qwen3_5ForConditionalGeneration:
the text model quantized under model.language_model, the vision tower and the MTP head carried over in fp16 and
named in the ignore list). The MoE form (Qwen3_5MoeForCausalLM; as shipped, its experts stacked in two tensors per
layer): every routed expert's linears and the shared expert's in int4, the router and the shared expert's gate in
fp16, through the engine within 1e-4 of the dequantized reference; and Qwen3-Next (fused in_proj_qkvz / in_proj_ba,
a dense layer among the sparse ones) likewise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmkit.lite.apply import fold_scales
from lmkit.lite.awq import quantize_awq
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import AwqConfig
from lmkit.lite.moe import layer_awq_map
from lmkit.models import get_awq_map
from tests.factories import QWEN3_5, QWEN3_5_MOE, TOKEN_IDS, Case, _write_case, add_mtp_head, \
    fuse_qwen3_5_experts, write_qwen3_5_multimodal
from tests.helpers import TINY_CALIB, prefill_logits_vs_transformers, speculation_keeps_tokens

# value heads of 16 (64 values): every linear's inputs a multiple of the 32-wide groups
CASE = Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=4, linear_value_head_dim=16), seed=57,
            norm_offset=1.0, plain_norms=("linear_attn.norm",))


@pytest.fixture(scope="module", params=[("autoawq", False), ("compressed-tensors", False), ("compressed-tensors", True)],
                ids=["autoawq", "compressed-tensors", "multimodal"])
def quantized(request, tmp_path_factory):
    fmt, multimodal = request.param
    folder = tmp_path_factory.mktemp("qwen3_5-awq")
    if multimodal:
        write_qwen3_5_multimodal(folder / "fp", "Qwen3_5Config", dict(CASE.kwargs, max_position_embeddings=512,
                                                                     **TOKEN_IDS), seed=58)
        add_mtp_head(folder / "fp")  # the whole head, config mtp_num_hidden_layers = 1
    else:
        _write_case(CASE, folder / "fp")
    quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format=fmt, **TINY_CALIB))
    return fmt, multimodal, folder / "fp", folder / "awq"


@torch.no_grad()
def test_smoothing_leaves_the_model_unchanged(quantized):
    fmt, multimodal, source, out = quantized
    architecture = "Qwen3_5ForConditionalGeneration" if multimodal else "Qwen3_5ForCausalLM"
    awq_map = get_awq_map(architecture)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    names = set(load_file(out / "model.safetensors"))
    suffix = "qweight" if fmt == "autoawq" else "weight_packed"
    text = config["text_config"] if multimodal else config
    types = text["layer_types"]
    assert types == ["linear_attention"] * 3 + ["full_attention"]
    if multimodal:  # carried over as they are
        assert "mtp.fc.weight" in names and any(n.startswith("model.visual.") for n in names)
        assert not any(n.startswith("model.visual.") and n.endswith(suffix) for n in names)
    for i, kind in enumerate(types):
        p = f"model.language_model.layers.{i}." if multimodal else f"model.layers.{i}."
        quantized_names = ([p + f"linear_attn.{n}.{suffix}" for n in ("in_proj_qkv", "in_proj_z", "out_proj")]
                           if kind == "linear_attention" else
                           [p + f"self_attn.{n}_proj.{suffix}" for n in "qkvo"])
        assert all(n in names for n in quantized_names), (i, kind)
        if kind == "linear_attention":  # fp16, as stored
            assert {p + "linear_attn.in_proj_b.weight", p + "linear_attn.in_proj_a.weight"} <= names
    if fmt == "compressed-tensors":
        ignore = config["quantization_config"]["ignore"]
        assert r"re:.*linear_attn\.in_proj_b$" in ignore and r"re:.*linear_attn\.in_proj_a$" in ignore
        assert (r"re:model\.visual\..*" in ignore) == multimodal
    model = load_causal_lm(source)
    ids = torch.randint(0, 250, (2, 48), generator=torch.Generator().manual_seed(1))
    fp_logits = model(input_ids=ids).logits
    search = load_file(out / "awq" / "search.safetensors")
    smoothed = set()
    for i, layer in enumerate(model.model.layers):
        for group in layer_awq_map(awq_map, layer).groups:
            key = f"scales/model.layers.{i}.{group.prev}"
            if key in search:
                assert group.fold, key
                fold_scales(layer, group, search[key], awq_map.norm_weight_offset)
                smoothed.add(group.block)
    assert {"linear_attn", "self_attn", "mlp"} <= smoothed
    assert float((model(input_ids=ids).logits - fp_logits).norm() / fp_logits.norm()) < 1e-5


def test_engine_logits_equal_the_dequantized_reference(quantized):
    from lmkit import EngineConfig

    _, _, _, out = quantized
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_the_mtp_head_carried_over_loads_in_the_engine(quantized):
    """The checkpoint Qwen ships keeps its MTP head through lite as it was (not quantized): the engine holds its one
    layer, exactly the bytes of the mtp.* tensors written, and drafts with it beside the int4 layers
    (speculative='mtp', every draft verified): the tokens of speculation off."""
    from lmkit import GenerationConfig

    _, multimodal, _, out = quantized
    if not multimodal:
        pytest.skip("only the multimodal checkpoint carries an MTP head")
    mtp = {k: t for k, t in load_file(out / "model.safetensors").items() if k.startswith("mtp.")}
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp and not any(k.endswith("weight_packed") for k in mtp)
    base = dict(device="cpu", dtype="float32", cache_max_entry_count=8, session_len=256)
    prompts, gen = [[5, 9, 200, 31, 7], [88] * 12], GenerationConfig(max_new_tokens=20, ignore_eos=True)

    def holds_the_head(engine):
        assert engine.mtp_num_layers == 1
        assert engine.mtp_weight_bytes == sum(t.numel() * t.element_size() for t in mtp.values())

    m = speculation_keeps_tokens(out, base, prompts, gen, "mtp", check_plain=holds_the_head)
    assert m.num_verifications["mtp"] > 0


MOE_TEXT = dict(QWEN3_5_MOE, num_hidden_layers=4, linear_value_head_dim=16, moe_intermediate_size=32,
                shared_expert_intermediate_size=64)


@pytest.fixture(scope="module", params=[False, True, "next"], ids=["moe", "moe-as-shipped", "qwen3-next"])
def quantized_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe-awq")
    if request.param == "next":  # one dense layer (mlp_only_layers) among the sparse ones
        _write_case(Case("Qwen3NextConfig", dict(MOE_TEXT, intermediate_size=96, mlp_only_layers=[1]), seed=62,
                         norm_offset=1.0, plain_norms=("linear_attn.norm",)), folder / "fp")
    elif request.param:  # Qwen3_5MoeForConditionalGeneration, experts stacked
        write_qwen3_5_multimodal(folder / "fp", "Qwen3_5MoeConfig", dict(MOE_TEXT, max_position_embeddings=512,
                                                                        **TOKEN_IDS), seed=60)
        fuse_qwen3_5_experts(folder / "fp", MOE_TEXT["num_hidden_layers"], MOE_TEXT["num_experts"])
    else:
        _write_case(Case("Qwen3_5MoeTextConfig", MOE_TEXT, seed=61, norm_offset=1.0,
                         plain_norms=("linear_attn.norm",)), folder / "fp")
    quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="compressed-tensors",
                                          **TINY_CALIB))
    return request.param, folder / "awq"


def test_moe_checkpoint_through_the_engine(quantized_moe):
    from lmkit import EngineConfig

    kind, out = quantized_moe
    names = set(load_file(out / "model.safetensors"))
    p = "model.language_model.layers" if kind is True else "model.layers"
    for i in range(MOE_TEXT["num_hidden_layers"]):
        if kind == "next" and i == 1:  # the dense layer
            assert f"{p}.{i}.mlp.down_proj.weight_packed" in names
            continue
        if kind == "next" and i < 3:
            assert f"{p}.{i}.linear_attn.in_proj_qkvz.weight_packed" in names
            assert f"{p}.{i}.linear_attn.in_proj_ba.weight" in names
        for e in range(MOE_TEXT["num_experts"]):
            assert all(f"{p}.{i}.mlp.experts.{e}.{w}_proj.weight_packed" in names for w in ("gate", "up", "down"))
        assert f"{p}.{i}.mlp.shared_expert.down_proj.weight_packed" in names
        assert {f"{p}.{i}.mlp.gate.weight", f"{p}.{i}.mlp.shared_expert_gate.weight"} <= names  # fp16
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert r"re:.*mlp\.shared_expert_gate$" in ignore and r"re:.*mlp\.gate$" in ignore
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4
