"""EngineConfig at the boundary: the user's spellings of one thing become the engine's one encoding, once
(lmkit/config.py, EngineConfig.to_engine_config)."""

from __future__ import annotations

import pytest

from lmkit import EngineConfig
from lmkit._ext import _engine


def test_kv_precision_becomes_one_kvquant_per_layer():
    """quant_policy (0 / 8 / 4) and a kv_policy.json's per-layer bits both reach the engine as a KVQuant per
    layer; no policy leaves the list empty (every layer at the backend's full precision)."""
    KVQuant = _engine.KVQuant
    assert EngineConfig().to_engine_config("cpu", num_layers=3).kv_quant == []
    assert EngineConfig(quant_policy=8).to_engine_config("cpu", num_layers=3).kv_quant == [KVQuant.int8] * 3
    assert EngineConfig(quant_policy=4).to_engine_config("cpu", num_layers=2).kv_quant == [KVQuant.int4] * 2
    per_layer = EngineConfig(quant_policy=4).to_engine_config("cpu", [0, 8, 4], num_layers=3).kv_quant
    assert per_layer == [KVQuant.none, KVQuant.int8, KVQuant.int4]  # a policy file wins over quant_policy
    with pytest.raises(AssertionError, match="num_layers"):
        EngineConfig(quant_policy=8).to_engine_config("cpu")


def test_block_size_has_one_name_inside():
    """cache_block_seq_len (LMDeploy's name, the user's) is block_size_tokens in the engine."""
    assert EngineConfig(cache_block_seq_len=32).to_engine_config("cpu").block_size_tokens == 32
    assert not hasattr(_engine.EngineConfig(), "cache_block_seq_len")
