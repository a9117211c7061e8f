"""AWQ end to end on tiny random Llama and Qwen2: the checkpoint has the AutoAWQ GEMM layout, reads back
through the unpacker to exactly the weights the quantizer computed, can be rebuilt from the saved search
results, and a checkpoint packed by hand (as another AWQ tool would) loads through the same reader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmkit.lite.apply import fold_scales
from lmkit.lite.awq import quantize_awq
from lmkit.models import get_awq_map
from lmkit.lite.checkpoint import load_causal_lm, read_state_dict
from lmkit.lite.config import AwqConfig, PplConfig
from lmkit.lite.export import COMPLETE_MARKER
from lmkit.lite.ppl import evaluate_perplexity
from lmkit.lite.quantizer import quantize
from tests.factories import make_tiny_model
from tests.helpers import TINY_CALIB


@pytest.mark.parametrize("model_fixture,options", [("lite_tiny_llama", {}), ("lite_tiny_qwen2", {}),
                                                   ("lite_tiny_llama", {"rounding": "nearest"}),
                                                   ("lite_tiny_llama", {"gptq_model_target": 0, "gptq_order": "none"}),
                                                   ("lite_tiny_qwen2", {"refine": True, "propagate": "fp"})])
def test_checkpoint_reads_back_exactly(request, tmp_path, model_fixture, options):
    source = request.getfixturevalue(model_fixture)
    out = tmp_path / "awq"
    result = quantize_awq(source, AwqConfig(work_dir=out, w_group_size=32, format="autoawq", **TINY_CALIB, **options),
                          keep_pseudo_quantized=True)
    assert result.method == "awq" and result.num_layers == 2 and out.is_dir()
    assert (out / COMPLETE_MARKER).is_file() and not list(tmp_path.glob(".awq.tmp-*"))

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32,
                                             "zero_point": True}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file()
    tensors = load_file(out / "model.safetensors")
    arch = get_awq_map(config["architectures"][0])
    src_config = json.loads((source / "config.json").read_text())
    for i in range(2):
        for name in arch.linears:
            key = f"model.layers.{i}.{name}"
            assert f"{key}.weight" not in tensors
            qweight, qzeros, scales = tensors[f"{key}.qweight"], tensors[f"{key}.qzeros"], tensors[f"{key}.scales"]
            assert qweight.dtype == torch.int32 and qzeros.dtype == torch.int32 and scales.dtype == torch.float16
            in_f, out_f = qweight.shape[0], scales.shape[1]
            assert qweight.shape == (in_f, out_f // 8) and qzeros.shape == (in_f // 32, out_f // 8)
            assert scales.shape == (in_f // 32, out_f)
        has_bias = src_config["model_type"] == "qwen2"
        assert (f"model.layers.{i}.self_attn.q_proj.bias" in tensors) == has_bias
    assert all(t.dtype in (torch.int32, torch.float16) for t in tensors.values())

    state, settings = read_state_dict(out)
    assert settings["group_size"] == 32
    assert set(result.pseudo_quantized) == {k for k in state if k.endswith("proj.weight")}
    for name, expected in result.pseudo_quantized.items():
        assert torch.equal(state[name], expected), name

    report = json.loads((out / "awq" / "report.json").read_text())
    assert len(report["layers"]) == 2 and report["settings"]["w_group_size"] == 32
    search = load_file(out / "awq" / "search.safetensors")
    assert any(k.startswith("scales/") for k in search) and any(k.startswith("clip/") for k in search)

    fp = evaluate_perplexity(source, PplConfig(dataset="pydoc", seqlen=64, max_tokens=512))
    q = evaluate_perplexity(out, PplConfig(dataset="pydoc", seqlen=64, max_tokens=512))
    assert fp.kind == "fp" and q.kind == "awq" and q.num_tokens == fp.num_tokens == 8 * 63
    assert abs(q.ppl / fp.ppl - 1) < 0.5  # random weights: same ballpark, not a quality claim


@torch.no_grad()
def test_observer_pairs_each_token_with_the_fp_models(lite_tiny_llama):
    """A run with a reference stream: the observer's ``drift`` of a group is sum_t (r_t - x_t) x_t^T of the inputs its
    first linear sees at the same token in the reference pass (r) and in the main pass (x), each taken from
    plain runs of the layer (float64 reference; with bf16 operands within 2% of its largest element); the hessian
    and the other statistics are the main pass's alone, fp32 either way."""
    from lmkit.lite.blocks import Discard, LayerRunner
    from lmkit.lite.layerwise import LayerwiseModel
    from lmkit.lite.observer import GroupInputObserver

    lw = LayerwiseModel(lite_tiny_llama, torch.device("cpu"))
    ids = torch.randint(0, 250, (3, 24), generator=torch.Generator().manual_seed(5))
    reference = lw.embed(ids)
    x = reference + 0.1 * reference.std() * torch.randn(reference.shape, generator=torch.Generator().manual_seed(6))
    layer, awq_map, runner = lw.load_layer(0), lw.layer_awq_map(0), LayerRunner(lw, 24)
    runner.chunk = 2  # two chunks: the pairing holds across them
    seen = {}
    for group in awq_map.groups:
        linear = layer.get_submodule(group.linears[0])
        inputs = []
        handle = linear.register_forward_hook(
            lambda m, args, out, inputs=inputs: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
        for stream in (reference, x):
            runner.run(layer, 0, stream.clone(), Discard())
        handle.remove()
        seen[group.linears[0]] = (torch.cat(inputs[:2]), torch.cat(inputs[2:]))
    observer = GroupInputObserver(layer, awq_map, 32, 1, with_moments=True, with_hessian=True,
                                  paired=[True] * len(awq_map.groups))
    ref_out = reference.clone()
    runner.run(layer, 0, x.clone(), Discard(), observer, reference=(ref_out, ref_out))
    observer.remove()
    rounded = GroupInputObserver(layer, awq_map, 32, 1, with_moments=True, with_hessian=True,
                                 paired=[True] * len(awq_map.groups), drift_dtype=torch.bfloat16)
    runner.run(layer, 0, x.clone(), Discard(), rounded, reference=(reference.clone(), reference.clone()))
    rounded.remove()
    for group, stats, bf16 in zip(awq_map.groups, observer.stats, rounded.stats):
        r, got = seen[group.linears[0]]
        expected = (r - got).double().t() @ got.double()
        assert torch.allclose(stats.drift.double(), expected, rtol=1e-4, atol=1e-4), group.linears[0]
        scale = float(expected.abs().max())  # bf16 operands: each element within a few of bf16's steps of the sum
        assert float((bf16.drift.double() - expected).abs().max()) < 0.02 * scale, group.linears[0]
        assert not torch.equal(bf16.drift, stats.drift) and torch.equal(bf16.hessian, stats.hessian)
        assert torch.allclose(stats.hessian, got.t() @ got, rtol=1e-4, atol=1e-3), group.linears[0]
        assert stats.num_tokens == 3 * 24 and not stats.references
    assert not torch.allclose(ref_out, reference)  # the reference stream moved on to the layer's output


@torch.no_grad()
def test_bf16_linears_multiply_rounded_operands_and_leave_the_rest_fp32(lite_tiny_llama):
    """With compute_dtype bfloat16 each linear's output is the float64 product of its bf16-rounded input and weight
    (to bf16's output rounding), cast back to float32; the hooks see the float32 input; after the run the layer
    computes in float32 again, bit for bit as before."""
    from lmkit.lite.blocks import LayerRunner, linears_in
    from lmkit.lite.layerwise import LayerwiseModel

    lw = LayerwiseModel(lite_tiny_llama, torch.device("cpu"))
    x = lw.embed(torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(7)))
    layer = lw.load_layer(0)
    fp32 = torch.full_like(x, float("nan"))
    LayerRunner(lw, 16).run(layer, 0, x, fp32)
    seen = []
    handle = layer.mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    bf16 = torch.full_like(x, float("nan"))
    LayerRunner(lw, 16, torch.bfloat16).run(layer, 0, x, bf16)
    handle.remove()
    (given, out), = seen
    assert given.dtype == out.dtype == torch.float32
    weight = layer.mlp.down_proj.weight
    expected = given.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().t()
    assert torch.allclose(out.double(), expected, rtol=2**-7, atol=1e-6 * float(expected.abs().max()))
    assert not torch.equal(bf16, fp32) and torch.allclose(bf16, fp32, rtol=0.05, atol=0.05 * float(fp32.abs().max()))
    again = torch.full_like(x, float("nan"))
    LayerRunner(lw, 16).run(layer, 0, x, again)
    assert torch.equal(again, fp32) and "forward" not in vars(layer.mlp.down_proj)
    with pytest.raises(ZeroDivisionError), linears_in(layer, torch.bfloat16, ["mlp.down_proj"]):
        raise ZeroDivisionError  # the class's forward is back after an error too
    assert "forward" not in vars(layer.mlp.down_proj)
    own = layer.mlp.up_proj.forward = lambda v: torch.zeros(())  # an instance's own forward is given back
    with linears_in(layer, torch.bfloat16, ["mlp.up_proj", "mlp.down_proj"]):
        assert layer.mlp.up_proj.forward is not own
    assert layer.mlp.up_proj.forward is own and "forward" not in vars(layer.mlp.down_proj)
    del layer.mlp.up_proj.forward


