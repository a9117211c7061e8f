"""FP4 checkpoints on the CPU engine, their e2m1 codes kept as they are in int4 panels with their block scales
(ops.h's Mxfp4 and Nvfp4 group heads), held to references that decode the format independently of lmkit (e2m1 from
the OCP table, NVFP4's E4M3 scales by torch's float8_e4m3fn over the global scale, MXFP4's as 2^(e - 127), in
float64; tests/factories.py fp4_reference):

- compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4A16 and NVFP4) and ``mxfp4-pack-quantized``
  (MXFP4A16, MXFP4), written by the library's own compressors; several families (biases, fused projections, Gemma's
  norms, experts one by one);
- NVIDIA ModelOpt's NVFP4 form (quant_method modelopt: ``weight`` U8, ``weight_scale_2`` a multiplier), written by
  hand to the layout compressed-tensors' own ModelOptNvfp4Converter reads (checked through it);
- transformers' ``from_pretrained`` of the same folder on the CPU where it loads it;
- configs and tensors we cannot serve are refused naming the field or tensor.

The engine's logits on the exact path (fp32 compute, fp32 activations) must match within 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmkit import EngineConfig, pipeline
from tests.factories import ARCH_CASES as CASES
from tests.factories import build_case, copy_folder, fp4_reference, without_cache_unless_attention, \
    write_compressed_tensors_fp4
from tests.helpers import logits_error, random_prompts, tensor_rewriter

ct = pytest.importorskip("compressed_tensors")

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False)
REL_TOL = 1e-4


def engine_vs_reference(out: Path, prompts, config: EngineConfig = EXACT, per_row: bool = True) -> float:
    """Largest relative error of the engine's logits on ``out``/fp4 against HF fp32 on ``out``/ref."""
    from transformers import AutoModelForCausalLM

    ref = without_cache_unless_attention(
        AutoModelForCausalLM.from_pretrained(str(out / "ref"), dtype=torch.float32).eval())
    return logits_error(out / "fp4", ref, prompts, config, per_row=per_row)


@pytest.mark.parametrize("fmt, activations", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False),
                                               ("mxfp4", True)])
def test_compressed_tensors_fp4(odd_llama, tmp_path, fmt, activations):
    out = write_compressed_tensors_fp4(odd_llama, tmp_path, fmt=fmt, activations=activations)
    assert engine_vs_reference(out, random_prompts(1)) <= REL_TOL
    with pipeline(out / "fp4", EXACT) as pipe:
        quant = pipe.engine.spec.quant
        assert quant.layout == f"{fmt}_pack_quantized" and quant.group_size == (16 if fmt == "nvfp4" else 32)
        assert quant.describe().startswith(f"compressed-tensors {fmt} (e2m1 weights")
        assert ("fp4 per" in quant.describe()) == activations


@pytest.mark.parametrize("case", ["qwen2", "phi3", "gemma3", "qwen3_moe"])
def test_nvfp4_every_family(case, tmp_path, tmp_path_factory):
    """Biases (Qwen2), fused qkv / gate_up read as parts (Phi-3), Gemma's norms, experts one by one beside a dense
    router (Qwen3-MoE): NVFP4A16 against HF fp32 on the decoded weights."""
    src = tmp_path_factory.mktemp(case)
    build_case(case, src)
    out = write_compressed_tensors_fp4(src, tmp_path)
    assert engine_vs_reference(out, random_prompts(CASES[case].seed)) <= REL_TOL


