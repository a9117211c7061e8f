"""`lmkit lite calibrate`: the KV fake quantizer equals a float64 hand reference of the engine's format, the
attention hook quantizes K after RoPE and V (the current token's own included), and calibration writes a
kv_policy.json that ``lmkit.kv_policy`` accepts, within the perplexity budget; bad input fails clearly."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lmkit.cli.main import app
from lmkit.kv_policy import load_kv_policy
from lmkit.lite.calib import CalibrationDataError
from lmkit.lite.config import KvCalibConfig
from lmkit.lite.kvcalib import calibrate_kv, choose_policy
from lmkit.lite.kvquant import fake_quant_kv, use_kv_fake_quant_attention
from tests.factories import make_tiny_model
from tests.helpers import assert_int4_kl_per_layer

# 4 windows of 64 tokens of pydoc to measure, 252 scored tokens of held-out pydoc to check the budget
TINY_KV = dict(calib_dataset="pydoc", calib_samples=4, calib_seqlen=64, eval_dataset="pydoc", eval_seqlen=64,
               eval_max_tokens=256, device="cpu")


def reference_fake_quant(rows: np.ndarray, bits: int) -> np.ndarray:
    """The format of lmkit/kv_policy.py written out per row in Python floats (float64) and numpy float16."""
    levels = 2**bits - 1
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        lo, hi = min(row), max(row)
        scale = float(np.float16((hi - lo) / levels))
        zero = float(np.float16(lo))
        for c, x in enumerate(row):
            q = 0 if scale == 0 else min(max(round((x - zero) / scale), 0), levels)  # round(): half to even
            out[r, c] = q * scale + zero
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quant_matches_float64_reference(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 2, 5, 64, dtype=torch.float64, generator=g) * 3 + 0.5  # [batch, kv heads, tokens, head_dim]
    x[0, 0, 0] = 0.7  # constant row: scale 0, every value -> fp16(0.7)
    x[0, 1, 2] = torch.linspace(-1, 1, 64, dtype=torch.float64) ** 3
    v = 1 + 2**-11 + 2**-40  # fp16(v) = 1 + 2**-10 rounded once; through float32 it would round to 1.0
    x[1, 0, 3] = torch.linspace(0, levels := 2**bits - 1, 64, dtype=torch.float64) * v  # scale = fp16(v)
    x[1, 1, 4, :] = v + torch.arange(64, dtype=torch.float64)  # zero = fp16(v)
    got = fake_quant_kv(x, bits)
    want = reference_fake_quant(x.reshape(-1, 64).numpy(), bits).reshape(x.shape)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.from_numpy(want)), (got - torch.from_numpy(want)).abs().max()
    assert torch.all(got[0, 0, 0] == float(np.float16(0.7)))
    assert got[1, 0, 3, -1] == levels * (1 + 2**-10) and got[1, 1, 4, 0] == 1 + 2**-10
    # within half a step of the input (the fp16 rounding of scale and zero adds a little)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / levels
    assert torch.all((got - x).abs() <= 0.5 * step * (1 + 2**-9) + 1e-3 * x.abs().amax(-1, keepdim=True))


def test_fake_quant_rounding_and_dtypes():
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.5, 15.0]])  # int4: scale 1, zero 0; ties go to the even level
    assert fake_quant_kv(x, 4).tolist() == [[0.0, 0.0, 2.0, 2.0, 4.0, 15.0]]
    half = torch.randn(2, 8, dtype=torch.bfloat16)
    assert fake_quant_kv(half, 8).dtype == torch.bfloat16
    assert fake_quant_kv(half, 0) is half
    with pytest.raises(ValueError, match="0 \\(fp\\), 8 or 4"):
        fake_quant_kv(half, 2)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_hook_quantizes_k_after_rope_and_v(arch, tmp_path):
    """The hooked model's attention block output equals a float64 reference written here: q/k/v
    projections, RoPE, K and V fake-quantized per token and KV head, causal GQA softmax, o_proj."""
    folder = tmp_path / arch
    lm = make_tiny_model(folder, arch, num_hidden_layers=2, intermediate_size=128)
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = lm(input_ids=ids).logits
        use_kv_fake_quant_attention(lm)
        assert torch.equal(lm(input_ids=ids, kv_bits=[0, 0], use_cache=False).logits, plain)
        for bits in ([4, 8], [8, 4]):
            seen = {}
            attn = lm.model.layers[1].self_attn
            pre = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
            post = attn.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))
            try:
                lm(input_ids=ids, kv_bits=bits, use_cache=False)
            finally:
                pre.remove()
                post.remove()
            h = seen["hidden_states"].double()
            cos, sin = (t.double().unsqueeze(1) for t in seen["position_embeddings"])
            b, s, _ = h.shape
            d, n_kv = attn.head_dim, lm.config.num_key_value_heads
            n_rep = lm.config.num_attention_heads // n_kv

            def project(linear, heads):
                w = linear.weight.double()
                y = h @ w.T + (linear.bias.double() if linear.bias is not None else 0)
                return y.view(b, s, heads, d).transpose(1, 2)

            q = project(attn.q_proj, n_kv * n_rep)
            k, v = project(attn.k_proj, n_kv), project(attn.v_proj, n_kv)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = fake_quant_kv(k, bits[1]), fake_quant_kv(v, bits[1])
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(d)
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1) @ attn.o_proj.weight.double().T
            err = (seen["out"].double() - out).norm() / out.norm()
            assert err < 1e-5, (arch, bits, float(err))


@pytest.fixture(scope="module")
def kv_tiny_llama(tmp_path_factory):
    """A tiny random Llama with 4 layers (GQA 4 heads / 2 KV heads, head_dim 16)."""
    folder = tmp_path_factory.mktemp("kv-llama")
    make_tiny_model(folder, "llama", num_hidden_layers=4, intermediate_size=128)
    return folder


def test_int4_kl_from_recorded_layer_inputs_equals_full_passes(kv_tiny_llama):
    """Each layer's KL is computed from the recorded fp input of that layer on: the same as a full pass."""
    from lmkit.lite.checkpoint import load_causal_lm

    lm = load_causal_lm(kv_tiny_llama)
    use_kv_fake_quant_attention(lm)
    windows = torch.randint(0, 250, (3, 32), generator=torch.Generator().manual_seed(2))
    assert_int4_kl_per_layer(lm, windows, 4)