def test_calibration_precision_auto_follows_the_cpu_and_the_report_says_which(lite_tiny_llama, tmp_path):
    """auto = bf16 where lmkit's engine finds AVX512_BF16 (else fp32) and report.json names what ran; an unknown value
    is refused naming the choices; a bf16 calibration's KL from the fp model on held-out text is the fp32 one's
    within a third and below RTN's (measured 0.026 / 0.027 / 0.047; the SmolLM2 test in test_smollm2 runs the
    default, auto, against plain AWQ and RTN: bf16 on such a CPU)."""
    from lmkit._ext import _engine
    from lmkit.lite.config import KlConfig, resolve_calib_dtype
    from lmkit.lite.kl import kl_divergence

    cpu = torch.device("cpu")
    native = _engine.cpu_bf16_available()
    assert resolve_calib_dtype("fp32", cpu) == torch.float32 and resolve_calib_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="auto, fp32, bf16"):
        AwqConfig(work_dir=tmp_path / "x", calib_precision="fp16")
    kl = {}
    for precision in ("auto", "fp32", "bf16", "rtn"):
        options = dict(calib_samples=0) if precision == "rtn" else dict(calib_precision=precision, **TINY_CALIB)
        options["device"] = "cpu"  # auto would pick a GPU where there is one, and resolve by it
        result = quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / precision, **options))
        report = json.loads((result.work_dir / "awq" / "report.json").read_text())
        ran = {"auto": "bf16" if native else "fp32", "rtn": "auto"}.get(precision, precision)
        assert report["settings"]["calib_precision"] == ran  # RTN runs no calibration pass: nothing resolved
        kl[precision] = kl_divergence(lite_tiny_llama, result.work_dir,
                                      KlConfig(dataset="hamlet", seqlen=64, max_tokens=512)).mean_kl
    assert 0.75 * kl["fp32"] < kl["bf16"] < 1.33 * kl["fp32"] and kl["bf16"] < 0.8 * kl["rtn"], kl