@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe"])
def test_nvfp4_global_scales_apart(case, tmp_path, tmp_path_factory):
    """Each linear with a global scale of its own (a writer that does not share them over q/k/v and gate/up, as
    llm-compressor does for vLLM): the fused projections cannot be one weight (their outputs' factors differ) and
    run as parts, a MoE's experts one by one; the same 1e-4."""
    src = tmp_path_factory.mktemp(case)
    build_case(case, src)
    out = write_compressed_tensors_fp4(src, tmp_path, fused_global=False)
    from safetensors import safe_open

    with safe_open(str(out / "fp4" / "model.safetensors"), "pt") as f:
        q, k = (f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight_global_scale") for p in "qk")
    assert q != k
    assert engine_vs_reference(out, random_prompts(CASES[case].seed + 1)) <= REL_TOL


def test_int8_activations(odd_llama, tmp_path):
    """The default int8-activation path on the NVFP4 and MXFP4 tiles: within the bound the int4 formats keep
    (tests/models/test_quant_formats.py: the rounding of activations and of the int8 lm_head)."""
    default = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                           max_batch_size=4, session_len=512)
    for fmt in ("nvfp4", "mxfp4"):
        out = write_compressed_tensors_fp4(odd_llama, tmp_path / fmt, fmt=fmt)
        err = engine_vs_reference(out, random_prompts(2), default, per_row=False)
        assert 0 < err <= 3e-2, (fmt, err)


