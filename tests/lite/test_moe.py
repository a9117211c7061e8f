"""lmkit lite awq on mixture-of-experts models (issue 23), each a tiny random model: Qwen3-MoE (with a dense
layer from mlp_only_layers), Mixtral (checkpoint names block_sparse_moe.experts.{e}.w1/w3/w2), OLMoE.

Per architecture: the per-layer AWQ map against the module tree (every expert linear in one group; the
shared gate/up group folds into post_attention_layernorm with the router taking the scale, the function
unchanged), the checkpoint in the AutoAWQ MoE layout (the source's names, every expert quantized, the
router fp16) that dequantized by hand equals what the quantizer computed, the engine's logits equal to the
dequantized torch reference, and AWQ closer to the fp model than round-to-nearest. And an expert that
calibration never reaches: reported, and searched on every token rather than on none."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmkit.lite.awq import quantize_awq
from lmkit.lite.blocks import can_fold, can_fold_expert, is_expert_group, self_check
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import AwqConfig
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.moe import ExpertLinears
from tests.factories import MOE_CASES as CASES
from tests.factories import make_moe_model
from tests.helpers import TINY_CALIB, hand_dequantize, prefill_logits_vs_transformers

def _pydoc_ids(folder: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from lmkit.lite.ppl import evaluation_tokens

    return evaluation_tokens(AutoTokenizer.from_pretrained(folder), "pydoc", n).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def moe(request, tmp_path_factory):
    """(case, fp folder, AWQ result, AWQ folder, RTN folder)."""
    case = request.param
    folder = tmp_path_factory.mktemp(f"moe-{case}")
    config_class, overrides, _, _ = CASES[case]
    make_moe_model(folder / "fp", config_class, overrides)
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="autoawq", **TINY_CALIB),
                          keep_pseudo_quantized=True)
    quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "rtn", w_group_size=32, format="autoawq", calib_samples=0))
    return case, folder / "fp", result, folder / "awq", folder / "rtn"


@torch.no_grad()
def test_moe_awq_map_matches_the_module_tree(moe):
    """Per layer: every linear (each expert's gate, up, down; a dense layer's MLP) in exactly one group, the
    decomposition reproduces the layer, every fold (the router taking the shared scale) leaves it unchanged
    but v -> o under GQA, and the layer-wise run reproduces HF's hidden states."""
    case, source, _, _, _ = moe
    lw = LayerwiseModel(source, torch.device("cpu"))
    ref = load_causal_lm(source)
    ids = torch.tensor([_pydoc_ids(source, 80)]).view(2, 40)
    hidden = ref(input_ids=ids, output_hidden_states=True).hidden_states
    x = lw.embed(ids)
    kwargs = lw.capture_layer_kwargs(2, 40)
    sparse = 0
    for i in range(lw.num_layers):
        layer = lw.load_layer(i)
        awq_map = lw.layer_awq_map(i)
        linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert sorted(awq_map.linears) == sorted(linears), (case, i)
        is_sparse = any(isinstance(m, ExpertLinears) for m in layer.modules())
        sparse += is_sparse
        if is_sparse:
            shared = [g for g in awq_map.groups if g.dense]
            assert len(shared) == 1 and shared[0].prev == "post_attention_layernorm" and shared[0].dense == ("mlp.gate",)
        expected = self_check(layer, awq_map, kwargs[i], x, f"layer {i}")
        folds = {g.prev: can_fold(layer, awq_map, g, kwargs[i], x, expected, f"layer {i}") for g in awq_map.groups}
        assert folds.pop("self_attn.v_proj") is False  # GQA
        assert all(folds.values()), folds
        if is_sparse:  # the per-expert check quantize_awq uses agrees, and catches a group wired to two experts
            groups = [g for g in awq_map.groups if is_expert_group(awq_map, g)]
            assert len(groups) == len(layer.get_submodule("mlp.experts"))
            assert all(can_fold_expert(layer, awq_map, g, f"layer {i}") for g in groups)
            before = {k: v.clone() for k, v in layer.state_dict().items()}
            wrong = dataclasses.replace(groups[1], prev=groups[0].prev)
            with pytest.raises(RuntimeError, match="is wrong"):
                can_fold_expert(layer, awq_map, wrong, f"layer {i}")
            assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())  # restored
        x = expected
        if i < lw.num_layers - 1:
            assert float((x - hidden[i + 1]).norm() / hidden[i + 1].norm()) < 1e-5, (case, i)
    assert sparse == (2 if case == "qwen3_moe" else 3)


