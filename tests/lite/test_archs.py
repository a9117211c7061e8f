"""lmkit lite on the architectures of issue 22, each as a tiny random model: Qwen3 (q/k norms), Gemma 2
(norms before and after each block scaling by 1 + w, soft-caps, query_pre_attn_scalar, alternating
windows), Gemma 3 (q/k norms, local and global rotary tables), Phi-3 and a Phi-4-mini shape (fused qkv_proj
and gate_up_proj; GQA, partial rotary, LongRoPE), SmolLM3 (no RoPE on every 4th layer).

Per architecture: the AWQ map against the HF module tree (and the layer-wise run against HF's own hidden
states), AWQ end to end (the checkpoint keeps the source's tensor names, fused ones included; dequantized
here by hand it reproduces the quantized model), the quantized model's perplexity through the engine
equals the dequantized torch reference, and KV calibration (the fake-quant attention equals a float64
reference: K after q/k norm and RoPE, scaling, soft-cap, window) writes a valid kv_policy.json."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lmkit.kv_policy import load_kv_policy
from lmkit.lite.apply import fold_scales
from lmkit.lite.awq import quantize_awq
from lmkit.lite.blocks import can_fold, self_check
from lmkit.lite.checkpoint import load_causal_lm, read_state_dict
from lmkit.lite.config import AwqConfig, KvCalibConfig
from lmkit.lite.kvcalib import calibrate_kv
from lmkit.lite.kvquant import fake_quant_kv, use_kv_fake_quant_attention
from lmkit.lite.layerwise import LayerwiseModel
from lmkit.models import get_awq_map
from tests.factories import LITE_ARCH_CASES as CASES
from tests.factories import LITE_BASE as BASE
from tests.factories import make_arch_model
from tests.helpers import TINY_CALIB, assert_int4_kl_per_layer, hand_dequantize, prefill_logits_vs_transformers

TINY_KV = dict(calib_dataset="pydoc", calib_samples=4, calib_seqlen=64, eval_dataset="pydoc", eval_seqlen=64,
               eval_max_tokens=256, device="cpu")
@pytest.fixture(scope="module", params=sorted(CASES))
def arch(request, tmp_path_factory):
    """(case, source folder, AWQ result, AWQ folder): each case quantized once for the tests below."""
    case = request.param
    folder = tmp_path_factory.mktemp(f"arch-{case}")
    make_arch_model(folder / "fp", case)
    result = quantize_awq(folder / "fp", AwqConfig(work_dir=folder / "awq", w_group_size=32, format="autoawq", **TINY_CALIB),
                          keep_pseudo_quantized=True)
    return case, folder / "fp", result, folder / "awq"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ids(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 250, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_awq_map_matches_the_module_tree(arch):
    """Every linear of a decoder layer is in exactly one group, the decomposition the searches use
    reproduces each layer, each fold leaves the layer unchanged (the only refusal: v -> o under GQA), and
    the layer-wise run (embedding, captured per-layer arguments) reproduces HF's hidden states."""
    case, source, _, _ = arch
    lw = LayerwiseModel(source, torch.device("cpu"))
    awq_map = lw.awq_map
    ref = load_causal_lm(source)
    ids = _ids(2, 40, 0)
    hidden = ref(input_ids=ids, output_hidden_states=True).hidden_states
    x = lw.embed(ids)
    assert torch.equal(x, hidden[0])  # Gemma: scaled by sqrt(hidden_size)
    kwargs = lw.capture_layer_kwargs(2, 40)
    for i in range(lw.num_layers):
        layer = lw.load_layer(i)
        linears = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert sorted(awq_map.linears) == sorted(linears), (case, awq_map.linears)
        expected = self_check(layer, awq_map, kwargs[i], x, f"layer {i}")
        folds = {g.prev: can_fold(layer, awq_map, g, kwargs[i], x, expected, f"layer {i}") for g in awq_map.groups}
        v_to_o = awq_map.groups[1]
        assert v_to_o.linears == ("self_attn.o_proj",)
        assert folds.pop(v_to_o.prev) == CASES[case][3]
        assert all(folds.values()), folds
        x = expected
        if i < lw.num_layers - 1:  # the last hidden state HF reports is after the final norm
            assert _rel(x, hidden[i + 1]) < 1e-6, (case, i)


