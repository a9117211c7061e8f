"""lmkit lite awq on Gemma 4 (dense), as a tiny random model with attention_k_eq_v (its global layers have no
v_proj and 32-wide heads beside the sliding layers' 16), plain-w norms, a value norm and a stored scalar per layer. The layer-wise decomposition reproduces HF's layers (checked inside the quantizer), the
saved smoothing scales leave the fp model unchanged, o_proj is never smoothed (a per-head norm sits between v_proj
and it), and the checkpoint's logits through the engine equal the dequantized torch reference; so for the checkpoint Google
ships (Gemma4ForConditionalGeneration: the text model quantized under model.language_model, the vision tower carried
over in fp16); its KV calibration writes a policy the engine reads. And the other two forms: the MoE one (26B-A4B: a
dense MLP beside routed experts; every expert int4, the router fp16) and the E-models' (E2B/E4B: per-layer inputs, the
last layers reading earlier layers' KV; the per-layer-input linears and tables fp16): the layer-wise pass reproduces
HF's hidden states, and the engine's logits equal the dequantized reference's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmkit.lite.apply import fold_scales
from lmkit.lite.awq import quantize_awq
from lmkit.lite.checkpoint import load_causal_lm
from lmkit.lite.config import AwqConfig, KvCalibConfig
from lmkit.kv_policy import load_kv_policy
from lmkit.lite.kvcalib import calibrate_kv
from lmkit.lite.moe import layer_awq_map
from lmkit.models import get_awq_map, load_model_spec
from tests.factories import ARCH_CASES, Case, _write_case, write_gemma4_multimodal
from tests.helpers import TINY_CALIB, hand_dequantize, prefill_logits_vs_transformers


@pytest.fixture(scope="module", params=[False, True], ids=["text", "multimodal"])
def quantized(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-awq")
    if request.param:
        write_gemma4_multimodal(folder / "fp", "gemma4_k_eq_v", seed=75)
    else:
        _write_case(ARCH_CASES["gemma4_k_eq_v"], folder / "fp")
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="autoawq",
                                                   **TINY_CALIB), keep_pseudo_quantized=True)
    return folder / "fp", result, folder / "awq"


@torch.no_grad()
def test_smoothing_leaves_the_model_unchanged_and_skips_o_proj(quantized):
    source, result, out = quantized
    config = json.loads((source / "config.json").read_text())
    multimodal = "text_config" in config
    awq_map = get_awq_map(config["architectures"][0])
    tensors = load_file(out / "model.safetensors")
    types = (config["text_config"] if multimodal else config)["layer_types"]
    prefix = "model.language_model.layers" if multimodal else "model.layers"
    assert not multimodal or any(n.startswith("model.vision_tower.") for n in tensors)
    for i, kind in enumerate(types):  # a global layer (attention_k_eq_v) has no v_proj, quantized or not
        has_v = any(n.startswith(f"{prefix}.{i}.self_attn.v_proj.") for n in tensors)
        assert has_v == (kind == "sliding_attention"), (i, kind)
        assert f"{prefix}.{i}.self_attn.o_proj.qweight" in tensors
    model = load_causal_lm(source)
    ids = torch.randint(0, 250, (2, 48), generator=torch.Generator().manual_seed(1))
    fp_logits = model(input_ids=ids).logits
    search = load_file(out / "awq" / "search.safetensors")
    folded = 0
    for i, layer in enumerate(model.model.layers):
        for group in layer_awq_map(awq_map, layer).groups:  # a global layer's first group: q, k
            key = f"scales/model.layers.{i}.{group.prev}"
            if key in search:
                assert group.fold, key
                fold_scales(layer, group, search[key], awq_map.norm_weight_offset)
                folded += 1
    assert folded > 0
    assert float((model(input_ids=ids).logits - fp_logits).norm() / fp_logits.norm()) < 1e-5
    report = json.loads((out / "awq" / "report.json").read_text())
    o_proj = [g for layer in report["layers"] for g in layer["groups"] if g["linears"] == ["self_attn.o_proj"]]
    assert len(o_proj) == len(types) and not any(g["smoothed"] for g in o_proj)


def test_engine_logits_equal_the_dequantized_reference(quantized):
    from lmkit import EngineConfig

    _, _, out = quantized
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_kv_calibration_of_the_checkpoint(quantized, tmp_path):
    """The AWQ checkpoint calibrates (a policy the engine's reader takes: per-layer head dims as the spec has them)."""
    _, _, out = quantized
    result = calibrate_kv(out, KvCalibConfig(work_dir=tmp_path / "kv", calib_dataset="pydoc", calib_samples=4,
                                             calib_seqlen=32, eval_dataset="pydoc", eval_seqlen=32,
                                             eval_max_tokens=64, device="cpu"))
    spec = load_model_spec(out)
    assert load_kv_policy(result.policy_path, spec.num_layers, spec.num_kv_heads, spec.head_dim) == result.layers


# the factory's MoE case has moe_intermediate_size 24, which no group size divides: 32 here
OTHER_FORMS = {"moe": Case("Gemma4TextConfig", dict(ARCH_CASES["gemma4_moe"].kwargs, moe_intermediate_size=32),
                           seed=81, unit_scores=True),
               "e": ARCH_CASES["gemma4_e"]}


@pytest.fixture(scope="module", params=sorted(OTHER_FORMS))
def other_form(request, tmp_path_factory):
    """(form, fp folder, AWQ result, AWQ folder, RTN folder)."""
    folder = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    _write_case(OTHER_FORMS[request.param], folder / "fp")
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="autoawq",
                                                   **TINY_CALIB), keep_pseudo_quantized=True)
    quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "rtn", w_group_size=32, format="autoawq", calib_samples=0))
    return request.param, folder / "fp", result, folder / "awq", folder / "rtn"