@torch.no_grad()
def test_moe_checkpoint_is_the_autoawq_layout(moe):
    """Every expert linear of the source becomes .qweight/.qzeros/.scales under its own name (Mixtral:
    block_sparse_moe.experts.{e}.w1), the router stays a plain fp16 .weight, the other tensors keep their
    names; unpacked by hand each expert equals the quantizer's weights."""
    case, source, result, out, _ = moe
    source_names = set(load_file(source / "model.safetensors"))
    tensors = load_file(out / "model.safetensors")
    _, _, names, block = CASES[case]
    names = names or ("gate_proj", "up_proj", "down_proj")
    experts = {n.removesuffix(".weight") for n in source_names if f".{block}.experts." in n}
    assert experts and all(n.rsplit(".", 1)[1] in names for n in experts)
    quantized = experts | {n.removesuffix(".weight") for n in source_names if "self_attn." in n and "_proj" in n}
    quantized |= {n.removesuffix(".weight") for n in source_names if ".mlp." in n and "_proj" in n}  # dense layer
    expected = {n for n in source_names if n.removesuffix(".weight") not in quantized}
    expected |= {f"{q}.{s}" for q in quantized for s in ("qweight", "qzeros", "scales")}
    assert set(tensors) == expected
    routers = [n for n in tensors if n.endswith(f"{block}.gate.weight")]
    assert routers and all(tensors[n].dtype == torch.float16 for n in routers)
    for name in experts:
        assert torch.equal(hand_dequantize(tensors, name, 32), result.pseudo_quantized[name + ".weight"]), name
    report = json.loads((out / "awq" / "report.json").read_text())
    shared = [g for layer in report["layers"] for g in layer["groups"] if g["prev"] == "post_attention_layernorm"]
    assert any(g["smoothed"] for g in shared)
    assert all("experts" in layer for layer in report["layers"] if len(layer["groups"]) > 4)


def test_moe_engine_equals_dequantized_reference_and_awq_beats_rtn(moe):
    """The checkpoint's prompt logits through the engine equal the torch dequantized reference's, and AWQ's
    KL to the fp model on pydoc text is below round-to-nearest's."""
    from lmkit import EngineConfig

    case, source, _, out, rtn = moe
    prompt = _pydoc_ids(out, 48)
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4, case

    ids = torch.tensor(_pydoc_ids(source, 512)).view(4, 128)
    with torch.no_grad():
        ref = load_causal_lm(source)(input_ids=ids).logits.log_softmax(-1)
        kl = {name: float((ref.exp() * (ref - load_causal_lm(folder)(input_ids=ids).logits.log_softmax(-1)))
                          .sum(-1).mean()) for name, folder in (("awq", out), ("rtn", rtn))}
    assert kl["awq"] < 0.8 * kl["rtn"], (case, kl)


@torch.no_grad()
def test_an_expert_calibration_never_reaches_is_reported_and_searched_on_every_token(tmp_path):
    """Three experts, top-1, routers r1 = r0 + a and r2 = r0 - a: expert 0's logit lies between the other two
    for every token, so no calibration token reaches it. The report names it with 0 tokens in every sparse
    layer (and any other expert below one group's worth of tokens), and its down projection is searched on
    the union of tokens (its smoothing and clipping chosen from them, not from none)."""
    def router(i, w):
        a = torch.randn(w.shape[1]) / w.shape[1] ** 0.5
        w[1], w[2] = w[0] + a, w[0] - a

    overrides = dict(num_experts=3, num_experts_per_tok=1, moe_intermediate_size=64, intermediate_size=128,
                     norm_topk_prob=False)
    make_moe_model(tmp_path / "fp", "Qwen3MoeConfig", overrides, seed=3, router=router)
    from typer.testing import CliRunner

    from lmkit.cli.main import app

    run = CliRunner().invoke(app, ["lite", "awq", str(tmp_path / "fp"), "--work-dir", str(tmp_path / "awq"),
                                   "--w-group-size", "32", "--calib-dataset", "pydoc", "--calib-samples", "8",
                                   "--calib-seqlen", "64", "--search-samples", "4"])
    assert run.exit_code == 0, run.output
    assert "experts reached by fewer than 32 calibration tokens" in " ".join(run.output.split()), run.output
    report = json.loads((tmp_path / "awq" / "awq" / "report.json").read_text())
    for layer in report["layers"]:
        experts = layer["experts"]
        tokens = experts["tokens_per_expert"]
        assert tokens[0] == 0 and sum(tokens) == 8 * 64, experts
        assert experts["searched_on_all_tokens"] == [e for e in range(3) if tokens[e] < 32], experts
        down = next(g for g in layer["groups"] if g["linears"] == ["mlp.experts.0.down_proj"])
        assert "loss" in down  # the scale search ran, on the rebuilt statistics
