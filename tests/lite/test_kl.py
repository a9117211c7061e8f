"""``lmkit lite eval --kl``: the KL divergence of a model's next-token distributions from a reference's
(lite/kl.py), against torch's kl_div on fresh random logits and against the torch reference path of both models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmkit.lite.config import KlConfig
from lmkit.lite.kl import kl_divergence, window_stats

KL = KlConfig(dataset="pydoc", seqlen=48, max_tokens=150)


def test_window_stats_against_torch():
    rng = np.random.default_rng(11)
    ref, got = rng.normal(0, 3, (37, 101)).astype(np.float32), rng.normal(0, 3, (37, 101)).astype(np.float32)
    got[:5] = ref[:5]  # some positions identical: KL 0 there, same top token
    targets = rng.integers(0, 101, 37)
    targets[-1] = -1
    kl, same, nll_ref, nll_got = window_stats(ref, got, targets)
    lp, lq = (torch.log_softmax(torch.from_numpy(x).double(), -1) for x in (ref, got))
    want = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1).numpy()
    np.testing.assert_allclose(kl, want, rtol=1e-10, atol=1e-12)
    assert (kl[:5] == 0).all() and same[:5].all()
    assert (same == (ref.argmax(-1) == got.argmax(-1))).all()
    t = torch.from_numpy(targets[:-1])
    assert nll_ref == pytest.approx(-float(lp[:-1].gather(1, t[:, None]).sum()), rel=1e-12)
    assert nll_got == pytest.approx(-float(lq[:-1].gather(1, t[:, None]).sum()), rel=1e-12)


def test_a_model_against_itself_is_zero(lite_tiny_llama):
    r = kl_divergence(lite_tiny_llama, lite_tiny_llama, KL)
    assert r.mean_kl == 0 and r.max_kl == 0 and r.same_top1 == 1 and r.ppl_model == r.ppl_reference
    assert r.positions == 150 and r.windows == 4  # 48 + 48 + 48 + 6: every token but the last scored


def test_int4_against_fp_matches_the_torch_reference(lite_tiny_llama, tmp_path):
    """lmkit's engine on the fp folder and on its RTN int4 checkpoint against HF fp32 and lite's torch reference of
    the checkpoint on the same windows: the same mean KL, top-token agreement and perplexities."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmkit.lite.awq import quantize_awq
    from lmkit.lite.calib import tokenize_stream
    from lmkit.lite.checkpoint import load_causal_lm
    from lmkit.lite.config import AwqConfig
    from lmkit.lite.corpora import evaluation_corpus

    quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "rtn", w_group_size=32, calib_samples=0))
    got = kl_divergence(lite_tiny_llama, tmp_path / "rtn", KL)

    stream = tokenize_stream(AutoTokenizer.from_pretrained(lite_tiny_llama), evaluation_corpus("pydoc"))[:150]
    fp = AutoModelForCausalLM.from_pretrained(str(lite_tiny_llama), dtype=torch.float32).eval()
    q = load_causal_lm(tmp_path / "rtn")
    kls, same, nll = [], [], [0.0, 0.0]
    with torch.no_grad():
        for b in range(0, 149, 48):
            ids = torch.tensor([stream[b:b + 48]])
            lp, lq = (torch.log_softmax(m(ids).logits[0].double(), -1) for m in (fp, q))
            kls.append((lp.exp() * (lp - lq)).sum(-1))
            same.append(lp.argmax(-1) == lq.argmax(-1))
            nxt = torch.tensor(stream[b + 1:b + 49])
            for k, x in enumerate((lp, lq)):
                nll[k] -= float(x[: len(nxt)].gather(1, nxt[:, None]).sum())
    kl, agree = torch.cat(kls), torch.cat(same).double().mean()
    assert got.mean_kl == pytest.approx(float(kl.mean()), rel=0.05)  # the engine quantizes activations to int8
    assert got.max_kl == pytest.approx(float(kl.max()), rel=0.1)
    assert abs(got.same_top1 - float(agree)) <= 0.03
    assert got.ppl_reference == pytest.approx(np.exp(nll[0] / 149), rel=1e-4)
    assert got.ppl_model == pytest.approx(np.exp(nll[1] / 149), rel=2e-3)
    assert 0 < got.mean_kl and got.same_top1 < 1


def test_cli_kl_table_and_json(lite_tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from lmkit.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["lite", "eval", str(lite_tiny_llama), "--kl"])
    assert result.exit_code == 2 and "name at least two MODELs" in result.output
    out = tmp_path / "kl.json"
    result = runner.invoke(app, ["lite", "eval", str(lite_tiny_llama), str(lite_tiny_llama), "--kl", "--kl-dataset",
                                 "pydoc", "--kl-seqlen", "32", "--kl-max-tokens", "64", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "KL divergence from" in result.output and "100.00%" in result.output
    (row,) = json.loads(out.read_text())["kl"]
    assert row["positions"] == 64 and row["mean_kl"] == 0 and "results" not in json.loads(out.read_text())
