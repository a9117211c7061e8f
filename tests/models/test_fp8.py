"""FP8 E4M3 checkpoints on the CPU engine (weights dequantized once at load, lmkit/models/fp8.py), held to references
that decode E4M3 independently of lmkit (torch's float8_e4m3fn dtype, times the scales in float64):

- compressed-tensors ``float-quantized`` (FP8_DYNAMIC) and ``naive-quantized`` (FP8 weight-only), written by the
  library's own compressor, scales per tensor, channel and 128x128 block; transformers' ``from_pretrained`` of the
  same folder on the CPU (its FP8 per-token activation fake-quantization switched off: the engine does not apply it);
- the vendor form (``quant_method: fp8``, ``weight_scale_inv`` per 128x128 block, Qwen3-*-FP8 / DeepSeek-V3), written
  by hand, with partial blocks at the edges and ``modules_to_not_convert`` in bf16; transformers' own FP8 loading of
  it where its dimensions are whole blocks (it refuses partial ones);
- corrupt tensors and configs we cannot serve are refused naming the tensor or field.

The engine's logits on the exact path (fp32 compute) must match within 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, pipeline
from tests.factories import ARCH_CASES as CASES
from tests.factories import build_case, linear_keys, without_cache_unless_attention, \
    write_compressed_tensors_fp8, write_fp8_block_vendor
from tests.helpers import logits_error, random_prompts, tensor_rewriter

ct = pytest.importorskip("compressed_tensors")

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)
REL_TOL = 1e-4


def engine_vs_reference(out: Path, prompts, config: EngineConfig = EXACT) -> float:
    """Largest relative error of the engine's logits on ``out``/fp8 against HF fp32 on ``out``/ref."""
    from transformers import AutoModelForCausalLM

    ref = without_cache_unless_attention(
        AutoModelForCausalLM.from_pretrained(str(out / "ref"), dtype=torch.float32).eval())
    return logits_error(out / "fp8", ref, prompts, config)


# ---- compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC / FP8 weight-only / FP8_BLOCK)

@pytest.mark.parametrize("strategy, activations, scale_dtype", [
    ("channel", True, torch.bfloat16),   # FP8_DYNAMIC as llm-compressor writes a bf16 model
    ("channel", False, torch.float32),   # FP8 weight-only: format naive-quantized
    ("tensor", True, torch.float32),
    ("block", True, torch.float32),      # FP8_BLOCK, partial blocks at the edges
])
def test_compressed_tensors_fp8(odd_llama, tmp_path, strategy, activations, scale_dtype):
    out = write_compressed_tensors_fp8(odd_llama, tmp_path, strategy=strategy, activations=activations,
                                       scale_dtype=scale_dtype)
    assert engine_vs_reference(out, random_prompts(1)) <= REL_TOL
    with pipeline(out / "fp8", EXACT) as pipe:
        quant = pipe.engine.spec.quant
        assert quant.layout == "fp8" and quant.fp8_scales == (strategy if strategy != "block" else (128, 128))
        assert ("dynamic" in quant.describe()) == activations


@pytest.mark.parametrize("case", ["qwen2", "phi3", "gemma3", "qwen3_moe"])
def test_compressed_tensors_fp8_every_family(case, tmp_path, tmp_path_factory):
    """Biases (Qwen2), fused qkv / gate_up (Phi-3), Gemma's norms, experts one by one beside a dense router
    (Qwen3-MoE): per-channel FP8_DYNAMIC against HF fp32 on the decoded weights."""
    src = tmp_path_factory.mktemp(case)
    build_case(case, src)
    assert linear_keys(src, 1)
    out = write_compressed_tensors_fp8(src, tmp_path)
    assert engine_vs_reference(out, random_prompts(CASES[case].seed)) <= REL_TOL


def test_transformers_loads_the_same_folder(llama, tmp_path):
    """transformers' from_pretrained of the FP8_DYNAMIC folder (compressed-tensors decompresses it on the CPU), with
    its per-token FP8 activation fake-quantization off, is the model the engine runs."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    out = write_compressed_tensors_fp8(llama, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(out / "fp8"), dtype=torch.float32).eval()
    hf.apply(disable_quantization)
    assert logits_error(out / "fp8", hf, random_prompts(2), EXACT) <= REL_TOL


def test_bfloat16_engine_and_no_file_left(llama, tmp_path, monkeypatch):
    """The bf16 engine (weights decoded into bf16) stays within a bf16 engine's distance; the dequantized copy's
    temporary file is unlinked once the engine has mapped it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = write_compressed_tensors_fp8(llama, tmp_path / "ct")
    auto = EngineConfig(device="cpu", cache_max_entry_count=64, cache_block_seq_len=16, max_batch_size=4,
                        session_len=512, int8_activations=False)
    bf16 = auto.resolved_kv_bf16("cpu")  # bf16 compute and KV, or (no AVX512_BF16) a bf16 KV cache
    assert engine_vs_reference(out, random_prompts(3), auto) <= (3e-2 if bf16 else REL_TOL)
    assert not list((tmp_path / "cache" / "lmkit" / "fp8").iterdir())


# ---- the vendor form: quant_method fp8, weight_scale_inv per block

