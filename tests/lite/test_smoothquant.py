"""``lmkit lite smooth_quant`` (issue 25): SmoothQuant W8A8 int8 written as compressed-tensors int-quantized.

The checkpoint is the layout compressed-tensors' IntQuantizationCompressor writes (its decompressor reads back
the weights computed in memory, its compressor rebuilds the same int8 tensors); lmkit's engine serves it: on the
exact path (fp activations) within 1e-4 of HF fp32 on the decompressed weights, on the default int8-activation
path close to it; smoothing beats plain W8A8 on a model with activation outlier channels; bad input is a clear
error and leaves nothing behind."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from lmkit import EngineConfig
from lmkit.lite.checkpoint import fake_quantize_inputs, load_causal_lm, read_state_dict
from lmkit.lite.config import SmoothQuantConfig
from lmkit.lite.export import COMPLETE_MARKER, WorkDirError, w8a8_quantization_config
from lmkit.lite.gptq import gptq_quantize_int8
from lmkit.lite.int8 import QMAX, fake_quant_tokens, quantize_int8
from lmkit.lite.layerwise import AlreadyQuantizedError
from lmkit.lite.smoothquant import REPORT_DIR, quantize_smooth_quant, smoothing_scales
from tests.factories import MOE_CASES, make_arch_model, make_moe_model, make_tiny_model
from tests.helpers import TINY_CALIB, logits_error, random_prompts

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)
DEFAULT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                       max_batch_size=4, session_len=512)
TINY = dict(TINY_CALIB, device="cpu")


def _name(value) -> str:
    return str(getattr(value, "value", value))  # an enum or its value, by compressed-tensors' version


@pytest.fixture(scope="module")
def smoothed(lite_tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("sq") / "w8a8"
    result = quantize_smooth_quant(lite_tiny_llama, SmoothQuantConfig(work_dir=out, rounding="gptq", **TINY),
                                   keep_pseudo_quantized=True)  # GPTQ here, round-to-nearest (the default) elsewhere
    return out, result


# ---- pure math

def test_int8_weight_quantization_against_float64():
    w = torch.randn(24, 80, dtype=torch.float64) * torch.rand(24, 1, dtype=torch.float64) * 3
    w[5] = 0.0  # a zero row: the smallest fp16 scale, q = 0
    qw = quantize_int8(w.float())
    scale = qw.scales.double()
    assert qw.q.dtype == torch.int8 and qw.scales.dtype == torch.float16 and int(qw.q.abs().max()) <= QMAX
    expected = torch.round(w / scale.unsqueeze(1)).clamp(-QMAX, QMAX)
    assert torch.equal(qw.q.double(), expected)
    assert torch.allclose(scale[torch.arange(24) != 5], (w.abs().amax(1) / QMAX)[torch.arange(24) != 5], rtol=1e-3)
    assert not qw.q[5].any()
    assert torch.equal(qw.dequantize().double(), qw.q.double() * scale.unsqueeze(1))


def test_per_token_fake_quantization_matches_compressed_tensors():
    """The searches' per-token int8 and compressed-tensors' own fake quantization (the reference's) agree within
    one step of either grid (they divide max |x| by 127 and 127.5)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationConfig.model_validate(w8a8_quantization_config([])).config_groups["group_0"].input_activations
    x = torch.randn(5, 7, 64) * torch.rand(5, 7, 1) * 10
    scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    theirs = fake_quantize(x, scale, zero, args)
    ours = fake_quant_tokens(x)
    step = x.abs().amax(-1, keepdim=True) / QMAX
    x64, step64 = x.double(), step.double()
    q = torch.round(ours.double() / step64)  # ours is q * step, q an integer in [-127, 127]
    assert torch.allclose(ours.double(), q * step64, rtol=1e-6, atol=1e-9) and int(q.abs().max()) <= QMAX
    exact = x64 / step64
    # float32's x / step rounds the other way than float64's only at a tie (k + 1/2 within float32's precision)
    at_tie = ((exact.abs() % 1) - 0.5).abs() < 1e-5
    assert bool(((q == torch.round(exact).clamp(-QMAX, QMAX)) | at_tie).all())
    assert float(((ours - theirs).abs() / step).max()) <= 1.01
    assert float(((ours - x).abs() / step).max()) <= 0.5 + 1e-5


def test_smoothing_scales_formula():
    x_max = torch.tensor([1.0, 4.0, 0.0, 9.0])
    w = [torch.tensor([[1.0, 0.5, 2.0, 1.0]]), torch.tensor([[-4.0, 1.0, 1.0, 0.0]])]
    s = smoothing_scales(x_max, w, 0.5)
    raw = torch.tensor([1.0 / 2.0, 2.0 / 1.0, 1.0, 3.0 / 1.0])  # channel 2: no token reaches it -> 1
    raw = raw / (raw.max() * raw.min()).sqrt()
    assert torch.allclose(s, raw)


def test_gptq_int8_lowers_the_output_error():
    torch.manual_seed(0)
    x = torch.randn(512, 96) @ torch.randn(96, 96) * 0.3  # correlated inputs: where GPTQ helps
    w = torch.randn(48, 96)
    hessian = x.t() @ x
    nearest, gptq = quantize_int8(w), gptq_quantize_int8(w, hessian)
    assert torch.equal(gptq.scales, nearest.scales) and gptq.q.dtype == torch.int8
    err = {k: float(((x @ (q.dequantize() - w).t()) ** 2).sum()) for k, q in (("rtn", nearest), ("gptq", gptq))}
    assert err["gptq"] < 0.7 * err["rtn"], err


# ---- the checkpoint

def test_checkpoint_is_compressed_tensors_int8(smoothed, lite_tiny_llama):
    out, result = smoothed
    assert (out / COMPLETE_MARKER).is_file() and result.method == "smooth_quant"
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    scheme = parsed.config_groups["group_0"]
    assert qc["format"] == "int-quantized" and qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert (scheme.weights.num_bits, scheme.weights.symmetric, _name(scheme.weights.strategy)) == (8, True, "channel")
    acts = scheme.input_activations
    assert (acts.num_bits, acts.dynamic, _name(acts.strategy)) == (8, True, "token")

    with safe_open(out / "model.safetensors", framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    linears = sorted(result.pseudo_quantized)
    assert len(linears) == 2 * 7
    for name in linears:
        base = name[: -len(".weight")]
        q, scale = stored[name], stored[base + ".weight_scale"]
        assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (q.shape[0], 1)
        # the library's decompressor gives the weights computed in memory ...
        back = IntQuantizationCompressor.decompress({"weight": q, "weight_scale": scale.float()}, scheme)["weight"]
        assert torch.equal(back.float(), result.pseudo_quantized[name])
        # ... and its compressor, given them and the scale, writes the same int8 tensor
        again = IntQuantizationCompressor.compress({"weight": result.pseudo_quantized[name], "weight_scale": scale},
                                                   scheme)
        assert torch.equal(again["weight"], q)
    assert stored["lm_head.weight"].dtype == torch.float16

    report = json.loads((out / REPORT_DIR / "report.json").read_text())
    groups = [g for layer in report["layers"] for g in layer["groups"]]
    smoothed_groups = [g for g in groups if g["smoothed"]]
    assert smoothed_groups and all(0 <= g["alpha"] <= 1 and g["loss"] <= g["loss_identity"] for g in smoothed_groups)
    v_to_o = [g for g in groups if g["prev"] == "self_attn.v_proj"]
    assert v_to_o and all(not g["smoothed"] and "grouped-query" in g["reason"] for g in v_to_o)  # GQA
    with safe_open(out / REPORT_DIR / "search.safetensors", framework="pt") as f:
        assert len(list(f.keys())) == len(smoothed_groups)
    state, _ = read_state_dict(out)
    assert all(torch.equal(state[n], result.pseudo_quantized[n]) for n in linears)


def test_engine_serves_it(smoothed):
    out, _ = smoothed
    weights_only = load_causal_lm(out, quantize_activations=False)
    assert logits_error(out, weights_only, random_prompts(3), EXACT) <= 1e-4
    # the default engine quantizes activations per 32 values (finer than the checkpoint's per token)
    assert logits_error(out, weights_only, random_prompts(4), DEFAULT, per_row=False) <= 3e-2


def _build(case: str, folder):
    if case == "qwen2":
        make_tiny_model(folder, "qwen2", intermediate_size=128, tie_word_embeddings=True, dtype="bfloat16")
    elif case in MOE_CASES:
        config_class, overrides, _, _ = MOE_CASES[case]
        make_moe_model(folder, config_class, overrides)
    else:
        make_arch_model(folder, case)


@pytest.mark.parametrize("case", ["qwen2", "phi3", "gemma2", "smollm3", "qwen3_moe", "mixtral"])
def test_every_family(case, tmp_path):
    """Biases and tied embeddings in bf16 (Qwen2), fused qkv/gate_up (Phi-3), norms before and after each block
    scaling by 1 + w (Gemma 2), layers without RoPE (SmolLM3), experts with a router that takes the scale
    unquantized (Qwen3-MoE with a dense layer, Mixtral's block_sparse_moe names): the checkpoint loads and the
    exact path matches HF on its decompressed weights."""
    src = tmp_path / "src"
    _build(case, src)
    out = tmp_path / "w8a8"
    result = quantize_smooth_quant(src, SmoothQuantConfig(work_dir=out, **TINY))
    assert any(g["smoothed"] for layer in result.layers for g in layer["groups"])
    assert logits_error(out, load_causal_lm(out, quantize_activations=False), random_prompts(7), EXACT) <= 1e-4


def _with_outlier_channels(folder, channels=(3, 17, 40), factor=40.0):
    """Scale a few channels of every pre-block norm: the activations the linears read get outlier channels, as
    real LLMs' do (the model changes; both sides of the comparison quantize this model)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for name, value in tensors.items():
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            value[list(channels)] *= factor
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_smoothing_beats_plain_w8a8_on_outlier_channels(tmp_path):
    src = tmp_path / "outliers"
    make_tiny_model(src, "llama", intermediate_size=128)
    _with_outlier_channels(src)
    ids = torch.tensor(random_prompts(5)[2:])
    with torch.no_grad():
        want = load_causal_lm(src)(input_ids=ids).logits

    @torch.no_grad()
    def error(model) -> float:
        return float((model(input_ids=ids).logits - want).norm() / want.norm())

    plain = load_causal_lm(src)  # W8A8 without smoothing: int8 weights per channel, per-token activations
    names = set()
    for name, module in plain.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.weight.data = quantize_int8(module.weight.data).dequantize()
            names.add(name)
    scheme = QuantizationConfig.model_validate(w8a8_quantization_config([])).config_groups["group_0"]
    assert fake_quantize_inputs(plain, names, scheme) == len(names) == 14

    out = tmp_path / "sq"
    quantize_smooth_quant(src, SmoothQuantConfig(work_dir=out, rounding="nearest", **TINY))
    smooth, unsmoothed = error(load_causal_lm(out)), error(plain)
    # --no-smooth writes the plain W8A8 model
    result = quantize_smooth_quant(src, SmoothQuantConfig(work_dir=tmp_path / "plain", smooth=False,
                                                          rounding="nearest", **TINY))
    assert all(g["reason"] == "disabled" for layer in result.layers for g in layer["groups"])
    state, _ = read_state_dict(tmp_path / "plain")
    assert all(torch.equal(state[n + ".weight"], plain.get_submodule(n).weight) for n in names)
    print(f"relative logit error: SmoothQuant {smooth:.4f}, plain W8A8 {unsmoothed:.4f}")
    assert smooth < 0.5 * unsmoothed, (smooth, unsmoothed)
    assert logits_error(out, load_causal_lm(out, quantize_activations=False), random_prompts(6), EXACT) <= 1e-4


def test_given_alpha_is_used_everywhere(lite_tiny_llama, tmp_path):
    result = quantize_smooth_quant(lite_tiny_llama, SmoothQuantConfig(work_dir=tmp_path / "a", alpha=0.5, **TINY))
    foldable = [g for layer in result.layers for g in layer["groups"] if "reason" not in g]
    assert foldable and all(g["smoothed"] and g["alpha"] == 0.5 for g in foldable)
    assert all(math.isinf(g["loss_identity"]) for g in foldable)  # no smoothing was not a candidate


def test_perplexity_report_and_cli(lite_tiny_llama, tmp_path):
    from lmkit.cli.main import app

    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["lite", "smooth_quant", str(lite_tiny_llama), "--work-dir", str(out),
                                      "--calib-dataset", "pydoc", "--calib-samples", "8", "--calib-seqlen", "64",
                                      "--search-samples", "4", "--device", "cpu", "--eval", "--eval-dataset", "pydoc"])
    assert result.exit_code == 0, result.output
    for text in ("SmoothQuant W8A8 int8", "groups smoothed", "(searched)", "nearest rounding", "perplexity", "size"):
        assert text in result.output, (text, result.output)
    report = json.loads((out / REPORT_DIR / "report.json").read_text())
    before, after = report["ppl_before"]["ppl"], report["ppl_after"]["ppl"]
    assert 1 < before and 1 < after and abs(after / before - 1) < 0.05  # int8 on a random model: a small change
    # W8A8 against the source's next-token distributions: int8 weights and activations move them a little
    assert 0 < report["kl"]["mean_kl"] < 0.05 and report["kl"]["same_top1"] > 0.5, report["kl"]
    assert "KL from the source" in result.output

    result = CliRunner().invoke(app, ["lite", "ppl", str(out), "--dataset", "pydoc", "--seqlen", "64",
                                      "--max-tokens", "256", "--device", "cpu"])
    assert result.exit_code == 0 and "compressed-tensors" in result.output, result.output


# ---- bad input

def test_bad_input_is_clear_and_leaves_nothing(smoothed, lite_tiny_llama, tmp_path):
    from lmkit.lite.convert import convert_checkpoint

    out, _ = smoothed
    with pytest.raises(AlreadyQuantizedError, match="already quantized .*compressed-tensors"):
        quantize_smooth_quant(out, SmoothQuantConfig(work_dir=tmp_path / "again", **TINY))
    with pytest.raises(ValueError, match="--alpha must be in"):
        SmoothQuantConfig(work_dir=tmp_path / "x", alpha=1.5)
    with pytest.raises(ValueError, match="--calib-samples must be >= 1"):
        SmoothQuantConfig(work_dir=tmp_path / "x", calib_samples=0)
    with pytest.raises(ValueError, match="int8 checkpoint .* int4 formats only"):
        convert_checkpoint(out, tmp_path / "conv", "autoawq")
    odd = tmp_path / "odd"
    make_tiny_model(odd, "llama", intermediate_size=200)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj has 200 input channels: .* multiple of 32"):
        quantize_smooth_quant(odd, SmoothQuantConfig(work_dir=tmp_path / "odd-out", **TINY))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("user data")
    with pytest.raises(WorkDirError, match="not empty"):
        quantize_smooth_quant(lite_tiny_llama, SmoothQuantConfig(work_dir=busy, **TINY))
    assert (busy / "keep.txt").read_text() == "user data"
    assert not list(tmp_path.glob(".*tmp-*")) and not (tmp_path / "again").exists()
    assert not (tmp_path / "odd-out").exists()
