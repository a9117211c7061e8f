"""The int4 checkpoint formats users download, loaded by the engine for every architecture of the registry and
held to a reference that dequantizes independently of lmkit:

- compressed-tensors W4A16 ``pack-quantized`` (what llm-compressor writes): packed and unpacked by the
  ``compressed-tensors`` library's own compressor (PackedQuantizationCompressor.compress / .decompress), scales
  and zero points from its own calculate_qparams; symmetric and asymmetric, groups of 32/64/128 and per-channel.
- GPTQ (GPTQModel / AutoGPTQ layout, checkpoint_format gptq and gptq_v2, act-order ``g_idx`` on and off):
  GPTQModel itself needs torch >= 2.14 and cannot install beside the pinned CPU torch, so the test packs its
  documented layout: qweight [in / 8, out] packed along the inputs, qzeros [groups, out / 8] packed along the
  outputs and stored as zero - 1 in v1 (GPTQModel's convert_gptq_v2_to_v1_format subtracts 0x11111111 from
  each int32), scales [groups, out], g_idx [in].

The engine's logits (fp32 activations: the exact path) must match HF transformers fp32 running the dequantized
weights within 1e-4, prompt and decode rows alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmkit import EngineConfig, pipeline
from tests.factories import ARCH_CASES as CASES
from tests.factories import build_case, linear_keys, without_cache_unless_attention, write_compressed_tensors, \
    write_compressed_tensors_int8, write_gptq
from tests.helpers import logits_error, random_prompts, tensor_rewriter

ct = pytest.importorskip("compressed_tensors")

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)
REL_TOL = 1e-4


# ---- the comparison

def engine_vs_reference(out: Path, prompts: list[list[int]], config: EngineConfig = EXACT,
                        new_tokens: int = 6, per_row: bool = True) -> float:
    """Largest relative error of the engine's logits (int4 folder) against HF fp32 (ref folder): of any row,
    or (per_row False) of any prompt's rows together."""
    from transformers import AutoModelForCausalLM

    ref = without_cache_unless_attention(
        AutoModelForCausalLM.from_pretrained(str(out / "ref"), dtype=torch.float32).eval())
    return logits_error(out / "int4", ref, prompts, config, new_tokens, per_row)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            build_case(name, folder)
            built[name] = folder
        return built[name]
    return get


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq-act-order"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_architecture_loads_int4_formats(case, fmt, cases, tmp_path):
    src = cases(case)
    if not linear_keys(src, 32):
        pytest.skip(f"{case}: no linear has in_features divisible by 32")
    if fmt == "compressed-tensors":
        out = write_compressed_tensors(src, tmp_path, group=32, symmetric=False)
    else:
        out = write_gptq(src, tmp_path, group=32, symmetric=False, act_order=True, checkpoint_format="gptq")
    assert engine_vs_reference(out, random_prompts(CASES[case].seed)) <= REL_TOL