def test_checkpoint_is_reproducible_from_search_results(lite_tiny_llama, tmp_path):
    """Phase separation: fp weights + saved scales + saved clip ranges -> the exact packed integers (with
    round-to-nearest; GPTQ rounding also depends on the inputs' second moments, which are not saved)."""
    out = tmp_path / "awq"
    quantize_awq(lite_tiny_llama, AwqConfig(work_dir=out, w_group_size=32, format="autoawq", refine=False, rounding="nearest",
                                            **TINY_CALIB))
    search = load_file(out / "awq" / "search.safetensors")
    state, _ = read_state_dict(out)
    fp_model = load_causal_lm(lite_tiny_llama)
    awq_map = get_awq_map("LlamaForCausalLM")
    for i, layer in enumerate(fp_model.model.layers):
        for group in awq_map.groups:
            key = f"scales/model.layers.{i}.{group.prev}"
            if key in search:
                fold_scales(layer, group, search[key])
        for name in awq_map.linears:
            full = f"model.layers.{i}.{name}"
            w_min, w_max = search.get(f"clip/{full}.min"), search.get(f"clip/{full}.max")
            expected = quantize(layer.get_submodule(name).weight, 32, w_min, w_max).dequantize()
            assert torch.equal(state[full + ".weight"], expected), full
        assert torch.equal(state[f"model.layers.{i}.input_layernorm.weight"],
                           layer.input_layernorm.weight.half().float())


