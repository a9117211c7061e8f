"""``lmkit lite awq --format compressed-tensors``: the checkpoint is llm-compressor's pack-quantized W4A16 layout
(config keys and tensor names as compressed-tensors writes them), compressed-tensors' own decompressor reads it
back to exactly the weights of the AutoAWQ-format checkpoint of the same run, and the engine serves it with the
logits of that checkpoint (same quantization, same packed kernels) and of the dequantized reference."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from lmkit import EngineConfig
from lmkit.lite.awq import quantize_awq
from lmkit.lite.config import AwqConfig
from tests.factories import MOE_CASES, make_moe_model
from tests.helpers import engine_logits
from tests.helpers import TINY_CALIB

pytest.importorskip("compressed_tensors")

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, int8_activations=False)


def test_written_layout_is_llm_compressors(both_formats):
    from safetensors import safe_open

    _, ct_folder = both_formats
    qc = json.loads((ct_folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    (scheme,) = qc["config_groups"].values()
    assert scheme["targets"] == ["Linear"] and scheme["input_activations"] is None
    w = scheme["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", False, "group", 32)
    with safe_open(str(ct_folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        base = "model.layers.0.mlp.down_proj."
        assert {base + s for s in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")} <= names
        assert base + "weight" not in names and not any(n.endswith(".qweight") for n in names)
        out_features, in_features = f.get_tensor(base + "weight_shape").tolist()
        assert f.get_tensor(base + "weight_packed").shape == (out_features, in_features // 8)
        assert f.get_tensor(base + "weight_packed").dtype == torch.int32
        assert f.get_tensor(base + "weight_scale").shape == (out_features, in_features // 32)
        assert f.get_tensor(base + "weight_zero_point").shape == (out_features // 8, in_features // 32)
        assert "lm_head.weight" in names


def test_compressed_tensors_reads_back_the_autoawq_weights(both_formats):
    """compressed-tensors' decompressor (lmkit.lite.checkpoint) and our AutoAWQ unpacking give the same
    dequantized weights: one quantization, two layouts."""
    from lmkit.lite.checkpoint import read_state_dict

    awq_folder, ct_folder = both_formats
    awq_state, awq_settings = read_state_dict(awq_folder)
    ct_state, ct_settings = read_state_dict(ct_folder)
    assert awq_settings["quant_method"] == "awq" and ct_settings["quant_method"] == "compressed-tensors"
    assert awq_state.keys() == ct_state.keys()
    for name in awq_state:
        assert torch.equal(awq_state[name], ct_state[name]), name


def test_engine_serves_both_formats_identically(both_formats):
    from lmkit.lite.checkpoint import load_causal_lm

    awq_folder, ct_folder = both_formats
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 13, 40)]
    awq, ct = engine_logits(awq_folder, prompts, EXACT, 5), engine_logits(ct_folder, prompts, EXACT, 5)
    ref = load_causal_lm(ct_folder)
    for (full_a, got_a), (full_c, got_c) in zip(awq, ct):
        assert full_a == full_c
        # the same packed panels: equal up to the order of fp32 sums (the thread split may differ run to run)
        assert np.linalg.norm(got_a - got_c) / np.linalg.norm(got_a) <= 1e-5
        with torch.no_grad():
            want = ref(torch.tensor([full_c])).logits[0, : len(full_c) - 1].numpy()
        assert np.linalg.norm(got_c - want) / np.linalg.norm(want) <= 1e-4


def _hf_logits(folder, full: list[int], quantize_activations: bool = True) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if not quantize_activations:  # compressed-tensors reads the scheme at each forward
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                module.quantization_scheme.input_activations = None
    with torch.no_grad():
        return model(torch.tensor([full])).logits[0, : len(full) - 1].numpy()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_transformers_loads_the_export_with_lmkits_logits(both_formats):
    """The compressed-tensors W4A16 (asymmetric, packed zero points) export loads with transformers'
    from_pretrained, the loader users run, and gives the engine's logits. (compressed-tensors 0.18-0.20.1 size the
    zero point unpacked when transformers builds the model, so no asymmetric pack-quantized checkpoint loads with
    them, llm-compressor's included: setup.py pins 0.17.1.)"""
    _, ct_folder = both_formats
    for full, got in engine_logits(ct_folder, [[5, 9, 200, 17], list(range(40, 80))], EXACT, 5):
        assert _rel(got[: len(full) - 1], _hf_logits(ct_folder, full)) <= 1e-4


def test_transformers_loads_the_w8a8_export_with_lmkits_logits(lite_tiny_llama, tmp_path):
    """lmkit lite smooth_quant's compressed-tensors W8A8 (int8 weights per channel, int8 dynamic per-token
    activations) loads with from_pretrained. Weights: the same function as the engine's without activation
    quantization. Activations: the engine quantizes them in blocks along the row, finer than the checkpoint's one
    scale per token, so with both quantizing it stays at least as close to the fp model as transformers does."""
    from transformers import AutoModelForCausalLM

    from lmkit.lite.config import SmoothQuantConfig
    from lmkit.lite.smoothquant import quantize_smooth_quant

    folder = tmp_path / "w8a8"
    quantize_smooth_quant(lite_tiny_llama, SmoothQuantConfig(work_dir=folder, device="cpu", **TINY_CALIB))
    fp = AutoModelForCausalLM.from_pretrained(str(lite_tiny_llama), dtype=torch.float32).eval()
    for int8_activations in (False, True):
        config = dataclasses.replace(EXACT, int8_activations=int8_activations)
        for full, got in engine_logits(folder, [[5, 9, 200, 17], list(range(40, 80))], config, 5):
            got = got[: len(full) - 1]
            if not int8_activations:
                assert _rel(got, _hf_logits(folder, full, quantize_activations=False)) <= 1e-5
                continue
            with torch.no_grad():
                want = fp(torch.tensor([full])).logits[0, : len(full) - 1].numpy()
            assert _rel(got, want) <= 1.1 * _rel(_hf_logits(folder, full), want)


def test_moe_compressed_tensors_ignores_the_router(tmp_path):
    config_class, overrides, _, _ = MOE_CASES["qwen3_moe"]
    make_moe_model(tmp_path / "fp", config_class, overrides)
    quantize_awq(tmp_path / "fp", AwqConfig(work_dir=tmp_path / "ct", w_group_size=32, calib_samples=0,
                                            format="compressed-tensors"))
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", r"re:.*mlp\.gate$"]
    from lmkit.lite.checkpoint import load_causal_lm

    ref = load_causal_lm(tmp_path / "ct")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    for full, got in engine_logits(tmp_path / "ct", prompts, EXACT, 5):
        with torch.no_grad():
            want = ref(torch.tensor([full])).logits[0, : len(full) - 1].numpy()
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--format must be one of autoawq, compressed-tensors"):
        AwqConfig(work_dir=tmp_path, format="gguf")
