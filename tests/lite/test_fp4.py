"""``lmkit lite fp4``: compressed-tensors NVFP4A16 / MXFP4A16 checkpoints, held to compressed-tensors' own qparams
and compressors on the same weights, a float64 decoding of the format independent of lmkit (tests/factories.py
fp4_reference), transformers' from_pretrained of the folder, lite's torch reference, and the engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from lmkit import EngineConfig
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import Fp4Config
from lmkit.lite.export import WorkDirError
from lmkit.lite.fp4 import fp4_quantization_config, quantize_fp4
from tests.factories import MOE_CASES, fp4_reference, make_moe_model, make_tiny_model, write_compressed_tensors_fp4
from tests.helpers import logits_error, random_prompts

ct = pytest.importorskip("compressed_tensors")

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)


@pytest.fixture(scope="module", params=["nvfp4", "mxfp4"])
def written(request, lite_tiny_llama, tmp_path_factory):
    fmt = request.param
    out = tmp_path_factory.mktemp("fp4") / fmt
    return fmt, out, quantize_fp4(lite_tiny_llama, Fp4Config(work_dir=out, format=fmt, device="cpu"))


def decoded_folder(folder, out):
    """``folder`` (an FP4 checkpoint) with every FP4 linear decoded in float64 (fp4_reference) into an fp32
    ``.weight`` and no quantization_config: the model the checkpoint defines."""
    tensors = load_file(str(folder / "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            scale = tensors[base + ".weight_scale"]
            block = 16 if scale.dtype == torch.float8_e4m3fn else 32
            plain[base + ".weight"] = fp4_reference(t, scale, block, tensors.get(base + ".weight_global_scale"))
        elif not name.endswith((".weight_scale", ".weight_global_scale")):
            plain[name] = t
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(plain, str(out / "model.safetensors"))
    return out


def test_checkpoint_is_what_compressed_tensors_writes(written, lite_tiny_llama, tmp_path):
    """The layout llm-compressor's NVFP4A16 / MXFP4A16 presets write: per linear the tensors compressed-tensors'
    own compressor writes from the same source weights with its own qparams (tests/factories.py, byte for byte);
    the lm_head dense and in ``ignore``."""
    fmt, out, result = written
    assert result.format == f"{fmt}-pack-quantized" and result.num_linears == 14
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == fp4_quantization_config(fmt, ["lm_head"])
    assert qc["format"] == f"{fmt}-pack-quantized" and qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    theirs = write_compressed_tensors_fp4(lite_tiny_llama, tmp_path, fmt=fmt)
    with safe_open(str(out / "model.safetensors"), "pt") as ours, \
            safe_open(str(theirs / "fp4" / "model.safetensors"), "pt") as ref:
        names = [n for n in ref.keys() if n.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
        assert len(names) == 14 * (3 if fmt == "nvfp4" else 2)
        for name in names:
            a, b = ours.get_tensor(name), ref.get_tensor(name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                                      b.view(torch.uint8) if b.dtype != torch.float32 else b), name
        assert ours.get_tensor("lm_head.weight").dtype == torch.float16


def test_engine_runs_the_format_as_defined(written, tmp_path):
    """The engine on the folder against HF fp32 on its float64 decoding: 1e-4; lite's torch reference (compressed-
    tensors' decompressor) and transformers' from_pretrained of the folder read it too (NVFP4 within their bf16
    decompression's rounding, tests/models/test_fp4.py)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    fmt, out, _ = written
    ref = AutoModelForCausalLM.from_pretrained(str(decoded_folder(out, tmp_path / "ref")), dtype=torch.float32)
    assert logits_error(out, ref.eval(), random_prompts(1), EXACT) <= 1e-4
    bound = 2e-2 if fmt == "nvfp4" else 1e-4
    assert logits_error(out, load_causal_lm(out), random_prompts(2), EXACT) <= bound
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True))
    assert logits_error(out, hf.float().eval(), random_prompts(3), EXACT) <= bound


def test_moe_experts_and_router(tmp_path):
    """NVFP4 of a Qwen3-MoE: every expert in FP4, the router dense and in ``ignore``; the engine on the float64
    decoding, 1e-4."""
    config_class, overrides, _, _ = MOE_CASES["qwen3_moe"]
    src = tmp_path / "src"
    make_moe_model(src, config_class, overrides)
    out = tmp_path / "fp4"
    quantize_fp4(src, Fp4Config(work_dir=out, device="cpu"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"] and any("gate" in name and name.startswith("re:") for name in qc["ignore"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.layers.0.mlp.experts.3.up_proj.weight_scale"] == "F8_E4M3"
    assert dtypes["model.layers.0.mlp.gate.weight"] == "F16"
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(decoded_folder(out, tmp_path / "ref")), dtype=torch.float32)
    assert logits_error(out, ref.eval(), random_prompts(4), EXACT) <= 1e-4


def test_cli_and_bad_input(written, lite_tiny_llama, tmp_path):
    from lmkit.cli.main import app

    fmt, done, _ = written
    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["lite", "fp4", str(lite_tiny_llama), "--work-dir", str(out),
                                      "--format", fmt, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert f"{fmt}-pack-quantized" in result.output
    with pytest.raises(ValueError, match="--format must be one of nvfp4, mxfp4"):
        Fp4Config(work_dir=out, format="fp4")
    with pytest.raises(WorkDirError, match="not empty"):
        quantize_fp4(lite_tiny_llama, Fp4Config(work_dir=out, device="cpu"))
    with pytest.raises(ValueError, match="already quantized|quantization_config"):  # an FP4 checkpoint as input
        quantize_fp4(done, Fp4Config(work_dir=tmp_path / "again", device="cpu"))
    assert not (tmp_path / "again").exists()
    odd = tmp_path / "odd"  # inputs that are no multiple of 32 (hidden 48): refused naming the linear
    make_tiny_model(odd, "llama", hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match="self_attn.q_proj: 48 inputs; lmkit's FP4 weights need a multiple of 32"):
        quantize_fp4(odd, Fp4Config(work_dir=tmp_path / "odd-fp4", device="cpu"))
    assert not (tmp_path / "odd-fp4").exists()