@torch.no_grad()
def test_other_forms_layerwise_pass_reproduces_hf(other_form):
    """The layer-wise model run layer by layer (per-layer inputs and shared KV carried by LayerRunner; the experts
    unfused) gives HF's hidden states, also as the reference stream of a run beside a drifted one (each stream
    reads its own shared KV); its AWQ map covers every quantized linear."""
    from lmkit.lite.blocks import LayerRunner, self_check
    from lmkit.lite.layerwise import LayerwiseModel

    form, source, _, _, _ = other_form
    lw = LayerwiseModel(source, torch.device("cpu"))
    ref = load_causal_lm(source)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(3))
    hidden = ref(input_ids=ids, output_hidden_states=True).hidden_states
    x = lw.embed(ids)
    drifted = x + 0.1 * x.std() * torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    alone = drifted.clone()  # the drifted stream run on its own: the paired run must give it the same outputs
    runner, runner_alone = LayerRunner(lw, 40), LayerRunner(lw, 40)
    for i in range(lw.num_layers):
        layer = lw.load_layer(i)
        linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        fp16 = {n for n in linears if n.startswith(("per_layer_", "router."))}  # kept fp16
        assert sorted(lw.layer_awq_map(i).linears) == sorted(linears - fp16), (form, i)
        self_check(layer, lw.layer_awq_map(i), runner.kwargs(i, 2), x, f"layer {i}")
        runner.run(layer, i, drifted, drifted, reference=(x, x))
        runner_alone.run(layer, i, alone, alone)
        assert torch.equal(drifted, alone), (form, i)
        if i < lw.num_layers - 1:
            assert float((x - hidden[i + 1]).norm() / hidden[i + 1].norm()) < 1e-5, (form, i)


@torch.no_grad()
def test_other_forms_checkpoint_layout(other_form):
    form, source, result, out, _ = other_form
    tensors = load_file(out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    for name, value in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            assert torch.equal(hand_dequantize(tensors, base, 32), result.pseudo_quantized[base + ".weight"]), name
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert p + "mlp.down_proj.qweight" in tensors and p + "self_attn.q_proj.qweight" in tensors
        if form == "moe":
            for e in range(config["num_experts"]):
                assert all(f"{p}experts.{e}.{w}.qweight" in tensors for w in ("gate_proj", "up_proj", "down_proj"))
            for name in ("router.proj.weight", "router.scale", "router.per_expert_scale"):
                assert tensors[p + name].dtype == torch.float16
        else:
            for name in ("per_layer_input_gate.weight", "per_layer_projection.weight"):
                assert tensors[p + name].dtype == torch.float16
    if form == "e":
        assert tensors["model.embed_tokens_per_layer.weight"].dtype == torch.float16
        shared = [i for i in range(config["num_hidden_layers"]) if f"model.layers.{i}.self_attn.k_proj.qweight"
                  not in tensors]
        assert shared == [4, 5]  # the layers that read earlier layers' KV have no k/v projections
    else:
        report = json.loads((out / "awq" / "report.json").read_text())
        experts = [g for layer in report["layers"] for g in layer["groups"]
                   if g["prev"] == "pre_feedforward_layernorm_2"]
        assert len(experts) == config["num_hidden_layers"] and any(g["smoothed"] for g in experts)


def test_other_forms_engine_equals_dequantized_reference_and_awq_beats_rtn(other_form):
    from lmkit import EngineConfig

    form, source, _, out, rtn = other_form
    prompt = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    assert float((got - want).norm() / want.norm()) < 1e-4, form
    from transformers import AutoTokenizer

    from lmkit.lite.ppl import evaluation_tokens

    ids = evaluation_tokens(AutoTokenizer.from_pretrained(source), "pydoc", 512).view(4, 128)
    with torch.no_grad():
        fp = load_causal_lm(source)(input_ids=ids).logits.log_softmax(-1)
        kl = {name: float((fp.exp() * (fp - load_causal_lm(folder)(input_ids=ids).logits.log_softmax(-1)))
                          .sum(-1).mean()) for name, folder in (("awq", out), ("rtn", rtn))}
    assert kl["awq"] < kl["rtn"], (form, kl)
