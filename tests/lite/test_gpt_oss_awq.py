"""lmkit lite awq on gpt-oss (GptOssForCausalLM), tests/factories.py's tiny random ``gpt_oss`` case: attention with
sinks and q/k/v/o biases, every MLP 4 biased experts (top 2) with the clamped SwiGLU, its limit low enough that the
clamps cut; its experts as transformers saves them (float, gate and up columns interleaved) and as the hub ships them
(MXFP4 blocks, dequantized for calibration). The layer-wise model reproduces HF's hidden states with the experts as
one biased linear per expert, the checkpoint holds each expert's gate, up and down as int4 beside its fp16 bias (router
and sinks fp16), unpacked by hand equal to what the quantizer computed, the engine's logits on it equal the dequantized
torch reference's, and AWQ is closer to the fp model than round-to-nearest."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmkit.lite.awq import quantize_awq
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import AwqConfig
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.lite.moe import ExpertLinears
from tests.factories import build_case
from tests.helpers import TINY_CALIB, hand_dequantize, prefill_logits_vs_transformers
from tests.models.test_gpt_oss import write_mxfp4

NUM_EXPERTS = 4


def _pydoc_ids(folder, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from lmkit.lite.ppl import evaluation_tokens

    return evaluation_tokens(AutoTokenizer.from_pretrained(folder), "pydoc", n).tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"float": (folder, HF reference), "mxfp4": (folder, HF reference with transformers' dequantized experts)}."""
    fp = tmp_path_factory.mktemp("gpt-oss-fp")
    ref = build_case("gpt_oss", fp)
    mx = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    mx_ref = build_case("gpt_oss", tmp_path_factory.mktemp("gpt-oss-fp-copy"))
    write_mxfp4(fp, mx_ref, mx)
    return {"float": (fp, ref), "mxfp4": (mx, mx_ref)}


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def quantized(request, folders, tmp_path_factory):
    """(form, source folder, HF reference of the source, AWQ result, AWQ folder)."""
    source, ref = folders[request.param]
    out = tmp_path_factory.mktemp(f"gpt-oss-awq-{request.param}") / "awq"
    result = quantize_awq(source, AwqConfig(work_dir=out, w_group_size=32, format="autoawq", **TINY_CALIB),
                          keep_pseudo_quantized=True)
    return request.param, source, ref, result, out


@torch.no_grad()
@pytest.mark.parametrize("form", ["float", "mxfp4"])
def test_layerwise_model_reproduces_hf_with_per_expert_linears(folders, form):
    """Each layer materialised with its experts unfused (gate and up de-interleaved, biases apart; MXFP4 dequantized as
    transformers does) gives HF's hidden states, layer after layer."""
    source, ref = folders[form]
    lw = LayerwiseModel(source, torch.device("cpu"))
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(3))
    hidden = ref(input_ids=ids, output_hidden_states=True).hidden_states
    x = lw.embed(ids)
    kwargs = lw.capture_layer_kwargs(2, 40)
    for i in range(lw.num_layers):
        layer = lw.load_layer(i)
        experts = layer.get_submodule("mlp.experts")
        assert isinstance(experts, ExpertLinears) and len(experts) == NUM_EXPERTS
        assert all(experts.linear(e, w).bias is not None for e in range(NUM_EXPERTS) for w in range(3))
        x = layer(x, **kwargs[i])
        if i < lw.num_layers - 1:
            assert float((x - hidden[i + 1]).norm() / hidden[i + 1].norm()) < 1e-5, (form, i)


@torch.no_grad()
def test_checkpoint_holds_int4_experts_with_fp16_biases(quantized):
    form, source, _, result, out = quantized
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert not any(n.endswith(("_blocks", "_scales", "gate_up_proj", "gate_up_proj_bias")) for n in tensors), form
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for e in range(NUM_EXPERTS):
            for linear in ("gate_proj", "up_proj", "down_proj"):
                name = f"{p}mlp.experts.{e}.{linear}"
                assert tensors[name + ".bias"].dtype == torch.float16
                assert torch.equal(hand_dequantize(tensors, name, 32), result.pseudo_quantized[name + ".weight"])
        for name in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks", "self_attn.o_proj.bias"):
            assert tensors[p + name].dtype == torch.float16, name  # fp16: routers and sinks are not quantized
        assert p + "self_attn.q_proj.qweight" in tensors and p + "self_attn.o_proj.qweight" in tensors
    report = json.loads((out / "awq" / "report.json").read_text())
    for layer in report["layers"]:
        groups = {g["prev"]: g for g in layer["groups"]}
        assert groups["post_attention_layernorm"]["smoothed"]  # the experts' gate and up (router takes the scale)
        downs = [g for g in layer["groups"] if g["linears"][0].endswith("down_proj")]
        assert len(downs) == NUM_EXPERTS and not any(g["smoothed"] for g in downs)  # the clamp: never smoothed


def test_engine_logits_equal_the_dequantized_reference_and_awq_beats_rtn(quantized, tmp_path):
    from lmkit import EngineConfig

    form, source, ref, _, out = quantized
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4, form

    rtn = tmp_path / "rtn"
    quantize_awq(source, AwqConfig(work_dir=rtn, w_group_size=32, format="autoawq", calib_samples=0))
    ids = torch.tensor(_pydoc_ids(source, 512)).view(4, 128)  # text like the calibration's, not random ids
    with torch.no_grad():
        fp = ref(input_ids=ids).logits.log_softmax(-1)
        kl = {name: float((fp.exp() * (fp - load_causal_lm(folder)(input_ids=ids).logits.log_softmax(-1)))
                          .sum(-1).mean()) for name, folder in (("awq", out), ("rtn", rtn))}
    assert kl["awq"] < kl["rtn"], (form, kl)


def test_compressed_tensors_checkpoint_loads_in_the_engine(folders, tmp_path):
    """The default format: compressed-tensors keeps the router out (``ignore``), the biased experts load and give the
    dequantized reference's logits."""
    from lmkit import EngineConfig

    source, _ = folders["mxfp4"]
    out = tmp_path / "ct"
    quantize_awq(source, AwqConfig(work_dir=out, w_group_size=32, **TINY_CALIB))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "re:.*mlp\\.router$" in qc["ignore"]
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4