@torch.no_grad()
def test_awq_checkpoint_reproduces_the_quantized_model(arch):
    """The checkpoint holds the source's tensors under the source's names (a quantized linear's
    ``.weight`` becomes ``.qweight/.qzeros/.scales``: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` too);
    dequantized by hand it equals what the quantizer computed, and the source model with the saved scales
    folded in and those weights gives the checkpoint's logits."""
    case, source, result, out = arch
    config = json.loads((out / "config.json").read_text())
    awq_map = get_awq_map(config["architectures"][0])
    source_names = set(load_file(source / "model.safetensors"))
    tensors = load_file(out / "model.safetensors")
    quantized = {f"model.layers.{i}.{n}" for i in range(4) for n in awq_map.linears}
    expected_names = {n for n in source_names if n.removesuffix(".weight") not in quantized}
    expected_names |= {f"{q}.{suffix}" for q in quantized for suffix in ("qweight", "qzeros", "scales")}
    assert set(tensors) == expected_names
    if case.startswith("phi"):
        assert "model.layers.0.self_attn.qkv_proj.qweight" in tensors and "model.layers.0.mlp.gate_up_proj.scales" in tensors

    state, _ = read_state_dict(out)
    for name in quantized:
        weight = hand_dequantize(tensors, name, 32)
        assert torch.equal(weight, result.pseudo_quantized[name + ".weight"]), name
        assert torch.equal(state[name + ".weight"], weight), name

    model = load_causal_lm(source)
    ids = _ids(2, 48, 1)
    fp_logits = model(input_ids=ids).logits
    search = load_file(out / "awq" / "search.safetensors")
    for i, layer in enumerate(model.model.layers):
        for group in awq_map.groups:
            key = f"scales/model.layers.{i}.{group.prev}"
            if key in search:
                fold_scales(layer, group, search[key], awq_map.norm_weight_offset)
    assert _rel(model(input_ids=ids).logits, fp_logits) < 1e-5  # smoothing leaves the fp function unchanged
    for name, param in model.named_parameters():
        weight = result.pseudo_quantized.get(name)
        param.copy_(weight if weight is not None else param.half().float())  # the rest is stored in fp16
    got = load_causal_lm(out)(input_ids=ids).logits
    assert _rel(got, model(input_ids=ids).logits) < 1e-5

    report = json.loads((out / "awq" / "report.json").read_text())
    v_to_o = [layer["groups"][1] for layer in report["layers"]]
    assert all(("reason" not in g) == CASES[case][3] for g in v_to_o), v_to_o
    assert any(g["smoothed"] for layer in report["layers"] for g in layer["groups"])