def test_calibrate_writes_a_policy_within_budget(kv_tiny_llama, tmp_path):
    result = calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "out", max_ppl_increase=0.005, **TINY_KV))
    path = tmp_path / "out" / "kv_policy.json"
    assert result.policy_path == path
    layers = load_kv_policy(path, num_layers=4, num_kv_heads=2, head_dim=16)
    assert layers == result.layers and len(layers) == 4
    doc = json.loads(path.read_text())
    assert doc["model"] == {"architecture": "LlamaForCausalLM", "num_layers": 4, "num_kv_heads": 2, "head_dim": 16}
    assert set(doc["perplexity"]) >= {"fp", "int8", "int4", "policy", "dataset", "num_tokens"}
    assert doc["perplexity"]["num_tokens"] == 252 and doc["calibration"]["num_tokens"] == 4 * 64
    assert doc["calibration"]["num_docs_dropped"] == 0  # pydoc's calibration side already leaves out topics nesting held-out ones
    assert len(doc["layer_errors"]) == 4 and doc["settings"]["max_ppl_increase"] == 0.005
    ppl = result.ppl
    assert ppl["policy"] <= ppl["fp"] * 1.005 == pytest.approx(result.ppl_limit)
    assert ppl["fp"] < ppl["int8"] < ppl["int4"]  # on this model; the budget sits between int8 and int4
    for errs in result.layer_errors:
        assert 0 < errs["int8"] < errs["int4"] and 0 < errs["int4_k"] < errs["int4"]
    kl = result.layer_int4_kl
    assert len(kl) == 4 and all(v > 0 for v in kl) and doc["layer_int4_kl"] == pytest.approx(kl, rel=1e-5)
    # int4 goes to the layers where int4 alone moves the output distribution least, the rest are int8
    num_int4 = result.count(4)
    ranked = sorted(range(4), key=lambda i: kl[i])
    assert 0 < num_int4 < 4 and {i for i, b in enumerate(layers) if b == 4} == set(ranked[:num_int4])
    assert result.count(0) == 0 and math.isclose(doc["perplexity"]["policy"], ppl["policy"])


