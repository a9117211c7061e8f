"""EngineConfig(quantization="int8"): a float checkpoint's attention, MLP and expert projections (and, with int8
activations, its lm_head) rounded to int8 per 32 inputs as it loads, held to HF fp32 on the same checkpoint whose
projections a torch reimplementation of the rule rounds (llama.cpp's Q8_0: d = fp16(max|w| / 127) per 32 inputs,
q = w / d rounded half to even, clamped to +-127): routers, gates and embeddings stay as stored.

The engine's logits on the exact path (fp32 compute, fp32 activations) must match within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lmkit import EngineConfig, pipeline
from tests.factories import ARCH_CASES as CASES
from tests.factories import build_case, copy_folder, without_cache_unless_attention, \
    write_compressed_tensors
from tests.helpers import logits_error, random_prompts

EXACT = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                     max_batch_size=4, session_len=512, int8_activations=False, quantization="int8")
PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "qkv_proj.weight",
               "gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj.weight", "out_proj.weight",
               "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def q8_0_rounded(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] rounded as llama.cpp's Q8_0 rounds it, back in float32."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    q = torch.where(d == 0, torch.zeros_like(blocks), torch.clamp(torch.round(blocks / d), -127, 127))
    return (q * d).reshape(n, k)


def rounded_reference(src, out):
    """HF fp32 of ``src`` with every projection rounded by q8_0_rounded (a copy in ``out``)."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(src / "model.safetensors"))
    rounded = {name: q8_0_rounded(t) if name.endswith(PROJECTIONS) and t.ndim == 2 and t.shape[1] % 32 == 0
               else t for name, t in tensors.items()}
    assert any(not torch.equal(rounded[n], tensors[n]) for n in tensors)
    copy_folder(src, out, rounded, None)
    return without_cache_unless_attention(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval())


@pytest.mark.parametrize("case", ["llama", "qwen2", "phi3", "gemma3", "qwen3_moe", "qwen3_5"])
def test_projections_rounded_as_q8_0(case, odd_llama, tmp_path, tmp_path_factory):
    """Biases (Qwen2), fused qkv / gate_up (Phi-3), Gemma's norms, experts one by one beside a router that stays
    as stored (Qwen3-MoE), Gated DeltaNet projections and a gated q_proj (Qwen3.5): the engine against HF fp32 on
    the rounded projections, 1e-4."""
    if case == "llama":
        src = odd_llama
    else:
        src = tmp_path_factory.mktemp(case)
        build_case(case, src)
    ref = rounded_reference(src, tmp_path / "ref")
    seed = CASES[case].seed if case in CASES else 1
    assert logits_error(src, ref, random_prompts(seed), EXACT) <= 1e-4


def test_int8_activations_and_bytes(odd_llama, tmp_path):
    """The default int8 activations (and the lm_head in int8 with them): within the bound the int8 checkpoints keep;
    the packed linears take about a quarter of the fp32 ones' bytes."""
    default = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                           max_batch_size=4, session_len=512, quantization="int8")
    ref = rounded_reference(odd_llama, tmp_path / "ref")
    err = logits_error(odd_llama, ref, random_prompts(2), default, per_row=False)
    assert 0 < err <= 3e-2
    sizes = {}
    for quantization in ("none", "int8"):
        config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, session_len=512,
                              quantization=quantization)
        with pipeline(odd_llama, config) as pipe:
            sizes[quantization] = pipe.engine.linear_weight_bytes
    assert sizes["int8"] < 0.3 * sizes["none"], sizes


def test_what_is_refused(odd_llama, tmp_path):
    """A checkpoint quantized already, a quantization lmkit has no kernels for, and the GPU: refused by name."""
    with pytest.raises(ValueError, match="quantization must be none or int8, got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU backend"):
        EngineConfig(device="cuda", quantization="int8")
    out = write_compressed_tensors(odd_llama, tmp_path, group=64, symmetric=True)
    with pytest.raises(ValueError, match="is quantized already .*leave quantization='none'"):
        pipeline(out / "int4", EngineConfig(device="cpu", quantization="int8"))
    # a config that declares a quantization lmkit reads per tensor (gpt-oss's MXFP4 experts): refused too
    declared = tmp_path / "declared"
    copy_folder(odd_llama, declared, load_file(str(odd_llama / "model.safetensors")), {"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="declares a quantization_config \\(quant_method 'mxfp4'\\)"):
        pipeline(declared, EngineConfig(device="cpu", quantization="int8"))


def test_the_memory_check_counts_int8_projections(odd_llama):
    """The check before loading counts the float projections at their int8 size: near what the engine packs."""
    from lmkit.memory import checkpoint_weight_bytes
    from lmkit.models.loader import load_model_spec

    spec = load_model_spec(odd_llama)
    full, int8 = checkpoint_weight_bytes(spec), checkpoint_weight_bytes(spec, int8_at_load=True)
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, session_len=512,
                          int8_activations=False, quantization="int8")
    with pipeline(odd_llama, config) as pipe:
        packed = pipe.engine.linear_weight_bytes
    projections = sum(e.nbytes for role, e in spec.sources.items() if "_proj" in role)
    assert int8 < full and full - int8 == pytest.approx(projections * (1 - 17 / 64), rel=1e-6)
    assert int8 >= packed  # the estimate covers the packed linears (and the rest, as stored)


def test_the_memory_check_counts_what_the_engine_rounds():
    """Stacked experts ([E, N, K]), GGUF's *_exps and the Gated DeltaNet projections count at their int8 size;
    per-layer projections, routers and odd-sized projections as stored, as the engine packs them."""
    from types import SimpleNamespace

    from lmkit.memory import checkpoint_weight_bytes
    from lmkit.models.safetensors_index import TensorEntry

    def entry(dtype, *shape):
        return TensorEntry(path="x", offset=0, dtype=dtype, shape=tuple(shape))

    rounded = {"layers.0.q_proj": entry("BF16", 64, 128), "layers.0.experts.gate_up_proj": entry("BF16", 8, 256, 128),
               "layers.1.experts.down_exps": entry("F16", 8, 128, 128),
               "layers.0.experts.3.up_proj": entry("F32", 64, 96), "layers.2.in_proj_qkv": entry("BF16", 192, 128)}
    kept = {"layers.0.per_layer_projection": entry("BF16", 64, 128),
            "layers.0.router": entry("BF16", 8, 128), "layers.0.q_norm": entry("BF16", 64),
            "layers.0.o_proj": entry("BF16", 64, 48)}  # 48 inputs: no whole block of 32, stays as stored
    spec = SimpleNamespace(sources={**rounded, **kept})
    numel = 64 * 128 + 8 * 256 * 128 + 8 * 128 * 128 + 64 * 96 + 192 * 128
    assert checkpoint_weight_bytes(spec, int8_at_load=True) == numel * 17 // 16 + sum(e.nbytes for e in kept.values())