def test_engine_perplexity_equals_dequantized_reference(arch):
    """The AWQ checkpoint's perplexity through the engine equals the torch dequantized reference's
    (prompt logits of 48 tokens of pydoc: longer than the windows and Phi-4's original context)."""
    from transformers import AutoTokenizer

    from lmkit import EngineConfig
    from lmkit.lite.ppl import evaluation_tokens

    case, _, _, out = arch
    prompt = evaluation_tokens(AutoTokenizer.from_pretrained(out), "pydoc", 48).tolist()
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=4, int8_activations=False)
    got, want = prefill_logits_vs_transformers(out, prompt, config)
    targets = torch.tensor(prompt[1:]).unsqueeze(1)

    def ppl(logits: torch.Tensor) -> float:
        return math.exp(-float(torch.log_softmax(logits.double(), -1).gather(1, targets).mean()))

    assert _rel(got, want) < 1e-4, case
    assert ppl(got) == pytest.approx(ppl(want), rel=1e-5), case


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _reference_attention(case: str, attn, config, h: torch.Tensor, cos, sin, bits: int) -> torch.Tensor:
    """The attention block in float64, written out here: projections (Phi-3: rows q | k | v of qkv_proj),
    q/k RMSNorm over head_dim (Gemma: 1 + w), RoPE on the first cos.shape[-1] dims (none where the layer
    has none), K and V fake-quantized per token and KV head, scores * scaling, soft-cap, causal window,
    GQA softmax, o_proj."""
    b, s, _ = h.shape
    d = attn.head_dim
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    if hasattr(attn, "qkv_proj"):
        q, k, v = (h @ attn.qkv_proj.weight.double().T).split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
    else:
        q, k, v = (h @ getattr(attn, f"{p}_proj").weight.double().T for p in "qkv")
    q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
    if hasattr(attn, "q_norm"):
        offset = 1.0 if case.startswith("gemma") else 0.0

        def rms(x, w):
            return x / torch.sqrt(x.square().mean(-1, keepdim=True) + config.rms_norm_eps) * (offset + w.double())

        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    if getattr(attn, "use_rope", True):
        r = cos.shape[-1]
        q = torch.cat([q[..., :r] * cos + _rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
        k = torch.cat([k[..., :r] * cos + _rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
    k, v = fake_quant_kv(k, bits), fake_quant_kv(v, bits)
    k, v = k.repeat_interleave(n_heads // n_kv, dim=1), v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = q @ k.transpose(-1, -2) * attn.scaling
    if case == "gemma2":
        cap = config.attn_logit_softcapping
        scores = torch.tanh(scores / cap) * cap
    pos = torch.arange(s)
    allowed = pos.view(-1, 1) >= pos.view(1, -1)
    window = attn.sliding_window if hasattr(attn, "sliding_window") else config.sliding_window  # Phi-3: config's
    if window:
        allowed &= pos.view(-1, 1) - pos.view(1, -1) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    return out @ attn.o_proj.weight.double().T


@torch.no_grad()
def test_kv_fake_quant_attention_matches_reference(arch):
    case, source, _, _ = arch
    lm = load_causal_lm(source)
    ids = _ids(2, 40, 2)
    plain = lm(input_ids=ids).logits
    use_kv_fake_quant_attention(lm)
    assert torch.equal(lm(input_ids=ids, kv_bits=[0] * 4, use_cache=False).logits, plain)
    bits = [4, 8, 4, 8]
    seen: dict[int, dict] = {}
    handles = []
    for i, layer in enumerate(lm.model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.setdefault(i, {}).update(kw), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: seen[i].update(out=out[0])))
    try:
        lm(input_ids=ids, kv_bits=bits, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    windows = set()
    for i, layer in enumerate(lm.model.layers):
        cos, sin = (t.double().unsqueeze(1) for t in seen[i]["position_embeddings"])
        want = _reference_attention(case, layer.self_attn, lm.config, seen[i]["hidden_states"].double(), cos, sin,
                                    bits[i])
        # 1e-3: the model's float32 K/V may fall on the other side of a rounding boundary than float64's
        # (one int8 step moves the output by ~1e-4); a missed scaling, soft-cap or window moves it by > 1e-2
        assert _rel(seen[i]["out"], want) < 1e-3, (case, i)
        windows.add(getattr(layer.self_attn, "sliding_window", None))
    if case.startswith("gemma"):
        assert windows == {None, 16}  # windowed and full layers both checked, the window shorter than the text


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_int4_kl_head_as_the_model_computes_it(case, tmp_path):
    """The one-layer-at-a-time KL restarts from recorded layer inputs and ends with the model's own head
    (Gemma 2: the final soft-cap): the same as full passes."""
    make_arch_model(tmp_path / case, case)
    lm = load_causal_lm(tmp_path / case)
    use_kv_fake_quant_attention(lm)
    windows = _ids(3, 32, 4)
    assert_int4_kl_per_layer(lm, windows, 4)


def test_kv_calibration_writes_a_valid_policy(arch, tmp_path):
    """``lmkit lite calibrate`` on the AWQ checkpoint: a kv_policy.json the engine's reader accepts, within budget."""
    case, _, _, out = arch
    result = calibrate_kv(out, KvCalibConfig(work_dir=tmp_path / "kv", max_ppl_increase=0.01, **TINY_KV))
    num_kv_heads = CASES[case][2].get("num_key_value_heads", BASE["num_key_value_heads"])
    layers = load_kv_policy(result.policy_path, num_layers=4, num_kv_heads=num_kv_heads, head_dim=16)
    assert layers == result.layers and len(layers) == 4
    doc = json.loads(result.policy_path.read_text())
    assert doc["model"]["architecture"] == CASES[case][1]
    assert result.ppl["policy"] <= result.ppl_limit == pytest.approx(result.ppl["fp"] * 1.01)
    assert all(0 < errs["int8"] < errs["int4"] for errs in result.layer_errors)  # per layer: int4 moves attention more
