"""lmkit lite calibrate on the 2026 families. A Gated DeltaNet hybrid (Qwen3.5: three recurrent layers for one
gated-attention layer): only the attention layer has a KV cache. The fake-quantized attention leaves the recurrent
layers as they are, the one-layer-at-a-time int4 KL runs on the attention layer alone (the recurrent layers' stay 0)
and equals full passes, and the policy search runs over the attention layers: the recurrent layers are written as 0
and the engine serves the policy, within the budget, as Qwen ships the model (Qwen3_5ForConditionalGeneration) too.
gpt-oss (sinks, through its own eager attention) and Gemma 4 (per-layer head dims, the value norm, k = v, the MoE
block): fake quantization at 0 bits is the model itself, the one-layer KL equals full passes, and the policy is
served; the E-models (KV sharing): one precision per cache, its readers' too."""

from __future__ import annotations

import json

import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from lmkit.kv_policy import load_kv_policy
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import KvCalibConfig
from lmkit.lite.kvcalib import calibrate_kv
from lmkit.lite.kvquant import use_kv_fake_quant_attention
from lmkit.models import get_architecture
from tests.factories import ARCH_CASES, QWEN3_5, TOKEN_IDS, Case, _write_case, write_qwen3_5_multimodal
from tests.helpers import assert_int4_kl_per_layer

CASE = Case("Qwen3_5TextConfig", dict(QWEN3_5, num_hidden_layers=4), seed=61, norm_offset=1.0,
            plain_norms=("linear_attn.norm",))
TINY_KV = dict(calib_dataset="pydoc", calib_samples=4, calib_seqlen=64, eval_dataset="pydoc", eval_seqlen=64,
               eval_max_tokens=256, device="cpu")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5-kv") / "fp"
    _write_case(CASE, folder)
    return folder


@torch.no_grad()
def test_fake_quant_touches_the_attention_layer_only(hybrid):
    lm = load_causal_lm(hybrid)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(3))
    plain = lm(input_ids=ids).logits
    use_kv_fake_quant_attention(lm)
    assert lm.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert torch.equal(lm(input_ids=ids, kv_bits=[0] * 4, use_cache=False).logits, plain)
    assert torch.equal(lm(input_ids=ids, kv_bits=[4, 4, 4, 0], use_cache=False).logits, plain)  # no KV there
    assert not torch.equal(lm(input_ids=ids, kv_bits=[0, 0, 0, 4], use_cache=False).logits, plain)
    windows = torch.randint(0, 250, (3, 32), generator=torch.Generator().manual_seed(4))
    assert_int4_kl_per_layer(lm, windows, 4)


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_calibration_policy_of_a_hybrid_is_served(hybrid, multimodal, tmp_path):
    source = hybrid
    if multimodal:
        source = tmp_path / "mm"
        write_qwen3_5_multimodal(source, "Qwen3_5Config", dict(CASE.kwargs, max_position_embeddings=512, **TOKEN_IDS),
                                 seed=62)
    result = calibrate_kv(source, KvCalibConfig(work_dir=tmp_path / "kv", max_ppl_increase=0.01, **TINY_KV))
    assert result.layers[:3] == [0, 0, 0] and result.layers[3] in (0, 4, 8)
    assert result.layer_int4_kl[:3] == [0.0, 0.0, 0.0] and result.layer_int4_kl[3] > 0
    assert all(e == {k: 0.0 for k in e} for e in result.layer_errors[:3])
    assert 0 < result.layer_errors[3]["int8"] < result.layer_errors[3]["int4"]
    assert result.ppl["policy"] <= result.ppl_limit
    assert all(set(e["layers"][:3]) == {0} for e in result.search)  # the search moved the attention layer only
    doc = json.loads(result.policy_path.read_text())
    assert doc["model"]["architecture"] == ("Qwen3_5ForConditionalGeneration" if multimodal else "Qwen3_5ForCausalLM")
    assert load_kv_policy(result.policy_path, num_layers=4, num_kv_heads=2, head_dim=16) == result.layers
    with pipeline(str(source), EngineConfig(device="cpu", dtype="float32", kv_policy=str(result.policy_path),
                                            session_len=256)) as pipe:
        r = pipe([[1, 5, 9, 33, 70]], GenerationConfig(max_new_tokens=4, ignore_eos=True))[0]
    assert len(r.token_ids) == 4


