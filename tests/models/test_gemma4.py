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
from tests.factories import ARCH_CASES, write_gemma4_multimodal

@pytest.mark.parametrize("case, seed", [("gemma4", 73), ("gemma4_k_eq_v", 74), ("gemma4_moe", 81)])
def test_text_logits_match_hf(tmp_path, case, seed):
    ref = write_gemma4_multimodal(tmp_path, case, seed)
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
