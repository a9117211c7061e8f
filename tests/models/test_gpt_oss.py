"""gpt-oss's experts in MXFP4 as shipped (``*_blocks`` / ``*_scales``, quantization_config quant_method mxfp4): the
engine packs the codes and scales as they are (int4 panels with MXFP4 heads, 4.25 bits a weight) and must give the logits of HF fp32 with
the experts that transformers' own MXFP4 dequantizer (``convert_moe_packed_tensors``) makes of the same bytes.

The float model is tests/factories.py's ``gpt_oss`` case (its attention sinks, windows and clamped SwiGLU are
checked against HF in tests/models/test_architectures.py); here its experts are rounded to MXFP4 and written as the
hub checkpoints hold them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import build_case
from tests.helpers import hf_greedy

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(w: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of w [..., K] rounded to MXFP4: (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8). Each block's
    scale 2^e with e drawn from the power that fits its largest value and the next two above (codes of every size,
    8 and 15 included); codes the nearest e2m1 value, the sign in bit 3, value 2j in byte j's low nibble."""
    *lead, k = w.shape
    x = w.reshape(*lead, k // 32, 32).double()
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)) + torch.from_numpy(rng.integers(0, 3, size=amax.shape))
    mag = (x.abs() / torch.exp2(exp)).clamp(max=6.0)
    code = (mag[..., None] - E2M1.double()).abs().argmin(-1).to(torch.uint8)
    code |= ((x < 0) & (code > 0)).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp[..., 0] + 127).to(torch.uint8).contiguous()


def write_mxfp4(fp, ref, folder) -> None:
    """The float gpt-oss folder ``fp`` (HF model ``ref``) with its experts rounded to MXFP4 into ``folder``, and
    ``ref``'s experts set to what transformers' own dequantizer makes of the written blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for f in fp.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    tensors = load_file(str(fp / "model.safetensors"))
    rng = np.random.default_rng(0)
    for i, layer in enumerate(ref.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            # stored outputs first ([E, out, in]), as the hub's blocks are; transformers holds [E, in, out]
            blocks, scales = to_mxfp4(tensors.pop(key).transpose(1, 2).contiguous(), rng)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(MXFP4 folder, HF fp32 reference with the experts transformers dequantizes from its blocks)."""
    fp = tmp_path_factory.mktemp("gpt_oss_fp")
    ref = build_case("gpt_oss", fp)
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4(fp, ref, folder)
    return folder, ref


def open_pipeline(folder, **config):
    base = dict(device="cpu", dtype="float32", cache_block_seq_len=16, max_batch_size=4, session_len=256,
                int8_activations=False)
    return pipeline(folder, EngineConfig(**{**base, **config}))


PROMPTS = [[5, 77, 123, 9, 41, 200, 13], list(range(30, 90, 2))]


def test_mxfp4_experts_give_hf_logits(mxfp4_model):
    """Every logit row within 1e-4 relative of HF with transformers' dequantized experts, greedy token-identical
    (fp32 activations: the blocks are exact in the engine's int8 layout); with int8 activations (the default) within
    the activations' rounding."""
    folder, ref = mxfp4_model
    gen = GenerationConfig(max_new_tokens=16, output_logits=True, ignore_eos=True)
    with open_pipeline(folder) as pipe:
        responses = pipe(PROMPTS, gen)
        pipe.engine.check_integrity()
    with open_pipeline(folder, int8_activations=True) as pipe:
        int8 = pipe(PROMPTS, gen)
    for p, r, r8 in zip(PROMPTS, responses, int8):
        assert r.error is None and r8.error is None, (r.error, r8.error)
        assert r.token_ids == hf_greedy(ref, p, 16, None)
        with torch.no_grad():
            want = ref(torch.tensor([p + r.token_ids])).logits[0, :-1].numpy()
            want8 = ref(torch.tensor([p + r8.token_ids])).logits[0, :-1].numpy()
        err = np.linalg.norm(r.logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert err.max() <= 1e-4, f"worst logit row {err.max():.3g}"
        err8 = float(np.linalg.norm(r8.logits - want8) / np.linalg.norm(want8))
        assert err8 <= 5e-2, f"int8 activations: rel err {err8:.3g}"


def test_mxfp4_nan_scale_is_refused_by_name(mxfp4_model, tmp_path):
    """A block whose e8m0 scale is 255 (NaN) is refused at load, naming the tensor, never run."""
    folder, _ = mxfp4_model
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.down_proj_scales"][1, 3, 0] = 255
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"layers\.2\.experts\.down_proj.*NaN scale"):
        open_pipeline(tmp_path)

