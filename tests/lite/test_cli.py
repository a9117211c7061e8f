"""`lmkit lite awq` and `lmkit lite ppl` run end to end; errors print one line, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from lmkit.cli.main import app


def test_cli_awq_then_ppl(lite_tiny_llama, tmp_path):
    out = tmp_path / "awq"
    runner = CliRunner()
    result = runner.invoke(app, ["lite", "awq", str(lite_tiny_llama), "--work-dir", str(out), "--w-group-size", "32",
                                 "--calib-dataset", "pydoc", "--calib-samples", "8", "--calib-seqlen", "64",
                                 "--search-samples", "4", "--eval", "--eval-dataset", "pydoc"])
    assert result.exit_code == 0, result.output
    for text in ("AWQ int4", "layers", "group size", "32", "time", "size", "perplexity"):
        assert text in result.output, (text, result.output)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]  # the default: compressed-tensors
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    report = json.loads((out / "awq" / "report.json").read_text())
    assert report["ppl_before"]["ppl"] > 1 and report["ppl_after"]["ppl"] > 1
    # the checkpoint's next-token distributions against the source's (lite/kl.py), on the same text
    kl = report["kl"]
    assert kl["reference"] == str(lite_tiny_llama) and kl["model"] == str(out) and kl["dataset"] == "pydoc"
    assert kl["positions"] > 0 and 0 < kl["mean_kl"] < kl["max_kl"] and 0 < kl["same_top1"] <= 1
    assert kl["ppl_reference"] > 1 and kl["ppl_model"] > 1
    assert "KL from the source" in result.output and "same top token" in result.output
    assert report["task_differences"] is None  # (no --tasks)

    result = runner.invoke(app, ["lite", "ppl", str(out), "--dataset", "pydoc", "--seqlen", "64",
                                 "--max-tokens", "256"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "perplexity" in said and "(compressed-tensors, 252 tokens evaluated in 4 windows of 64" in said


def test_cli_rtn_flag(lite_tiny_llama, tmp_path):
    """--rtn, and no --w-group-size: the largest supported size that divides every layer (inputs of 64 and 128)."""
    result = CliRunner().invoke(app, ["lite", "awq", str(lite_tiny_llama), "--work-dir", str(tmp_path / "rtn"),
                                      "--rtn"])
    assert result.exit_code == 0, result.output
    assert "RTN int4" in result.output
    qc = json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lmkit", "lite", "awq", str(tmp_path / "missing"), "--work-dir",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "error:" in run.stderr and "does not exist" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "lmkit", "lite", "awq", "smollm2", "--work-dir", str(tmp_path / "o"),
                          "--w-group-size", "48"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "--w-group-size must be one of 32, 64, 128" in run.stderr


def test_a_failed_kl_measure_keeps_the_checkpoint(lite_tiny_llama, tmp_path, monkeypatch):
    """--eval's KL runs both models in lmkit's engine: if it fails (a model the engine refuses, memory), the
    checkpoint is written all the same and the report says why the measure is missing."""
    import lmkit.lite.kl

    def refuse(*args, **kwargs):
        raise ValueError("the engine refused it")

    monkeypatch.setattr(lmkit.lite.kl, "kl_divergence", refuse)
    out = tmp_path / "rtn"
    result = CliRunner().invoke(app, ["lite", "awq", str(lite_tiny_llama), "--work-dir", str(out), "--rtn",
                                      "--w-group-size", "32", "--eval", "--eval-dataset", "pydoc"])
    assert result.exit_code == 0, result.output
    assert "not measured: ValueError: the engine refused it" in " ".join(result.output.split())
    report = json.loads((out / "awq" / "report.json").read_text())
    assert report["kl"] == {"error": "ValueError: the engine refused it"} and report["ppl_after"]["ppl"] > 1
    assert (out / "config.json").exists()
