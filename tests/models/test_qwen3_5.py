"""Qwen3.5 as Qwen ships it: Qwen3_5ForConditionalGeneration (and Qwen3_5MoeForConditionalGeneration), the
text model under model.language_model with its config under text_config, a vision tower and a
multi-token-prediction head beside it. The engine serves the text model: its logits equal HF's (the multimodal
class, fp32, text input) within 1e-4; the vision tensors are left unread (so is an MTP tensor whose config names no
MTP layers; the head itself: tests/models/test_qwen3_5_mtp.py), and a tensor that is neither still fails the load
naming it. (The hybrid layers themselves are covered per layer kind in
tests/models/test_architectures.py and tests/engine/test_recurrent_state.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmkit import EngineConfig, pipeline
from tests.factories import QWEN3_5, QWEN3_5_MOE, TOKEN_IDS, fuse_qwen3_5_experts, write_qwen3_5_multimodal
from tests.helpers import assert_text_logits_match_hf


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl")
    ref = write_qwen3_5_multimodal(folder, "Qwen3_5Config", dict(QWEN3_5, num_hidden_layers=4,
                                                                 max_position_embeddings=512, **TOKEN_IDS), seed=54)
    return folder, ref


def _assert_text_logits_match_hf(folder, ref, architecture: str):
    assert json.loads((folder / "config.json").read_text())["architectures"] == [architecture]
    assert_text_logits_match_hf(folder, ref, 55)


def test_text_logits_match_hf(multimodal):
    _assert_text_logits_match_hf(*multimodal, "Qwen3_5ForConditionalGeneration")


def test_moe_text_logits_match_hf(tmp_path):
    """Qwen3.5-MoE as shipped (Qwen3_5MoeForConditionalGeneration): routed and shared experts on every layer."""
    text = dict(QWEN3_5_MOE, num_hidden_layers=4, max_position_embeddings=512, **TOKEN_IDS)
    ref = write_qwen3_5_multimodal(tmp_path, "Qwen3_5MoeConfig", text, seed=58)
    _assert_text_logits_match_hf(tmp_path, ref, "Qwen3_5MoeForConditionalGeneration")


def test_a_tensor_of_no_known_part_still_fails_the_load(multimodal, tmp_path):
    import shutil

    folder, _ = multimodal
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shard = copy / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["model.language_model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        pipeline(copy, EngineConfig(device="cpu", cache_max_entry_count=8))


def test_fused_expert_tensors_load_as_shipped(tmp_path):
    """Qwen ships Qwen3.5-MoE's experts fused, two 3D tensors per layer (mlp.experts.gate_up_proj [E, 2I, H]: each
    expert's gate rows then its up rows; mlp.experts.down_proj [E, H, I]), where transformers 5.24 saves one
    tensor per expert: the same weights either way give HF's logits, and a fused tensor of the wrong shape fails
    the load naming it."""
    import shutil

    text = dict(QWEN3_5_MOE, num_hidden_layers=4, max_position_embeddings=512, **TOKEN_IDS)
    ref = write_qwen3_5_multimodal(tmp_path / "split", "Qwen3_5MoeConfig", text, seed=59)
    fused = tmp_path / "fused"
    shutil.copytree(tmp_path / "split", fused)
    experts = text["num_experts"]
    tensors = fuse_qwen3_5_experts(fused, text["num_hidden_layers"], experts)
    _assert_text_logits_match_hf(fused, ref, "Qwen3_5MoeForConditionalGeneration")
    tensors["model.language_model.layers.2.mlp.experts.down_proj"] = torch.zeros(experts, 64, 8)
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.2\.experts\.down_proj' has shape"):
        pipeline(fused, EngineConfig(device="cpu", cache_max_entry_count=8))
