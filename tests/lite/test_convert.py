"""``lmkit lite convert``: an int4 checkpoint moves between AutoAWQ GEMM and compressed-tensors pack-quantized
without a bit changing: converting the AutoAWQ folder of a `lite awq` run gives exactly the compressed-tensors
folder the same run writes, and back; a symmetric checkpoint made by compressed-tensors' own compressor
converts to AutoAWQ with the weights its own decompressor gives; what a target cannot hold fails before
anything is written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lmkit.cli.main import app
from lmkit.lite.checkpoint import read_state_dict
from lmkit.lite.convert import convert_checkpoint
from tests.helpers import EXACT_ENGINE, engine_logits

pytest.importorskip("compressed_tensors")


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _assert_same_checkpoint(got_folder, want_folder) -> None:
    got, want = _tensors(got_folder), _tensors(want_folder)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert _config(got_folder) == _config(want_folder)
    for side in ("tokenizer.json", "tokenizer_config.json"):
        if (want_folder / side).exists():
            assert (got_folder / side).read_bytes() == (want_folder / side).read_bytes()


def test_autoawq_to_compressed_tensors_is_what_lite_awq_writes(both_formats, tmp_path):
    awq_folder, ct_folder = both_formats
    result = convert_checkpoint(awq_folder, tmp_path / "ct", "compressed-tensors")
    assert (result.source_format, result.checkpoint_format, result.group_size) == ("autoawq", "compressed-tensors",
                                                                                    32)
    assert result.num_linears == sum(1 for n in _tensors(awq_folder) if n.endswith(".qweight")) > 0
    _assert_same_checkpoint(tmp_path / "ct", ct_folder)
    assert (tmp_path / "ct" / ".lmkit-complete").exists()


def test_compressed_tensors_to_autoawq_and_the_engine_serves_it(both_formats, tmp_path):
    awq_folder, ct_folder = both_formats
    convert_checkpoint(ct_folder, tmp_path / "awq", "autoawq")
    _assert_same_checkpoint(tmp_path / "awq", awq_folder)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (2, 29)]
    for (full_a, got_a), (full_b, got_b) in zip(engine_logits(tmp_path / "awq", prompts, EXACT_ENGINE, 5),
                                                            engine_logits(ct_folder, prompts, EXACT_ENGINE, 5)):
        assert full_a == full_b
        assert np.linalg.norm(got_a - got_b) / np.linalg.norm(got_b) <= 1e-5


def test_symmetric_compressed_tensors_of_its_own_compressor(tmp_path):
    """compressed-tensors' symmetric checkpoint (no zero points): AutoAWQ gets zero 8 and the same weights as
    compressed-tensors' decompressor gives, and converting back gives what that reader reads again."""
    from tests.factories import make_tiny_model, write_compressed_tensors

    make_tiny_model(tmp_path / "fp", "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2)
    src = write_compressed_tensors(tmp_path / "fp", tmp_path / "sym", group=64, symmetric=True,
                                   scale_dtype=torch.float16) / "int4"
    convert_checkpoint(src, tmp_path / "awq", "autoawq")
    want, _ = read_state_dict(src)
    got, settings = read_state_dict(tmp_path / "awq")
    assert settings["quant_method"] == "awq" and settings["group_size"] == 64
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    convert_checkpoint(tmp_path / "awq", tmp_path / "ct", "compressed-tensors")
    again, _ = read_state_dict(tmp_path / "ct")
    for name in want:
        assert torch.equal(again[name], want[name]), name


def test_what_cannot_be_converted_fails_before_writing(lite_tiny_llama, both_formats, tmp_path):
    from safetensors.torch import save_file

    awq_folder, ct_folder = both_formats
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no int4 quantization_config .* `lmkit lite awq"):
        convert_checkpoint(lite_tiny_llama, out, "autoawq")
    with pytest.raises(ValueError, match="already a autoawq checkpoint"):
        convert_checkpoint(awq_folder, out, "autoawq")
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        convert_checkpoint(awq_folder, out, "gguf")
    # act-order: a g_idx that scatters the groups over the inputs has no AutoAWQ form
    act_order = tmp_path / "act-order"
    shutil.copytree(ct_folder, act_order)
    tensors = _tensors(act_order)
    base = "model.layers.1.mlp.down_proj."
    in_features = int(tensors[base + "weight_shape"][1])
    tensors[base + "weight_g_idx"] = (torch.arange(in_features, dtype=torch.int32) % (in_features // 32))
    save_file(tensors, str(act_order / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: act-order"):
        convert_checkpoint(act_order, out, "autoawq")
    # fp32 scales that fp16 cannot hold exactly: AutoAWQ stores fp16 scales
    wide = tmp_path / "wide-scales"
    shutil.copytree(ct_folder, wide)
    tensors = _tensors(wide)
    tensors[base + "weight_scale"] = tensors[base + "weight_scale"].float() * (1 + 2**-20)
    save_file(tensors, str(wide / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: .*scales .* not exact in fp16"):
        convert_checkpoint(wide, out, "autoawq")
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_cli(both_formats, tmp_path):
    awq_folder, _ = both_formats
    runner = CliRunner()
    result = runner.invoke(app, ["lite", "convert", str(awq_folder), "--work-dir", str(tmp_path / "ct"), "--format",
                                 "compressed-tensors"])
    assert result.exit_code == 0, result.output
    assert "autoawq -> compressed-tensors" in result.output and "group size 32" in result.output
    assert _config(tmp_path / "ct")["quantization_config"]["quant_method"] == "compressed-tensors"
