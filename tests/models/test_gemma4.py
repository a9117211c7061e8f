"""Gemma 4 as Google ships it: Gemma4ForConditionalGeneration, the text model under model.language_model with its
config under text_config (in the hub's layout: global_head_dim and num_global_key_value_heads, not
per_layer_config), a vision tower beside it. The engine serves the text model: its logits equal HF's (the
multimodal class, fp32, text input) within 1e-4, with and without attention_k_eq_v, dense, MoE and the E-models'
form (per-layer embeddings, KV sharing); the vision tensors are left unread. (The text model's layers: tests/models/test_architectures.py's gemma4 cases.)"""

from __future__ import annotations

import json

import pytest

from lmkit.models.loader import load_model_spec
from tests.factories import ARCH_CASES, write_gemma4_multimodal
from tests.helpers import assert_text_logits_match_hf


@pytest.mark.parametrize("case, seed", [("gemma4", 73), ("gemma4_k_eq_v", 74), ("gemma4_moe", 81), ("gemma4_e", 83)])
def test_text_logits_match_hf(tmp_path, case, seed):
    ref = write_gemma4_multimodal(tmp_path, case, seed)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"] and "global_head_dim" in cfg["text_config"]
    spec = load_model_spec(tmp_path)
    wide = ARCH_CASES[case].kwargs["global_head_dim"]
    assert spec.layer_head_dim == [16 if t == "sliding_attention" else wide for t in ref.config.text_config.layer_types]
    assert_text_logits_match_hf(tmp_path, ref, seed, f"{case}, ")