@pytest.mark.parametrize("fmt, bound", [("mxfp4", REL_TOL), ("nvfp4", 2e-2)])
def test_transformers_loads_the_same_folder(odd_llama, tmp_path, fmt, bound):
    """transformers' from_pretrained of the folder on the CPU, decompressed by compressed-tensors (dequantize: its
    compressed forward is for GPUs), is the model the engine runs: exactly for MXFP4 (power-of-two scales), and for
    NVFP4 within the rounding of compressed-tensors' decompression, which divides each E4M3 scale by the global
    scale and multiplies in bf16 (its weights 1.7e-3 from the format's definition here; the engine's fp16 scales
    and fp32 global factor keep them exact, as the 1e-4 bound of test_compressed_tensors_fp4 shows)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = write_compressed_tensors_fp4(odd_llama, tmp_path, fmt=fmt)
    hf = AutoModelForCausalLM.from_pretrained(str(out / "fp4"), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True))
    hf = hf.float().eval()  # compressed-tensors decompresses NVFP4 into bf16 tensors
    assert logits_error(out / "fp4", hf, random_prompts(3), EXACT) <= bound


# ---- what is refused, naming the field or tensor

def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"]["config_groups"]["group_0"])
    path.write_text(json.dumps(cfg))


def test_mxfp4_scales_stored_as_e8m0(odd_llama, tmp_path):
    """MXFP4 scales stored as safetensors F8_E8M0 (torch's float8_e8m0fnu) rather than U8: the same bytes, the same
    model."""
    from safetensors.torch import load_file, save_file

    out = write_compressed_tensors_fp4(odd_llama, tmp_path, fmt="mxfp4")
    st = out / "fp4" / "model.safetensors"
    tensors = load_file(str(st))
    save_file({k: v.view(torch.float8_e8m0fnu) if k.endswith("weight_scale") else v for k, v in tensors.items()},
              str(st))
    assert engine_vs_reference(out, random_prompts(6)) <= REL_TOL
    from lmkit.lite.checkpoint import load_causal_lm  # lite's torch reference reads the exponents as bytes too

    assert logits_error(out / "fp4", load_causal_lm(out / "fp4"), random_prompts(6), EXACT) <= REL_TOL


@pytest.mark.parametrize("field, value, message", [
    ("group_size", 32, "strategy 'tensor_group' with group_size 32 is not NVFP4"),
    ("actorder", "group", "weights.actorder='group' is not supported for NVFP4"),
    ("type", "int", "4-bit int is not supported with format 'nvfp4-pack-quantized'"),
    ("symmetric", False, "weights.symmetric=false"),
])
def test_unservable_nvfp4_configs(odd_llama, tmp_path, field, value, message):
    out = write_compressed_tensors_fp4(odd_llama, tmp_path)
    _edit_config(out / "fp4", lambda group: group["weights"].update({field: value}))
    with pytest.raises(ValueError, match=message):
        pipeline(out / "fp4", EXACT)


def test_broken_nvfp4_tensors_name_the_tensor(odd_llama, tmp_path):
    """A missing global scale, a global scale of 0, a NaN block scale, a packed weight of the wrong shape: each
    refused naming the tensor, nothing served."""
    out = write_compressed_tensors_fp4(odd_llama, tmp_path)
    st = out / "fp4" / "model.safetensors"
    key = "model.layers.0.self_attn.q_proj."
    good, broken = tensor_rewriter(st, key)

    broken(weight_global_scale=None)
    with pytest.raises(ValueError, match="NVFP4 layer model.layers.0.self_attn.q_proj has no weight_global_scale"):
        pipeline(out / "fp4", EXACT)
    broken(weight_global_scale=torch.zeros(1))
    with pytest.raises(ValueError, match=r"layers.0.q_proj.weight_global_scale is 0; it must be positive"):
        pipeline(out / "fp4", EXACT)
    nan = good[key + "weight_scale"].view(torch.uint8).clone()
    nan[5, 3] = 0x7F
    broken(weight_scale=nan.view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"layers.0.q_proj.weight_scale\[5, 3\] is NaN"):
        pipeline(out / "fp4", EXACT)
    broken(weight_packed=good[key + "weight_packed"][:, :-16].contiguous())
    with pytest.raises(ValueError, match=r"layers.0.q_proj.weight_packed has shape \[192, 80\]"):
        pipeline(out / "fp4", EXACT)


# ---- NVIDIA ModelOpt's NVFP4 form (quant_method modelopt): the same codes and block scales, weight_scale_2 a
# multiplier


def write_modelopt_nvfp4(src: Path, out: Path, *, in_config: bool = True) -> Path:
    """``out``/fp4 in ModelOpt's NVFP4 layout, written by hand from compressed-tensors' own NVFP4 checkpoint of
    ``src`` (tests/factories.py) as its ModelOptNvfp4Converter reads it backwards: weight_packed -> weight (U8),
    weight_scale as is (E4M3), 1 / weight_global_scale -> weight_scale_2 (F32, a scalar), an input_scale scalar per
    linear; quantization_config quant_method modelopt, quant_algo NVFP4 in config.json (``in_config``) or, as older
    exports do, only in hf_quant_config.json. ``out``/ref: fp32 weights decoded in float64 with weight_scale_2 as a
    multiplier."""
    from safetensors.torch import load_file

    write_compressed_tensors_fp4(src, out / "ct")
    tensors = load_file(str(out / "ct" / "fp4" / "model.safetensors"))
    modelopt, ref = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            multiplier = (1.0 / tensors[base + ".weight_global_scale"].double()).float().reshape(())
            modelopt[base + ".weight"] = t
            modelopt[base + ".weight_scale"] = tensors[base + ".weight_scale"]
            modelopt[base + ".weight_scale_2"] = multiplier
            modelopt[base + ".input_scale"] = torch.tensor(0.01)
            ref[base + ".weight"] = fp4_reference(t, tensors[base + ".weight_scale"], 16,
                                                  1.0 / multiplier.double().item())
        elif not name.endswith((".weight_scale", ".weight_global_scale")):
            modelopt[name] = ref[name] = t
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
          "ignore": ["lm_head"], "producer": {"name": "modelopt", "version": "0.37.0"}}
    copy_folder(src, out / "fp4", modelopt, qc if in_config else None)
    if not in_config:
        (out / "fp4" / "hf_quant_config.json").write_text(json.dumps(
            {"producer": qc["producer"], "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                         "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    copy_folder(src, out / "ref", ref, None)
    return out


def test_modelopt_layout_is_what_compressed_tensors_converts():
    """The hand-written ModelOpt tensors, through compressed-tensors' own ModelOptNvfp4Converter, are the
    compressed-tensors NVFP4 tensors they came from (the global scale within fp32's rounding of a reciprocal)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    g = generate_gparam(w.amin(), w.amax())
    scale, zp = calculate_qparams(w.reshape(64, 6, 16).amin(-1), w.reshape(64, 6, 16).amax(-1), scheme.weights,
                                  global_scale=g)
    ct_tensors = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp,
                                                 "weight_global_scale": g}, scheme)
    modelopt = {"model.layers.0.mlp.down_proj.weight": ct_tensors["weight_packed"],
                "model.layers.0.mlp.down_proj.weight_scale": ct_tensors["weight_scale"],
                "model.layers.0.mlp.down_proj.weight_scale_2": (1.0 / g.double()).float().reshape(()),
                "model.layers.0.mlp.down_proj.input_scale": torch.tensor(0.01)}
    back = ModelOptNvfp4Converter(targets=["re:.*down_proj$"]).process(dict(modelopt))
    base = "model.layers.0.mlp.down_proj."
    assert torch.equal(back[base + "weight_packed"], ct_tensors["weight_packed"])
    assert torch.equal(back[base + "weight_scale"].view(torch.uint8), ct_tensors["weight_scale"].view(torch.uint8))
    torch.testing.assert_close(back[base + "weight_global_scale"].reshape(1).float(), g, rtol=1e-6, atol=0)