@pytest.mark.parametrize("group, symmetric", [(32, True), (64, False), (128, True), (128, False), (0, False)])
def test_compressed_tensors_groups_and_symmetry(llama, tmp_path, group, symmetric):
    out = write_compressed_tensors(llama, tmp_path, group=group, symmetric=symmetric)
    cfg = json.loads((out / "int4" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["quant_method"] == "compressed-tensors"
    from safetensors import safe_open
    with safe_open(str(out / "int4" / "model.safetensors"), "pt") as f:
        has_zp = any(k.endswith("weight_zero_point") for k in f.keys())
    assert has_zp == (not symmetric)  # symmetric checkpoints carry no zero points: the engine reads zero 8
    assert engine_vs_reference(out, random_prompts(group)) <= REL_TOL


def test_compressed_tensors_fp16_and_fp32_scales(llama, tmp_path):
    out = write_compressed_tensors(llama, tmp_path / "f16", group=64, symmetric=False, scale_dtype=torch.float16)
    assert engine_vs_reference(out, random_prompts(3)) <= REL_TOL
    # fp32 scales are rounded to fp16 by the packer: within the rounding of the scales (2^-11 relative)
    out = write_compressed_tensors(llama, tmp_path / "f32", group=64, symmetric=False, scale_dtype=torch.float32)
    assert engine_vs_reference(out, random_prompts(4)) <= 2e-3


@pytest.mark.parametrize("group, symmetric, act_order, checkpoint_format", [
    (32, False, False, "gptq"), (64, True, True, "gptq"), (128, False, True, "gptq_v2"), (128, True, False, "gptq_v2"),
    (0, False, False, "gptq"),
])
def test_gptq_layouts(llama, tmp_path, group, symmetric, act_order, checkpoint_format):
    out = write_gptq(llama, tmp_path, group=group, symmetric=symmetric, act_order=act_order,
                     checkpoint_format=checkpoint_format, seed=group)
    assert engine_vs_reference(out, random_prompts(group + 1)) <= REL_TOL


def test_int8_activations_on_int4_formats(llama, tmp_path):
    """The default int8-activation path on both formats: within the bound the AWQ checkpoints keep
    (tests/models/test_quantized.py: the rounding of activations and of the int8 lm_head)."""
    default = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                           max_batch_size=4, session_len=512)
    ct_out = write_compressed_tensors(llama, tmp_path / "ct", group=128, symmetric=True)
    gptq_out = write_gptq(llama, tmp_path / "gptq", group=128, symmetric=False, act_order=True,
                          checkpoint_format="gptq")
    assert engine_vs_reference(ct_out, random_prompts(5), default, per_row=False) <= 3e-2
    assert engine_vs_reference(gptq_out, random_prompts(6), default, per_row=False) <= 3e-2


# ---- checkpoints the engine cannot serve: a clear error naming the field, before any tensor is read

def assert_refused(folder: Path, edit, message: str) -> None:
    """``edit`` applied to the folder's quantization_config makes the engine refuse it with ``message``."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"])
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        pipeline(folder, EXACT)


@pytest.mark.parametrize("edit, message", [
    (lambda qc: qc.update(bits=3), "bits=3"),
    (lambda qc: qc.update(bits=8), "bits=8"),
    (lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    (lambda qc: qc.update(group_size=48), "group_size=48"),
    (lambda qc: qc.update(lm_head=True), "lm_head=true"),
])
def test_unservable_gptq_configs(llama, tmp_path, edit, message):
    out = write_gptq(llama, tmp_path, group=64, symmetric=False, act_order=False, checkpoint_format="gptq")
    assert_refused(out / "int4", edit, message)


def _ct_edit(path: str, value):
    def edit(qc):
        node = qc
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_ct_edit("config_groups.group_0.weights.num_bits", 8), "8-bit int"),
    (_ct_edit("config_groups.group_0.weights.type", "float"), "4-bit float"),
    (_ct_edit("config_groups.group_0.weights.strategy", "tensor"), "strategy='tensor'"),
    (_ct_edit("config_groups.group_0.input_activations", {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True}), "input_activations"),
    (_ct_edit("format", "float-quantized"), "format 'float-quantized'"),
    (_ct_edit("quantization_status", "frozen"), "quantization_status='frozen'"),
    (_ct_edit("config_groups.group_1", {"targets": ["Linear"], "weights": {"num_bits": 4}}), "2 schemes"),
])
def test_unservable_compressed_tensors_configs(llama, tmp_path, edit, message):
    out = write_compressed_tensors(llama, tmp_path, group=64, symmetric=True)
    assert_refused(out / "int4", edit, message)


def test_broken_int4_tensors_name_the_tensor(llama, tmp_path):
    """A g_idx whose groups are not of group_size inputs, a scale of the wrong shape, a missing scale: each
    refused with the layer and tensor named, and nothing served."""
    out = write_gptq(llama, tmp_path, group=64, symmetric=False, act_order=True, checkpoint_format="gptq")
    st = out / "int4" / "model.safetensors"
    key = "model.layers.0.self_attn.q_proj."
    good, broken = tensor_rewriter(st, key)

    g_idx = good[key + "g_idx"].clone()
    g_idx[g_idx == 1] = 0  # group 0 gets 128 inputs, group 1 none
    broken(g_idx=g_idx)
    with pytest.raises(ValueError, match=r"q_proj.*g_idx puts 128 inputs in group 0"):
        pipeline(out / "int4", EXACT)
    broken(scales=good[key + "scales"][:-1].contiguous())
    with pytest.raises(ValueError, match=r"q_proj.*scales has shape \[3, 256\]"):
        pipeline(out / "int4", EXACT)
    broken(scales=None)
    with pytest.raises(ValueError, match="has qweight but no scales"):
        pipeline(out / "int4", EXACT)


# ---- compressed-tensors int8 (W8A8 / W8A16): int8 weights with float scales, on the int8 kernels

@pytest.mark.parametrize("case", ["llama31_rope", "qwen2", "phi3", "gemma3", "qwen3_moe"])
def test_int8_weights_every_family(case, cases, tmp_path):
    """W8A8 checkpoints of the library's own compressor (bf16 per-channel scales: the fp16-scale blocks of 32)
    against HF fp32 on its decompressed weights: exact path 1e-4."""
    src = cases(case)
    if not linear_keys(src, 0):
        pytest.skip(f"{case}: no linear has in_features divisible by 32")
    out = write_compressed_tensors_int8(src, tmp_path)
    assert engine_vs_reference(out, random_prompts(CASES[case].seed)) <= REL_TOL


@pytest.mark.parametrize("group, scale_dtype, activations, fmt", [
    (0, torch.float32, True, "int-quantized"),     # fp32 scales no fp16 value holds: blocks of 16 with fp32 scales
    (64, torch.bfloat16, True, "int-quantized"),   # per group of 64 inputs
    (16, torch.float16, False, "naive-quantized"),  # W8A16, groups of 16
])
def test_int8_scales_groups_and_formats(llama, tmp_path, group, scale_dtype, activations, fmt):
    out = write_compressed_tensors_int8(llama, tmp_path, group=group, scale_dtype=scale_dtype, activations=activations,
                                        fmt=fmt)
    assert engine_vs_reference(out, random_prompts(8)) <= REL_TOL
    with pipeline(out / "int4", EXACT) as pipe:
        assert pipe.engine.spec.quant.bits == 8
        assert ("dynamic" in pipe.engine.spec.quant.describe()) == activations


def test_int8_with_int8_activations(llama, tmp_path):
    """The default engine (int8 activations per 32 values: VNNI / AVX2 dot products, finer than the checkpoint's
    per-token scales) stays close to the reference."""
    out = write_compressed_tensors_int8(llama, tmp_path)
    default = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                           max_batch_size=4, session_len=512)
    assert engine_vs_reference(out, random_prompts(9), default, per_row=False) <= 3e-2  # as the int4 formats


@pytest.mark.parametrize("edit, message", [
    (_ct_edit("config_groups.group_0.weights.symmetric", False), "weights.symmetric=false"),
    (_ct_edit("config_groups.group_0.weights.num_bits", 4), "4-bit int is not supported with format 'int-quantized'"),
    (_ct_edit("config_groups.group_0.input_activations.dynamic", False), "input_activations.dynamic=false"),
    (_ct_edit("config_groups.group_0.input_activations.type", "float"), "input_activations: 8-bit float"),
    (_ct_edit("config_groups.group_0.weights.strategy", "tensor"), "strategy='tensor'"),
])
def test_unservable_int8_configs(llama, tmp_path, edit, message):
    out = write_compressed_tensors_int8(llama, tmp_path)
    assert_refused(out / "int4", edit, message)


def test_broken_int8_tensors_name_the_tensor(llama, tmp_path):
    out = write_compressed_tensors_int8(llama, tmp_path)
    key = "model.layers.0.self_attn.q_proj."
    good, broken = tensor_rewriter(out / "int4" / "model.safetensors", key)
    broken(weight_scale=None)
    with pytest.raises(ValueError, match=r"int8 layer model.layers.0.self_attn.q_proj has no weight_scale"):
        pipeline(out / "int4", EXACT)
    broken(weight_scale=good[key + "weight_scale"][:-1].contiguous())
    with pytest.raises(ValueError, match=r"q_proj: weight_scale has shape \[255, 1\]"):
        pipeline(out / "int4", EXACT)
    bad = good[key + "weight_scale"].clone()
    bad[3] = float("inf")
    broken(weight_scale=bad)
    with pytest.raises(ValueError, match=r"q_proj: weight_scale 3 is not finite"):
        pipeline(out / "int4", EXACT)
