"""``lmkit lite fp8``: compressed-tensors FP8 E4M3 checkpoints (FP8_DYNAMIC and weight-only), held to
compressed-tensors' own compressor and decompressor, transformers' from_pretrained of the folder, and the engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from lmkit import EngineConfig
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import Fp8Config
from lmkit.lite.export import COMPLETE_MARKER, WorkDirError
from lmkit.lite.fp8 import fp8_quantization_config, fp8_scheme, quantize_fp8
from tests.factories import MOE_CASES, make_moe_model
from tests.helpers import logits_error, random_prompts

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization.lifecycle.helpers import disable_quantization  # noqa: E402

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)


def _hf(folder, quantize_activations: bool = False):
    """transformers' from_pretrained of an FP8 folder, fp32, with or without its FP8 activation fake-quantization."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if not quantize_activations:
        model.apply(disable_quantization)
    return model


@pytest.fixture(scope="module")
def dynamic(lite_tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "dynamic"
    return out, quantize_fp8(lite_tiny_llama, Fp8Config(work_dir=out, device="cpu"))


def test_checkpoint_is_compressed_tensors_fp8(dynamic, lite_tiny_llama):
    """llm-compressor's FP8_DYNAMIC layout: E4M3 weight and fp32 weight_scale [out, 1] per linear, what
    compressed-tensors' FloatQuantizationCompressor writes for the source weight and its own qparams; the lm_head
    dense and in ``ignore``; tokenizer files copied."""
    out, result = dynamic
    assert result.format == "float-quantized" and result.num_linears == 14
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == fp8_quantization_config("dynamic", ["lm_head"])
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["type"] == "float" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {**group["input_activations"], "type": "float", "strategy": "token",
                                          "dynamic": True, "num_bits": 8}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (lite_tiny_llama / name).read_bytes()
    assert (out / COMPLETE_MARKER).exists()

    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = fp8_scheme("dynamic")
    key = "model.layers.1.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "pt") as f, \
            safe_open(str(lite_tiny_llama / "model.safetensors"), "pt") as src:
        q, scale = f.get_tensor(key + ".weight"), f.get_tensor(key + ".weight_scale")
        w = src.get_tensor(key + ".weight").float()
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
    amax = w.abs().amax(dim=1, keepdim=True)
    want_scale, zero = calculate_qparams(-amax, amax, scheme.weights)
    want = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": want_scale, "weight_zero_point": zero},
                                                scheme)
    torch.testing.assert_close(scale, want_scale.float(), rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want["weight"].view(torch.uint8))
    back = FloatQuantizationCompressor.decompress({"weight": q, "weight_scale": scale}, scheme)["weight"]
    assert (back - w).abs().max() <= (amax * 2 ** -4).max()  # E4M3: 3 mantissa bits, half a step of 2^-3


def test_engine_and_transformers_agree(dynamic, lite_tiny_llama):
    """The engine (weights dequantized, activations in float) and transformers' from_pretrained of the folder with
    its FP8 activation quantization off: the same model, 1e-4; with it on, FP8 activations cost a few percent;
    and the checkpoint stays near the source model."""
    from transformers import AutoModelForCausalLM

    out, _ = dynamic
    assert logits_error(out, _hf(out), random_prompts(1), EXACT) <= 1e-4
    assert logits_error(out, _hf(out, quantize_activations=True), random_prompts(1), EXACT) <= 0.3
    source = AutoModelForCausalLM.from_pretrained(str(lite_tiny_llama), dtype=torch.float32).eval()
    assert logits_error(out, source, random_prompts(1), EXACT, per_row=False) <= 0.1


def test_lite_reference_reads_it(dynamic):
    """lite's torch reference (``lite ppl`` / ``lite eval``) reads the folder: its weights are the engine's, and
    with the scheme's FP8 per-token activations it computes what transformers' own loading does."""
    out, _ = dynamic
    assert logits_error(out, load_causal_lm(out, quantize_activations=False), random_prompts(3), EXACT) <= 1e-4
    ids = torch.tensor([random_prompts(3)[2]])
    with torch.no_grad():
        ours = load_causal_lm(out)(ids).logits
        theirs = _hf(out, quantize_activations=True)(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_weight_only_and_moe_routers(tmp_path):
    """FP8 weight-only (format naive-quantized) of a Qwen3-MoE: every expert FP8, the router dense and in ``ignore``;
    engine against transformers 1e-4."""
    config_class, overrides, _, _ = MOE_CASES["qwen3_moe"]
    src = tmp_path / "src"
    make_moe_model(src, config_class, overrides)
    out = tmp_path / "fp8"
    result = quantize_fp8(src, Fp8Config(work_dir=out, scheme="weight-only", device="cpu"))
    assert result.format == "naive-quantized"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert "lm_head" in qc["ignore"] and any("gate" in name and name.startswith("re:") for name in qc["ignore"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.layers.0.mlp.experts.3.up_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.mlp.gate.weight"] == "F16"
    assert logits_error(out, _hf(out), random_prompts(2), EXACT) <= 1e-4


def test_cli_and_bad_input(dynamic, lite_tiny_llama, tmp_path):
    from lmkit.cli.main import app

    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["lite", "fp8", str(lite_tiny_llama), "--work-dir", str(out),
                                      "--scheme", "weight-only", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "naive-quantized" in result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "naive-quantized"
    with pytest.raises(ValueError, match="--scheme must be one of dynamic, weight-only"):
        Fp8Config(work_dir=out, scheme="static")
    with pytest.raises(WorkDirError, match="not empty"):
        quantize_fp8(lite_tiny_llama, Fp8Config(work_dir=out, device="cpu"))
    with pytest.raises(ValueError, match="already quantized|quantization_config"):  # an FP8 checkpoint as input
        quantize_fp8(dynamic[0], Fp8Config(work_dir=tmp_path / "again", device="cpu"))
    assert not (tmp_path / "again").exists()