@pytest.mark.parametrize("in_config", [True, False])
def test_modelopt_nvfp4(odd_llama, tmp_path, in_config):
    """ModelOpt's NVFP4 (config.json's quantization_config, or only hf_quant_config.json as older exports): the
    engine against HF fp32 on the float64 decoding, 1e-4; its FP4 activations named, not applied."""
    out = write_modelopt_nvfp4(odd_llama, tmp_path, in_config=in_config)
    assert engine_vs_reference(out, random_prompts(7)) <= REL_TOL
    with pipeline(out / "fp4", EXACT) as pipe:
        quant = pipe.engine.spec.quant
        assert quant.layout == "nvfp4_modelopt" and quant.describe().startswith("modelopt nvfp4 (e2m1 weights")
        assert "fp4 per 16" in quant.describe()


def test_modelopt_scales_of_excluded_layers_and_lite(odd_llama, tmp_path):
    """A ModelOpt folder whose attention stays bf16 but keeps its FP8 KV scales loads (the scales are not applied);
    lmkit lite refuses a folder whose quantization is declared in hf_quant_config.json only, as quantized."""
    from safetensors.torch import load_file, save_file

    from lmkit.lite import Fp4Config, quantize_fp4

    out = write_modelopt_nvfp4(odd_llama, tmp_path, in_config=False)
    st = out / "fp4" / "model.safetensors"
    tensors = load_file(str(st))
    base = "model.layers.0.self_attn.k_proj."
    tensors[base + "weight"] = load_file(str(out / "ref" / "model.safetensors"))[base + "weight"]
    for name in ("weight_scale", "weight_scale_2", "input_scale"):
        del tensors[base + name]
    tensors[base + "k_scale"] = torch.tensor(1.0)
    save_file(tensors, str(st))
    assert engine_vs_reference(out, random_prompts(8)) <= REL_TOL
    with pytest.raises(ValueError, match="already quantized|quantization_config"):
        quantize_fp4(out / "fp4", Fp4Config(work_dir=tmp_path / "again", device="cpu"))


@pytest.mark.parametrize("algo, message", [("FP8", "quant_algo='FP8' is not supported"),
                                           ("MIXED_PRECISION", "quant_algo='MIXED_PRECISION' is not supported"),
                                           ("NVFP4-null-group", "group_size=None is not NVFP4's 16")])
def test_modelopt_algorithms_not_read(odd_llama, tmp_path, algo, message):
    out = write_modelopt_nvfp4(odd_llama, tmp_path)
    path = out / "fp4" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["quant_algo"] = algo.split("-")[0]
    if algo.endswith("null-group"):
        cfg["quantization_config"]["group_size"] = None
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        pipeline(out / "fp4", EXACT)
