"""Shared fixtures: tiny random HF models (Llama, Mistral, Qwen2) saved with a small byte-level
tokenizer, HF fp32 references, and a check that every engine gives all its KV blocks back."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

# The engines of this test session (and the servers it starts as subprocesses, which inherit this) size
# their KV pools against each other only, not against lmkit servers that happen to run on the host.
os.environ["LMKIT_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="lmkit-test-runtime-")

TINY_VOCAB = 300  # 256 byte tokens + specials + spare rows


def cuda_usable() -> bool:
    """Whether the engine was built with CUDA and both it and torch see a GPU."""
    try:
        import torch

        from lmkit import _engine
    except ImportError:
        return False
    return bool(_engine.cuda.is_built and _engine.cuda.is_available() and torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not cuda_usable():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and an engine built with the CUDA backend")
        for item in gpu_items:
            item.add_marker(skip)


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: every UTF-8 byte is a token; ids 256.. are specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token=None)
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(folder))


def make_tiny_model(folder: Path, arch: str = "llama", *, dtype: str = "float32", seed: int = 0,
                    max_shard_size: str | None = None, **overrides):
    """Builds a random tiny model of ``arch`` (llama | mistral | qwen2), saves it with the byte tokenizer
    into ``folder`` and returns the fp32 HF model (eval mode) that reads the saved weights."""
    import torch
    import transformers

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    base.update(overrides)
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    config = getattr(transformers, cls[0])(**base)
    torch.manual_seed(seed)
    model = getattr(transformers, cls[1])(config).eval()
    with torch.no_grad():  # larger than default init so that logits are not flat
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(torch_dtype).save_pretrained(str(folder), **kwargs)
    write_byte_tokenizer(folder)
    # The reference reads back exactly what the engine reads, upcast to fp32.
    ref = getattr(transformers, cls[1]).from_pretrained(str(folder), dtype=torch.float32).eval()
    return ref


def write_sharegpt_file(path: Path, num_valid: int = 6) -> list[tuple[str, str]]:
    """A small file in ShareGPT's schema (what --dataset reads): ``num_valid`` two-turn conversations of
    pydoc text, plus ones the loader must skip (one turn, a 1-word prompt, a turn without a value).
    Returns the valid (prompt, answer) pairs."""
    import json

    import pydoc_data.topics as topics

    words = " ".join(topics.topics.values()).split()
    valid = [(" ".join(words[40 * i:40 * i + 20 + 3 * i]), " ".join(words[40 * i + 25:40 * i + 33]))
             for i in range(num_valid)]
    convs = [{"id": f"ok{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a},
                                                 {"from": "human", "value": "and then?"}]}
             for i, (q, a) in enumerate(valid)]
    convs += [{"id": "one-turn", "conversations": [{"from": "human", "value": " ".join(words[:30])}]},
              {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": valid[0][1]}]},
              {"id": "no-value", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x y z w v"}]}]
    path.write_text(json.dumps(convs))
    return valid


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, make_tiny_model(folder, "llama")


@pytest.fixture(scope="session")
def tiny_llama_pipe(tiny_llama):
    from lmkit import EngineConfig, pipeline

    with pipeline(tiny_llama[0], EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=128,
                                              max_batch_size=16,
                                              cache_block_seq_len=16)) as pipe:
        yield pipe


def logits_error(model, ref, prompts, config, new_tokens: int = 5, per_row: bool = True) -> float:
    """Largest relative error of the engine's logits on ``model`` (a folder or file lmkit loads) against the HF
    model ``ref`` (fp32) over each prompt and its greedy continuation: of any row, or (per_row False) of any
    prompt's rows together."""
    import numpy as np
    import torch

    from lmkit import GenerationConfig, pipeline

    gen = GenerationConfig(max_new_tokens=new_tokens, output_logits=True, ignore_eos=True)
    worst = 0.0
    with pipeline(model, config) as pipe:
        for p, r in zip(prompts, pipe(prompts, gen)):
            assert r.error is None, r.error
            full = p + r.token_ids
            with torch.no_grad():
                want = ref(torch.tensor([full])).logits[0, : len(full) - 1].numpy()
            got = r.logits
            assert got.shape == want.shape
            if per_row:
                err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
            else:
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
            worst = max(worst, float(np.max(err)))
    return worst


def assert_blocks_free(engine, timeout_s: float = 5.0) -> None:
    """Waits until the engine is idle, then checks every KV block is free and bookkeeping is exact."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = engine.metrics()
        if (m.num_running == 0 and m.num_waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    engine.check_integrity()
    m = engine.metrics()
    assert m.num_running == 0 and m.num_waiting == 0, f"engine not idle: {m.num_running} running, {m.num_waiting} waiting"
    assert m.num_free_blocks == m.num_total_blocks, (
        f"KV blocks leaked: {m.num_free_blocks} free of {m.num_total_blocks}")


@pytest.fixture(autouse=True)
def _every_engine_gives_blocks_back():
    """After every test, every live engine must be idle with all KV blocks free."""
    yield
    from lmkit.engine import Engine

    for engine in Engine.live_engines():
        assert_blocks_free(engine)


@pytest.fixture(scope="session")
def smollm2_path():
    """The bundled SmolLM2-135M-Instruct as an HF folder (converted once into LMKIT_CACHE)."""
    from lmkit.model_path import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_pipe(smollm2_path):
    """One SmolLM2 pipeline for the tests that need real text."""
    from lmkit import EngineConfig, pipeline

    with pipeline(smollm2_path, EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=256, max_batch_size=8,
                                             session_len=2048)) as pipe:
        yield pipe