def test_vendor_fp8_blocks(odd_llama, tmp_path):
    """Partial blocks at every edge (k/v 64 rows, 320 and 192 columns), down_proj kept in bf16
    (modules_to_not_convert)."""
    out = write_fp8_block_vendor(odd_llama, tmp_path, keep_dense=("down_proj",))
    assert engine_vs_reference(out, random_prompts(4)) <= REL_TOL
    with pipeline(out / "fp8", EXACT) as pipe:
        assert pipe.engine.spec.quant.fp8_scales == (128, 128)
        dtypes = {role: e.dtype for role, e in pipe.engine.spec.sources.items() if role.endswith("_proj")}
        assert {d for role, d in dtypes.items() if "down_proj" in role} == {"BF16"}
        assert {d for role, d in dtypes.items() if "down_proj" not in role} == {"F8_E4M3"}


def test_vendor_fp8_against_transformers(llama, tmp_path):
    """transformers' own FP8 loading of the vendor folder on the CPU (its Fp8Dequantize: whole blocks only)."""
    from transformers import AutoModelForCausalLM

    out = write_fp8_block_vendor(llama, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(out / "fp8"), dtype=torch.float32).eval()
    assert logits_error(out / "fp8", hf, random_prompts(5), EXACT) <= REL_TOL


# ---- what is refused, naming the field or tensor

def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"])
    path.write_text(json.dumps(cfg))


def _set(path: str, value):
    def edit(qc):
        *parents, last = path.split(".")
        for p in parents:
            qc = qc[p]
        if value is None:
            qc.pop(last, None)
        else:
            qc[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("config_groups.group_0.weights.num_bits", 4), "4-bit float is not supported with format 'float-quantized'"),
    (_set("config_groups.group_0.weights.strategy", "group"), "strategy='group'"),
    (_set("config_groups.group_0.input_activations.dynamic", False), "static FP8 activation scales"),
    (_set("config_groups.group_0.input_activations.type", "int"), "input_activations: 8-bit int"),
    (_set("config_groups.group_0.weights.symmetric", False), "weights.symmetric=false"),
])
def test_unservable_compressed_tensors_fp8_configs(odd_llama, tmp_path, edit, message):
    out = write_compressed_tensors_fp8(odd_llama, tmp_path)
    _edit_config(out / "fp8", edit)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        pipeline(out / "fp8", EXACT)


@pytest.mark.parametrize("edit, message", [
    (_set("fmt", "e5m2"), "fmt='e5m2'"),
    (_set("activation_scheme", "static"), "activation_scheme='static'"),
    (_set("weight_block_size", None), "weight_block_size=None"),
    (_set("weight_block_size", [64, 128]), r"per 64x128 block"),
])
def test_unservable_vendor_fp8_configs(odd_llama, tmp_path, edit, message):
    out = write_fp8_block_vendor(odd_llama, tmp_path)
    _edit_config(out / "fp8", edit)
    with pytest.raises(ValueError, match=message):
        pipeline(out / "fp8", EXACT)


def test_broken_fp8_tensors_name_the_tensor(odd_llama, tmp_path):
    """A missing scale, a scale of the wrong shape, a NaN or infinite scale, NaN weight codes, E5M2 weights, FP8
    weights without an FP8 config: each refused naming the tensor, nothing served."""
    from safetensors.torch import save_file

    out = write_compressed_tensors_fp8(odd_llama, tmp_path)
    st = out / "fp8" / "model.safetensors"
    key = "model.layers.0.self_attn.q_proj."
    good, broken = tensor_rewriter(st, key)

    broken(weight_scale=None)
    with pytest.raises(ValueError, match="FP8 layer model.layers.0.self_attn.q_proj has no weight_scale"):
        pipeline(out / "fp8", EXACT)
    broken(weight_scale=good[key + "weight_scale"][:-1].contiguous())
    with pytest.raises(ValueError, match=r"'layers.0.q_proj' \[192, 192\] have shape \[191, 1\]"):
        pipeline(out / "fp8", EXACT)
    for bad_value in (float("nan"), float("inf")):
        bad = good[key + "weight_scale"].clone()
        bad[7] = bad_value
        broken(weight_scale=bad)
        with pytest.raises(ValueError, match=r"q_proj' hold NaN or infinite values \(first at flat index 7\)"):
            pipeline(out / "fp8", EXACT)
    codes = good[key + "weight"].clone()
    codes[0, 0] = float("nan")
    broken(weight=codes)
    with pytest.raises(ValueError, match="q_proj' holds NaN codes"):
        pipeline(out / "fp8", EXACT)
    broken(weight=good[key + "weight"].float().to(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"q_proj' is FP8 E5M2 \(F8_E5M2\); lmkit serves FP8 E4M3"):
        pipeline(out / "fp8", EXACT)
    save_file({k: v for k, v in good.items() if not k.endswith("weight_scale")}, str(st))
    _edit_config(out / "fp8", lambda qc: qc.clear())
    with pytest.raises(ValueError, match="is F8_E4M3 but config.json has no FP8 quantization_config"):
        pipeline(out / "fp8", EXACT)


def test_e4m3_table_matches_torch():
    """lmkit's decoding table of the 256 E4M3 codes against torch's float8_e4m3fn."""
    from lmkit.models.fp8 import E4M3_VALUES

    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(E4M3_VALUES, want)
