"""Folding smoothing scales into a decoder leaves the fp model's outputs unchanged (to 1e-5), for
every group the tables allow, on tiny Llama (GQA: no v -> o), Llama without GQA (v -> o folds) and
Qwen2 (q/k/v biases)."""

from __future__ import annotations

import pytest
import torch

from lmkit.lite.apply import can_absorb, fold_scales
from lmkit.models import ARCHITECTURES, get_awq_map
from tests.factories import make_tiny_model


@pytest.mark.parametrize("arch,overrides,folds_v_o", [
    ("llama", {}, False),
    ("llama", {"num_key_value_heads": 4}, True),
    ("qwen2", {}, False),
    ("mistral", {"num_key_value_heads": 4}, True),
])
def test_fold_scales_keeps_fp_outputs(tmp_path, arch, overrides, folds_v_o):
    model = make_tiny_model(tmp_path / arch, arch, **overrides)
    awq_map = get_awq_map(model.config.architectures[0])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    g = torch.Generator().manual_seed(1)
    folded = 0
    for layer in model.model.layers:
        for group in awq_map.groups:
            size = layer.get_submodule(group.linears[0]).in_features
            if not can_absorb(layer, group):
                assert group.prev == "self_attn.v_proj"  # only v -> o under GQA may be refused
                continue
            fold_scales(layer, group, torch.exp(torch.randn(size, generator=g)))  # scales in ~[0.05, 20]
            folded += 1
    with torch.no_grad():
        after = model(ids).logits
    per_layer = len(awq_map.groups) if folds_v_o else len(awq_map.groups) - 1
    assert folded == per_layer * len(model.model.layers)
    assert float((after - before).abs().max()) <= 1e-5 * max(1.0, float(before.abs().max()))


def test_fold_refuses_gqa_v_to_o(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama")  # 4 heads, 2 kv heads: v out 32 != o in 64
    layer = model.model.layers[0]
    group = get_awq_map("LlamaForCausalLM").groups[1]
    assert not can_absorb(layer, group)
    with pytest.raises(ValueError, match="cannot absorb"):
        fold_scales(layer, group, torch.ones(64))


def test_every_table_covers_each_linear_once():
    for awq_map in (arch.awq_map for arch in ARCHITECTURES.values() if arch.awq_map is not None):
        assert len(set(awq_map.linears)) == len(awq_map.linears)
        assert set(awq_map.no_clip) <= set(awq_map.linears)