def test_budget_zero_and_unbounded(kv_tiny_llama, tmp_path):
    zero = calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "a", max_ppl_increase=0, **TINY_KV))
    assert zero.ppl["policy"] <= zero.ppl["fp"] and 4 not in zero.layers
    # without the one-layer-at-a-time pass, layers are ranked by attention error; the budget holds all the same
    loose = calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "b", max_ppl_increase=10,
                                                      sensitivity_samples=0, **TINY_KV))
    assert loose.layers == [4, 4, 4, 4] and loose.ppl["policy"] == loose.ppl["int4"]
    assert len(loose.search) == 3 and loose.layer_int4_kl is None  # fp, int8, int4: no search
    with pytest.raises(ValueError, match="--sensitivity-samples must be in 0..--calib-samples \\(4\\)"):
        KvCalibConfig(work_dir=tmp_path, calib_samples=4, sensitivity_samples=5)
    with pytest.raises(ValueError, match="--max-ppl-increase must be a finite number >= 0"):
        KvCalibConfig(work_dir=tmp_path, max_ppl_increase=-0.01)
    with pytest.raises(ValueError, match="--max-ppl-increase"):
        KvCalibConfig(work_dir=tmp_path, max_ppl_increase=float("nan"))


def test_choose_policy_searches_both_ways():
    """An additive perplexity model: 1 + cost per layer; int4 costs 10x int8; fp costs nothing."""
    cost = {8: [0.001, 0.004, 0.002, 0.003, 0.0], 4: [0.01, 0.04, 0.02, 0.03, 0.0]}
    calls = []

    def ppl_of(layers):
        calls.append(layers)
        return 1 + sum(cost[b][i] for i, b in enumerate(layers) if b)

    order_int4 = sorted(range(5), key=lambda i: cost[4][i])
    order_fp = sorted(range(5), key=lambda i: -cost[8][i])
    all8, all4 = ppl_of([8] * 5), ppl_of([4] * 5)
    # room for the two cheapest int4 layers (4: 0.0, 0: 0.01) plus int8 elsewhere (0.009)
    assert choose_policy(order_int4, order_fp, ppl_of, 1.025, all8, all4) == [4, 8, 8, 8, 4]
    assert len(calls) <= 2 + math.ceil(math.log2(5))
    # all-int8 (1.010) over the limit: fp on the layers with the largest int8 error
    assert choose_policy(order_int4, order_fp, ppl_of, 1.004, all8, all4) == [8, 0, 8, 0, 8]
    assert choose_policy(order_int4, order_fp, ppl_of, 1.0, all8, all4) == [0, 0, 0, 0, 8]


def test_bad_input_is_named(kv_tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        calibrate_kv(tmp_path / "missing", KvCalibConfig(work_dir=tmp_path / "o", **TINY_KV))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "kv_policy.json").write_text("{}")
    with pytest.raises(ValueError, match="exists \\(pass --overwrite"):
        calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "taken", **TINY_KV))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "file", **TINY_KV))
    text = tmp_path / "same.txt"
    text.write_text("The same text on both sides is not held out. " * 200)
    with pytest.raises(CalibrationDataError, match="shares all its text with the evaluation dataset"):
        calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "o", **{**TINY_KV, "calib_dataset": str(text),
                                                                               "eval_dataset": str(text)}))
    with pytest.raises(CalibrationDataError, match="too short"):
        calibrate_kv(kv_tiny_llama, KvCalibConfig(work_dir=tmp_path / "o", **{**TINY_KV, "calib_samples": 100000}))
    assert not (tmp_path / "o" / "kv_policy.json").exists()


def test_cli_calibrate(kv_tiny_llama, tmp_path):
    out = tmp_path / "kv"
    args = ["lite", "calibrate", str(kv_tiny_llama), "--work-dir", str(out), "--max-ppl-increase", "0.005"]
    for key, value in TINY_KV.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for text in ("KV policy ->", "kv_policy.json", "int4 KL", "perplexity fp KV", "perplexity policy",
                 "budget", "+0.50%", "4 x 64 tokens of pydoc"):
        assert text in result.output, (text, result.output)
    assert len(load_kv_policy(out / "kv_policy.json", num_layers=4)) == 4


def test_cli_errors_are_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lmkit", "lite", "calibrate", str(tmp_path), "--work-dir",
                          str(tmp_path / "o"), "--max-ppl-increase", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "--max-ppl-increase must be a finite number >= 0" in run.stderr
    assert "Traceback" not in run.stderr
