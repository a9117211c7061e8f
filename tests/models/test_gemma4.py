"""Gemma 4 as Google ships it: Gemma4ForConditionalGeneration, the text model under model.language_model with its
config under text_config (in the hub's layout: global_head_dim and num_global_key_value_heads, not
per_layer_config), a vision tower beside it. The engine serves the text model: its logits equal HF's (the
multimodal class, fp32, text input) within 1e-4, with and without attention_k_eq_v, dense and MoE; the vision
tensors are left unread. (The text model's layers: tests/models/test_architectures.py's gemma4 cases.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit.models.loader import load_model_spec
from tests.factories import ARCH_CASES, TOKEN_IDS, _init_weights, write_byte_tokenizer

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=16)


def _hub_layout(text: dict) -> dict:
    """text_config as the hub's files have it: the global layers' shape as global_head_dim (and
    num_global_key_value_heads), no per_layer_config."""
    per_layer = text.pop("per_layer_config")
    (global_shape,) = {json.dumps(v, sort_keys=True) for v in per_layer.values()}
    shape = json.loads(global_shape)
    text["global_head_dim"] = shape["head_dim"]
    if "num_key_value_heads" in shape:
        text["num_global_key_value_heads"] = shape["num_key_value_heads"]
    return text


def _build(folder, case: str, seed: int):
    """A Gemma4ForConditionalGeneration checkpoint whose text model is ARCH_CASES[case]'s, and its fp32 HF model."""
    import transformers

    text = dict(ARCH_CASES[case].kwargs, max_position_embeddings=512, **{**TOKEN_IDS, "pad_token_id": 0})
    config = transformers.Gemma4Config(text_config=text, vision_config=VISION)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    _init_weights(model, 0.0, unit_scores=True)
    model.save_pretrained(str(folder))
    write_byte_tokenizer(folder)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"] = _hub_layout(cfg["text_config"])
    path.write_text(json.dumps(cfg, indent=2))
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("case, seed", [("gemma4", 73), ("gemma4_k_eq_v", 74), ("gemma4_moe", 81)])
def test_text_logits_match_hf(tmp_path, case, seed):
    ref = _build(tmp_path, case, seed)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"] and "global_head_dim" in cfg["text_config"]
    spec = load_model_spec(tmp_path)
    wide = ARCH_CASES[case].kwargs["global_head_dim"]
    assert spec.layer_head_dim == [16 if t == "sliding_attention" else wide for t in ref.config.text_config.layer_types]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (7, 40)]
    gen = GenerationConfig(max_new_tokens=10, output_logits=True, ignore_eos=True)
    with pipeline(tmp_path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32,
                                         cache_block_seq_len=16, max_batch_size=4, session_len=256)) as pipe:
        responses = pipe(prompts, gen)
    for prompt, r in zip(prompts, responses):
        full = prompt + r.token_ids
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([full])).logits[0, :-1].numpy()
        err = np.linalg.norm(r.logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert err.max() <= 1e-4, f"{case}, {len(prompt)}-token prompt: worst row rel err {err.max():.3g}"
