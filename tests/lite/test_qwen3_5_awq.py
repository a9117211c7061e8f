"""lmkit lite awq on Qwen3.5 (dense text model), as a tiny random hybrid: three Gated DeltaNet layers for one
gated-attention layer. Each layer's AWQ map is its kind's (lmkit.lite.moe.layer_awq_map): the layer-wise
decomposition reproduces HF's layers (checked inside the quantizer); the saved smoothing scales leave the fp model
unchanged; in_proj_b / in_proj_a (beta's and the decay's inputs) stay fp16 and out_proj is never smoothed; the
checkpoint's logits through the engine equal the dequantized torch reference, in the AutoAWQ layout and in
compressed-tensors (with its ignore list)."""

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
from tests.factories import QWEN3_5, Case, _write_case
from tests.helpers import TINY_CALIB, prefill_logits_vs_transformers

# value heads of 16 (64 values): every linear's inputs a multiple of the 32-wide groups
CASE = Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=4, linear_value_head_dim=16), seed=57,
            norm_offset=1.0, plain_norms=("linear_attn.norm",))


@pytest.fixture(scope="module", params=["autoawq", "compressed-tensors"])
def quantized(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5-awq")
    _write_case(CASE, folder / "fp")
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format=request.param,
                                                   **TINY_CALIB), keep_pseudo_quantized=True)
    return request.param, folder / "fp", result, folder / "awq"


@torch.no_grad()
def test_smoothing_leaves_the_model_unchanged(quantized):
    fmt, source, _, out = quantized
    awq_map = get_awq_map("Qwen3_5ForCausalLM")
    names = set(load_file(out / "model.safetensors"))
    suffix = "qweight" if fmt == "autoawq" else "weight_packed"
    types = json.loads((source / "config.json").read_text())["layer_types"]
    assert types == ["linear_attention"] * 3 + ["full_attention"]
    for i, kind in enumerate(types):
        p = f"model.layers.{i}."
        quantized_names = ([p + f"linear_attn.{n}.{suffix}" for n in ("in_proj_qkv", "in_proj_z", "out_proj")]
                           if kind == "linear_attention" else
                           [p + f"self_attn.{n}_proj.{suffix}" for n in "qkvo"])
        assert all(n in names for n in quantized_names), (i, kind)
        if kind == "linear_attention":  # fp16, as stored
            assert {p + "linear_attn.in_proj_b.weight", p + "linear_attn.in_proj_a.weight"} <= names
    if fmt == "compressed-tensors":
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert r"re:.*linear_attn\.in_proj_b$" in ignore and r"re:.*linear_attn\.in_proj_a$" in ignore
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
