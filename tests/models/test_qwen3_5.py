"""Qwen3.5 as Qwen ships it: Qwen3_5ForConditionalGeneration, the text model under model.language_model with its
config under text_config, a vision tower and a multi-token-prediction head beside it. The engine serves the text
model: its logits equal HF's (the multimodal class, fp32, text input) within 1e-4; the vision and MTP tensors are
left unread, and a tensor that is neither still fails the load naming it. (The hybrid layers themselves are
covered per layer kind in tests/models/test_architectures.py and tests/engine/test_recurrent_state.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import QWEN3_5, TOKEN_IDS, _init_weights, write_byte_tokenizer

VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("qwen3_5_vl")
    text = dict(QWEN3_5, num_hidden_layers=4, max_position_embeddings=512, **TOKEN_IDS)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION)
    torch.manual_seed(54)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    _init_weights(model, 1.0, ("linear_attn.norm",))
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    # the MTP head Qwen's checkpoints carry (transformers drops it on load)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, ref


def test_text_logits_match_hf(multimodal):
    folder, ref = multimodal
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    rng = np.random.default_rng(55)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (7, 40)]
    gen = GenerationConfig(max_new_tokens=10, output_logits=True, ignore_eos=True)
    with pipeline(folder, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32,
                                       cache_block_seq_len=16, max_batch_size=4, session_len=256)) as pipe:
        responses = pipe(prompts, gen)
    for prompt, r in zip(prompts, responses):
        full = prompt + r.token_ids
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([full])).logits[0, :-1].numpy()
        err = np.linalg.norm(r.logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert err.max() <= 1e-4, f"{len(prompt)}-token prompt: worst row rel err {err.max():.3g}"


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


def test_lite_tools_refuse_it_by_name(multimodal, tmp_path):
    """AWQ and KV calibration have no table for the hybrid layers yet: both say so before any work, naming it."""
    from typer.testing import CliRunner

    from lmkit.cli.main import app
    from lmkit.models import get_awq_map

    folder, _ = multimodal
    with pytest.raises(ValueError, match="does not quantize Qwen3_5ForConditionalGeneration yet"):
        get_awq_map("Qwen3_5ForConditionalGeneration")
    result = CliRunner().invoke(app, ["lite", "calibrate", str(folder), "--work-dir", str(tmp_path / "out")])
    assert result.exit_code != 0  # the lmkit entry point prints the ValueError as one line (tests/lite/test_cli.py)
    assert "does not calibrate Qwen3_5ForConditionalGeneration yet" in str(result.exception), result.output