@pytest.mark.parametrize("case", ["gpt_oss", "gemma4", "gemma4_k_eq_v", "gemma4_moe"])
def test_calibration_of_sinks_and_gemma4(case, tmp_path):
    source = tmp_path / "fp"
    _write_case(ARCH_CASES[case], source)
    lm = load_causal_lm(source)
    n = lm.config.num_hidden_layers
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = lm(input_ids=ids).logits
        use_kv_fake_quant_attention(lm, get_architecture(lm.config.architectures[0]).kv_calib)
        assert torch.equal(lm(input_ids=ids, kv_bits=[0] * n, use_cache=False).logits, plain)
        assert not torch.equal(lm(input_ids=ids, kv_bits=[4] * n, use_cache=False).logits, plain)
    assert_int4_kl_per_layer(lm, torch.randint(0, 250, (3, 32), generator=torch.Generator().manual_seed(6)), n)
    result = calibrate_kv(source, KvCalibConfig(work_dir=tmp_path / "kv", max_ppl_increase=0.01, **TINY_KV))
    assert result.ppl["policy"] <= result.ppl_limit and len(result.layers) == n
    assert all(0 < e["int8"] < e["int4"] for e in result.layer_errors)
    with pipeline(str(source), EngineConfig(device="cpu", dtype="float32", kv_policy=str(result.policy_path),
                                            session_len=256)) as pipe:
        assert len(pipe([[1, 5, 9, 33, 70]], GenerationConfig(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_kv_sharing_layers_take_their_sources_precision(tmp_path):
    """Gemma 4's E-model form (per-layer inputs; the last layers read an earlier layer's KV cache): a cache's
    precision is its layer's and every reader's. The fake quantization of a source's cache changes its readers (their
    attention reads it), the one-layer int4 KL of a source (its readers' caches int4 with it) equals full passes, the
    search moves only the layers with a cache of their own, the policy writes each reader with its source's bits,
    stays within the budget, and the engine serves it."""
    source = tmp_path / "e"
    _write_case(ARCH_CASES["gemma4_e"], source)
    lm = load_causal_lm(source)
    n = lm.config.num_hidden_layers
    sources = get_architecture(lm.config.architectures[0]).model_fields(
        json.loads((source / "config.json").read_text())).layer_kv_source
    readers = [i for i in range(n) if sources[i] != i]
    assert readers and all(sources[i] < i for i in readers)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        plain = lm(input_ids=ids).logits
        use_kv_fake_quant_attention(lm, get_architecture(lm.config.architectures[0]).kv_calib)
        assert torch.equal(lm(input_ids=ids, kv_bits=[0] * n, use_cache=False).logits, plain)
        # a reader quantizes what it reads from its source's cache: bits on a reader alone change the output
        only_reader = [4 if i == readers[-1] else 0 for i in range(n)]
        assert not torch.equal(lm(input_ids=ids, kv_bits=only_reader, use_cache=False).logits, plain)
    assert_int4_kl_per_layer(lm, torch.randint(0, 250, (3, 32), generator=torch.Generator().manual_seed(8)), n,
                             sources)
    result = calibrate_kv(source, KvCalibConfig(work_dir=tmp_path / "kv", max_ppl_increase=0.01, **TINY_KV))
    assert len(result.layers) == n and result.ppl["policy"] <= result.ppl_limit
    assert all(result.layers[i] == result.layers[sources[i]] for i in range(n))
    assert all(result.layer_int4_kl[i] == 0.0 for i in readers)
    for entry in result.search:  # every measured policy kept one precision per cache
        assert all(entry["layers"][i] == entry["layers"][sources[i]] for i in range(n))
    with pipeline(str(source), EngineConfig(device="cpu", dtype="float32", kv_policy=str(result.policy_path),
                                            session_len=256)) as pipe:
        assert len(pipe([[1, 5, 9, 33, 70]], GenerationConfig(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4