def test_rtn_and_ablations(lite_tiny_llama, tmp_path):
    rtn = quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "rtn", w_group_size=64, format="autoawq", calib_samples=0),
                       keep_pseudo_quantized=True)
    assert rtn.method == "rtn" and not (tmp_path / "rtn" / "awq" / "search.safetensors").exists()
    fp = load_causal_lm(lite_tiny_llama)
    for name, w in rtn.pseudo_quantized.items():
        assert torch.equal(w, quantize(fp.get_parameter(name), 64).dequantize())
    plain = quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "plain", w_group_size=64, format="autoawq", search_scale=False,
                                                    clip=False, refine=False, rounding="nearest", **TINY_CALIB),
                         keep_pseudo_quantized=True)
    for name, w in plain.pseudo_quantized.items():  # no search, no clip, nearest rounding: AWQ degenerates to RTN
        assert torch.equal(w, rtn.pseudo_quantized[name])
    report = json.loads((tmp_path / "plain" / "awq" / "report.json").read_text())
    assert all(not g["smoothed"] for layer in report["layers"] for g in layer["groups"])


def _hand_pack(values):
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows = []
    for row in values:
        words = []
        for c in range(len(row) // 8):
            word = sum(row[8 * c + order[k]] << (4 * k) for k in range(8))
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def test_reads_a_checkpoint_packed_by_another_tool(tmp_path):
    """A hand-made AWQ GEMM checkpoint (integers, zeros, fp16 scales chosen here; lm_head left fp as
    modules_to_not_convert) loads with W^T[i, j] = (q[i, j] - z[i/g, j]) * s[i/g, j]."""
    folder = tmp_path / "other"
    model = make_tiny_model(folder, "llama", intermediate_size=128)
    g = torch.Generator().manual_seed(5)
    gs = 32
    tensors, expected = {}, {}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if ".layers." in name and name.endswith("proj.weight"):
                out_f, in_f = t.shape
                q = torch.randint(0, 16, (in_f, out_f), generator=g)
                z = torch.randint(0, 16, (in_f // gs, out_f), generator=g)
                s = (torch.rand(in_f // gs, out_f, generator=g) * 0.02 + 0.001).half()
                base = name[: -len(".weight")]
                tensors[base + ".qweight"] = _hand_pack(q.tolist())
                tensors[base + ".qzeros"] = _hand_pack(z.tolist())
                tensors[base + ".scales"] = s
                w_t = (q - z.repeat_interleave(gs, dim=0)).float() * s.float().repeat_interleave(gs, dim=0)
                expected[name] = w_t.t().contiguous()
            else:
                tensors[name] = t.half()
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "version": "GEMM", "bits": 4, "group_size": gs,
                                     "zero_point": True, "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))

    loaded = load_causal_lm(folder)
    for name, w in expected.items():
        assert torch.equal(loaded.get_parameter(name), w), name
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.half().float())
    ppl = evaluate_perplexity(folder, PplConfig(dataset="pydoc", seqlen=32, max_tokens=128))
    assert ppl.kind == "awq" and ppl.num_tokens == 4 * 31 and ppl.ppl > 1
