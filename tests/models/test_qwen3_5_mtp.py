"""The multi-token-prediction head Qwen ships beside Qwen3.5 / Qwen3.5-MoE (Qwen3_5(Moe)ForConditionalGeneration) and
Qwen3-Next (Qwen3NextForCausalLM): config mtp_num_hidden_layers, tensors mtp.fc, mtp.pre_fc_norm_embedding,
mtp.pre_fc_norm_hidden, mtp.norm and mtp.layers.{j}.* (a full-attention decoder layer). transformers creates none
of it (it drops mtp.* on load), so the tests write random MTP tensors beside the model's, shaped as its last
full-attention layer, in bf16 beside an fp32 model. The engine holds them (Engine.mtp_num_layers, mtp_weight_bytes:
the stored bytes, counted apart from linear_weight_bytes), the model's logits still equal HF's, and a checkpoint
whose config names an MTP layer it lacks a tensor of fails naming the tensor."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmkit import EngineConfig, pipeline
from tests.factories import QWEN3_5, QWEN3_5_MOE, TOKEN_IDS, add_mtp_head, build_case, write_gptq, \
    write_qwen3_5_multimodal
from tests.helpers import assert_text_logits_match_hf


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _open(folder):
    return pipeline(folder, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=8, session_len=256))


def _check_mtp_head(base, tmp_path, ref, seed: int, caplog):
    """``base`` without a head, a copy with one: the copy's engine holds 1 MTP layer of exactly the bytes written, its
    decode roofline's bytes are the base's, and its logits are HF's."""
    with _open(base) as pipe:
        assert pipe.engine.mtp_num_layers == 0 and pipe.engine.mtp_weight_bytes == 0
        linear_bytes = pipe.engine.linear_weight_bytes
    folder = tmp_path / "mtp"
    shutil.copytree(base, folder)
    mtp = add_mtp_head(folder, seed)
    with caplog.at_level(logging.INFO, logger="lmkit"), _open(folder) as pipe:
        assert pipe.engine.mtp_num_layers == 1
        assert pipe.engine.mtp_weight_bytes == stored_bytes(mtp)
        assert pipe.engine.linear_weight_bytes == linear_bytes
    assert any("MTP head: 1 layer loaded" in r.getMessage()
               and "unused: speculative='mtp' drafts with it" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert_text_logits_match_hf(folder, ref, seed)
    return folder, mtp


@pytest.mark.parametrize("config_class,text", [("Qwen3_5Config", QWEN3_5), ("Qwen3_5MoeConfig", QWEN3_5_MOE)],
                         ids=["dense", "moe"])
def test_qwen3_5_mtp_head_is_loaded(config_class, text, tmp_path, caplog):
    base = tmp_path / "base"
    ref = write_qwen3_5_multimodal(base, config_class, dict(text, num_hidden_layers=4, max_position_embeddings=512,
                                                            **TOKEN_IDS), seed=70)
    _check_mtp_head(base, tmp_path, ref, 71, caplog)


def test_qwen3_next_mtp_head_is_loaded(tmp_path, caplog):
    """Qwen3-Next's head: its config's mtp_num_hidden_layers at the top level, the MTP layer sparse as the last
    full-attention one (routed experts and the shared expert)."""
    base = tmp_path / "base"
    ref = build_case("qwen3_next", base)
    folder, mtp = _check_mtp_head(base, tmp_path, ref, 72, caplog)
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in mtp and "mtp.layers.0.mlp.gate.weight" in mtp


@pytest.mark.parametrize("missing", ["mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.k_norm.weight",
                                     "mtp.layers.0.mlp.down_proj.weight"])
def test_a_missing_mtp_tensor_fails_the_load_naming_it(missing, tmp_path):
    """The config says 1 MTP layer, the checkpoint lacks one of its tensors: the load fails naming the tensor's role
    and the config field (Qwen's checkpoints all carry the whole head; one missing is a damaged file)."""
    folder = tmp_path / "m"
    write_qwen3_5_multimodal(folder, "Qwen3_5Config", dict(QWEN3_5, num_hidden_layers=4, max_position_embeddings=512,
                                                           **TOKEN_IDS), seed=73)
    add_mtp_head(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[missing]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    role = missing[: -len(".weight")].replace("self_attn.", "").replace("mlp.", "")
    with pytest.raises(ValueError, match=rf"mtp_num_hidden_layers = 1\): .*no tensor for '{role}'"):
        _open(folder)


def test_an_mtp_tensor_of_the_wrong_shape_fails_the_load_naming_it(tmp_path):
    folder = tmp_path / "m"
    write_qwen3_5_multimodal(folder, "Qwen3_5Config", dict(QWEN3_5, num_hidden_layers=4, max_position_embeddings=512,
                                                           **TOKEN_IDS), seed=74)
    add_mtp_head(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    h = tensors["mtp.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = torch.zeros(h, h)  # [H, H]: one half of the concatenation only
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'mtp.fc' has shape \[{h}, {h}\], the config implies \[{h}, {2 * h}\]"):
        _open(folder)


def test_a_gptq_quantized_mtp_head_is_loaded(tmp_path):
    """GPTQ (and compressed-tensors) checkpoints may quantize the head's linears: they load through the same int4
    path as the model's, and the head's bytes are those of its tensors as stored (qweight, qzeros, scales, g_idx)."""
    base = tmp_path / "base"
    build_case("qwen3_next", base)
    src = tmp_path / "src"
    shutil.copytree(base, src)
    add_mtp_head(src, 75)
    folder = write_gptq(src, tmp_path / "gptq", group=32, symmetric=False, act_order=False,
                        checkpoint_format="gptq") / "int4"
    mtp = {k: t for k, t in load_file(str(folder / "model.safetensors")).items() if k.startswith("mtp.")}
    assert "mtp.layers.0.self_attn.o_proj.qweight" in mtp and "mtp.layers.0.mlp.shared_expert.up_proj.qweight" in mtp
    with _open(folder) as pipe:
        assert (pipe.engine.mtp_num_layers, pipe.engine.mtp_weight_bytes) == (1, stored_bytes(mtp))
