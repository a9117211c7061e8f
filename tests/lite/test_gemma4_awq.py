"""lmkit lite awq on Gemma 4 (dense), as a tiny random model with attention_k_eq_v (its global layers have no
v_proj and 32-wide heads beside the sliding layers' 16), plain-w norms, a value norm and a stored scalar per layer. The layer-wise decomposition reproduces HF's layers (checked inside the quantizer), the
saved smoothing scales leave the fp model unchanged, o_proj is never smoothed (a per-head norm sits between v_proj
and it), and the checkpoint's logits through the engine equal the dequantized torch reference; so for the checkpoint Google
ships (Gemma4ForConditionalGeneration: the text model quantized under model.language_model, the vision tower carried
over in fp16); its KV calibration writes a policy the engine reads. The MoE and E-model forms are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmkit.lite.apply import fold_scales
from lmkit.lite.awq import quantize_awq
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import AwqConfig, KvCalibConfig
from lmkit.kv_policy import load_kv_policy
from lmkit.lite.kvcalib import calibrate_kv
from lmkit.lite.moe import layer_awq_map
from lmkit.models import get_awq_map, load_model_spec
from tests.factories import ARCH_CASES, Case, _write_case, write_gemma4_multimodal
from tests.helpers import TINY_CALIB, prefill_logits_vs_transformers


@pytest.fixture(scope="module", params=[False, True], ids=["text", "multimodal"])
def quantized(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-awq")
    if request.param:
        write_gemma4_multimodal(folder / "fp", "gemma4_k_eq_v", seed=75)
    else:
        _write_case(ARCH_CASES["gemma4_k_eq_v"], folder / "fp")
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="autoawq",
                                                   **TINY_CALIB), keep_pseudo_quantized=True)
    return folder / "fp", result, folder / "awq"


@torch.no_grad()
def test_smoothing_leaves_the_model_unchanged_and_skips_o_proj(quantized):
    source, result, out = quantized
    config = json.loads((source / "config.json").read_text())
    multimodal = "text_config" in config
    awq_map = get_awq_map(config["architectures"][0])
    tensors = load_file(out / "model.safetensors")
    types = (config["text_config"] if multimodal else config)["layer_types"]
    prefix = "model.language_model.layers" if multimodal else "model.layers"
    assert not multimodal or any(n.startswith("model.vision_tower.") for n in tensors)
    for i, kind in enumerate(types):  # a global layer (attention_k_eq_v) has no v_proj, quantized or not
        has_v = any(n.startswith(f"{prefix}.{i}.self_attn.v_proj.") for n in tensors)
        assert has_v == (kind == "sliding_attention"), (i, kind)
        assert f"{prefix}.{i}.self_attn.o_proj.qweight" in tensors
    model = load_causal_lm(source)
    ids = torch.randint(0, 250, (2, 48), generator=torch.Generator().manual_seed(1))
    fp_logits = model(input_ids=ids).logits
    search = load_file(out / "awq" / "search.safetensors")
    folded = 0
    for i, layer in enumerate(model.model.layers):
        for group in layer_awq_map(awq_map, layer).groups:  # a global layer's first group: q, k
            key = f"scales/model.layers.{i}.{group.prev}"
            if key in search:
                assert group.fold, key
                fold_scales(layer, group, search[key], awq_map.norm_weight_offset)
                folded += 1
    assert folded > 0
    assert float((model(input_ids=ids).logits - fp_logits).norm() / fp_logits.norm()) < 1e-5
    report = json.loads((out / "awq" / "report.json").read_text())
    o_proj = [g for layer in report["layers"] for g in layer["groups"] if g["linears"] == ["self_attn.o_proj"]]
    assert len(o_proj) == len(types) and not any(g["smoothed"] for g in o_proj)


def test_engine_logits_equal_the_dequantized_reference(quantized):
    from lmkit import EngineConfig

    _, _, out = quantized
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_kv_calibration_of_the_checkpoint_and_the_forms_lite_refuses(quantized, tmp_path):
    """The AWQ checkpoint calibrates (a policy the engine's reader takes: per-layer head dims as the spec has them);
    the MoE and E-model forms are refused by name."""
    _, _, out = quantized
    result = calibrate_kv(out, KvCalibConfig(work_dir=tmp_path / "kv", calib_dataset="pydoc", calib_samples=4,
                                             calib_seqlen=32, eval_dataset="pydoc", eval_seqlen=32,
                                             eval_max_tokens=64, device="cpu"))
    spec = load_model_spec(out)
    assert load_kv_policy(result.policy_path, spec.num_layers, spec.num_kv_heads, spec.head_dim) == result.layers
    _write_case(Case("Gemma4TextConfig", ARCH_CASES["gemma4_moe"].kwargs, seed=1), tmp_path / "moe")
    with pytest.raises(ValueError, match="does not quantize Gemma4ForCausalLM's MoE block"):
        quantize_awq(tmp_path / "moe", AwqConfig(work_dir=tmp_path / "awq", w_group_size=32, **TINY_CALIB))
    _write_case(Case("Gemma4TextConfig", ARCH_CASES["gemma4_e"].kwargs, seed=1), tmp_path / "e")
    with pytest.raises(ValueError, match="does not quantize Gemma4ForCausalLM's E-model form"):
        quantize_awq(tmp_path / "e", AwqConfig(work_dir=tmp_path / "awq-e", w_group_size=32, **TINY_CALIB))
