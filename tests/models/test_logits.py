"""Engine logits == HF transformers fp32 logits (relative error <= 1e-4), prompt and decode positions,
for tiny random Llama, Mistral and Qwen2 models covering the checkpoint variants the loader accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, _engine, pipeline
from tests.factories import TINY_CASES as CASES
from tests.factories import make_tiny_model
from tests.helpers import rel_err

@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(case, tmp_path):
    kwargs = dict(CASES[case])
    ref = make_tiny_model(tmp_path / case, kwargs.pop("arch"), **kwargs)
    rng = np.random.default_rng(1)
    prompt_lens = [1, 7, 40]  # 40 > sliding window and > one 16-token block
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4)
    gen = GenerationConfig(max_new_tokens=12, output_logits=True, ignore_eos=True)
    with pipeline(tmp_path / case, config) as pipe:
        prompts = [rng.integers(0, 256, size=n).tolist() for n in prompt_lens]
        responses = pipe(prompts, gen)  # all prompts in one batch
        for i, r in enumerate(responses):
            full = prompts[i] + r.token_ids
            with torch.no_grad():
                expect = ref(torch.tensor([full])).logits[0].numpy()
            got = r.logits
            # rows: every prompt position and every generated position but the last
            assert got.shape == (len(full) - 1, ref.config.vocab_size), got.shape
            n_prompt = len(prompts[i])
            assert rel_err(got[:n_prompt], expect[:n_prompt]) <= 1e-4, case
            assert rel_err(got[n_prompt:], expect[n_prompt:len(full) - 1]) <= 1e-4, case


def test_rope_parameters_win_over_a_legacy_rope_theta(tmp_path):
    """A config with both layouts, as a transformers-4.x tool writes when it re-saves a 5.x config (AutoAWQ
    0.2.9 added its default "rope_theta": 10000.0 beside rope_parameters' 500000): the engine takes
    rope_parameters, as transformers 5 does, and its logits stay HF's."""
    import json

    from transformers import AutoConfig

    ref = make_tiny_model(tmp_path / "m", "llama", rope_theta=500000.0)
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0
    path.write_text(json.dumps({**cfg, "rope_theta": 10000.0}))
    assert AutoConfig.from_pretrained(tmp_path / "m").rope_parameters["rope_theta"] == 500000.0  # the oracle's reading
    prompt = np.random.default_rng(3).integers(0, 256, size=40).tolist()
    gen = GenerationConfig(max_new_tokens=4, output_logits=True, ignore_eos=True)
    with pipeline(tmp_path / "m", EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=16)) as pipe:
        r = pipe(prompt, gen)
    with torch.no_grad():
        expect = ref(torch.tensor([prompt + r.token_ids])).logits[0].numpy()
    assert rel_err(r.logits, expect[: len(prompt) + len(r.token_ids) - 1]) <= 1e-4


@pytest.mark.skipif(not _engine.cpu_bf16_available(), reason="this CPU has no AVX512_BF16")
@pytest.mark.parametrize("case", ["llama", "qwen2-bias", "llama-tied-bf16", "mistral-sliding-window",
                                  "llama-linear-rope-head-dim"])
def test_bf16_compute_matches_hf(case, tmp_path):
    """dtype='bfloat16': linear layers as bf16 dot products (AMX tiles where the CPU has them) and the KV
    cache in bf16 (half the bytes of float32; with head_dim 32 and 32-token blocks, attention on AMX tiles
    where the CPU has them). Every logit row (prompt and decode) within bf16 rounding of HF fp32 (8 mantissa
    bits on weights and activations: 3e-2, the bound of the GPU's bf16 path), and measurably not the float32
    engine's (the bf16 kernels ran)."""
    kwargs = dict(CASES[case])
    ref = make_tiny_model(tmp_path / case, kwargs.pop("arch"), **kwargs)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 7, 40)]
    gen = GenerationConfig(max_new_tokens=12, output_logits=True, ignore_eos=True)
    base = dict(device="cpu", cache_max_entry_count=64, cache_block_seq_len=32, max_batch_size=4)
    with pipeline(tmp_path / case, EngineConfig(dtype="bfloat16", **base)) as pipe:
        got = pipe(prompts, gen)
        bf16_block_bytes = pipe.engine.kv_bytes_per_block
    with pipeline(tmp_path / case, EngineConfig(dtype="float32", **base)) as pipe:
        fp32 = pipe(prompts, gen)
        assert bf16_block_bytes * 2 == pipe.engine.kv_bytes_per_block
    for prompt, r, f in zip(prompts, got, fp32):
        full = prompt + r.token_ids
        with torch.no_grad():
            expect = ref(torch.tensor([full])).logits[0].numpy()
        assert rel_err(r.logits, expect[: len(full) - 1]) <= 3e-2, case
        if f.token_ids == r.token_ids:
            assert rel_err(r.logits, f.logits) > 1e-4, case
