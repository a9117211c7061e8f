"""Greedy output is token-identical to HF generate, run one by one and all together (batch
composition never changes a greedy result); the same on the bundled SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.helpers import hf_greedy

PROMPT_LENS = [1, 3, 8, 17, 30, 64, 65, 100]  # around block boundaries (block 16) and beyond


def test_greedy_matches_hf_alone_and_batched(tiny_llama, tiny_llama_pipe):
    folder, ref = tiny_llama
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENS]
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    expected = [hf_greedy(ref, p, 64, None) for p in prompts]
    alone = [tiny_llama_pipe(p, gen).token_ids for p in prompts]
    batched = [r.token_ids for r in tiny_llama_pipe(prompts, gen)]
    for i in range(len(prompts)):
        assert alone[i] == expected[i], f"prompt {i} (len {PROMPT_LENS[i]}) alone differs from HF"
        assert batched[i] == expected[i], f"prompt {i} (len {PROMPT_LENS[i]}) batched differs from HF"


def test_chunked_prefill_and_small_batches_keep_greedy_output(tiny_llama):
    """A tiny prefill budget splits prompts into chunks across steps and max_batch_size 3 makes
    requests wait and join a running batch: the output must not change."""
    folder, ref = tiny_llama
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENS]
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    expected = [hf_greedy(ref, p, 20, None) for p in prompts]
    config = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                          max_batch_size=3,
                          max_prefill_token_num=24)
    with pipeline(folder, config) as pipe:
        got = [r.token_ids for r in pipe(prompts, gen)]
    assert got == expected


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "awq"])
def test_logits_do_not_depend_on_batching_or_chunking(tmp_path, weights):
    """Bit for bit, a request's logits are the same taken whole, in prompt chunks of 1 and 5 tokens (prompt pacing
    sizes chunks from measured times), beside other requests of other lengths, and after them: a seed samples
    the same answer whatever else the engine did. On a CPU with AMX the tiles are on, as users run them: bf16
    calls of every height take them, and AWQ's int8 calls of 32+ rows give the VNNI kernel's bits
    (csrc/kernels/cpu/README.md)."""
    from lmkit import _engine
    from tests.factories import make_tiny_model, rtn_checkpoint

    if weights == "bfloat16" and not _engine.cpu_bf16_available():
        pytest.skip("this CPU has no AVX512_BF16")
    folder = tmp_path / "fp32"
    make_tiny_model(folder, "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    if weights == "awq":
        folder = rtn_checkpoint(folder, tmp_path / "awq", group_size=32)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 256, size=77).tolist()
    others = [rng.integers(0, 256, size=n).tolist() for n in (5, 40, 130)]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, output_logits=True)

    def config(**kw) -> EngineConfig:
        return EngineConfig(dtype="bfloat16" if weights == "bfloat16" else "float32", device="cpu",
                            cache_max_entry_count=64, cache_block_seq_len=32, max_batch_size=8, decode_slowdown=0,
                            **kw)

    with pipeline(folder, config()) as pipe:
        whole = pipe(prompt, gen)
        runs = {"beside others": pipe([*others, prompt], gen)[-1], "after them": pipe(prompt, gen)}
    for chunk in (1, 5):
        with pipeline(folder, config(max_prefill_token_num=chunk)) as pipe:
            runs[f"in chunks of {chunk}"] = pipe(prompt, gen)
    expected = np.asarray(whole.logits)
    for name, got in runs.items():
        logits = np.asarray(got.logits)
        same = np.array_equal(logits, expected)
        assert same, f"{name}: logits differ by up to {np.abs(logits - expected).max()}"
        assert got.token_ids == whole.token_ids, name


def test_eos_stops_and_is_not_in_output(tiny_llama, tiny_llama_pipe):
    folder, ref = tiny_llama
    rng = np.random.default_rng(9)
    # Find a prompt whose greedy continuation hits some token early; make it a stop id.
    prompt = rng.integers(0, 256, size=10).tolist()
    free_run = hf_greedy(ref, prompt, 16, None)
    stop = free_run[5]
    first = free_run.index(stop)
    r = tiny_llama_pipe(prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop]))
    assert r.token_ids == free_run[:first] and r.finish_reason == "stop"
    r = tiny_llama_pipe(prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[stop], min_new_tokens=first + 1))
    assert len(r.token_ids) > first and r.token_ids[first] != stop  # stop id masked before min_new_tokens
    r = tiny_llama_pipe(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 4 and r.generate_token_len == 4
    assert r.input_token_len == len(prompt)


def test_text_chat_and_stream(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    r = pipe("hello world", gen)
    assert r.input_token_len == len(pipe.tokenizer.encode("hello world"))
    assert r.text == pipe.tokenizer.decode(r.token_ids)
    chat = [{"role": "user", "content": "hi"}]
    rc = pipe(chat, gen)
    assert rc.input_token_len == len(pipe.tokenizer.apply_chat_template(chat))
    batch = pipe(["a", chat, "abc"], gen)
    assert [b.index for b in batch] == [0, 1, 2] and batch[1].token_ids == rc.token_ids
    pieces: dict[int, list] = {0: [], 1: []}
    finals = {}
    for part in pipe.stream_infer(["hello world", "abc"], gen):
        pieces[part.index].append(part)
        if part.finish_reason:
            finals[part.index] = part
    assert set(finals) == {0, 1}
    streamed_ids = [t for p in pieces[0] for t in p.token_ids]
    assert streamed_ids == r.token_ids
    assert "".join(p.text for p in pieces[0]) == r.text
    assert finals[0].generate_token_len == 10


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
             "To be, or not to be, that is the question:", "1, 2, 3, 4,", "The quick brown fox",
             "In machine learning, a transformer is", "Water boils at"]
    prompts = [tok.encode(t) for t in texts]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompts[-1] = tok.encode(chat, add_special_tokens=False)
    eos = tok.eos_token_id
    expected = [hf_greedy(ref, p, 64, eos) for p in prompts]
    with pipeline(smollm2_path, EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=256, max_batch_size=8,
                                             session_len=2048)) as pipe:
        gen = GenerationConfig(max_new_tokens=64)
        batched = [r.token_ids for r in pipe(prompts, gen)]
        alone = [pipe(p, gen).token_ids for p in prompts[:3]]
        paris = pipe("The capital of France is", GenerationConfig(max_new_tokens=8)).text
    assert batched == expected
    assert alone == expected[:3]
    assert "Paris" in paris
