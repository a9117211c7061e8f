"""Stop strings, penalties, logprobs, n > 1 completions: each checked against an independent reference
(the engine's raw logits, themselves checked against HF in tests/models/test_logits.py, or HF
directly)."""

from __future__ import annotations

import numpy as np
import torch

from lmkit import GenerationConfig

PROMPT = [72, 101, 108, 108, 111, 32]


def test_stop_strings_across_tokens(smollm2_pipe):
    pipe = smollm2_pipe
    prompt = "Count: one, two, three,"
    free = pipe(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    text = free.text
    ids = free.token_ids
    # A stop string that starts inside token k and ends inside token k + 2.
    ends = [len(pipe.tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]  # text end after k tokens
    k = next(k for k in range(4, len(ids) - 3) if ends[k + 1] - ends[k] >= 3 and ends[k + 3] - ends[k + 2] >= 3)
    stop = text[ends[k + 1] - 2:ends[k + 2] + 2]
    assert len(stop) >= 4
    cut = text.index(stop)
    r = pipe(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=[stop]))
    assert r.finish_reason == "stop" and r.text == text[:cut], (stop, r.text, text)
    r = pipe(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=["never seen", stop],
                                      include_stop_str_in_output=True))
    assert r.text == text[:cut + len(stop)] and r.finish_reason == "stop"
    # streamed deltas never show part of the stop string and add up to the final text
    deltas = [p.text for p in pipe.stream_infer(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True,
                                                                         stop=[stop]))]
    assert "".join(deltas) == text[:cut]


def test_stream_text_equals_final_text(smollm2_pipe):
    pipe = smollm2_pipe
    gen = GenerationConfig(max_new_tokens=60, ignore_eos=True, do_sample=True, temperature=2.0, random_seed=3)
    prompt = "Écris une phrase en français avec des accents: "  # multi-byte characters
    final = pipe(prompt, gen)
    parts = list(pipe.stream_infer(prompt, gen))
    assert "".join(p.text for p in parts) == final.text == pipe.tokenizer.decode(final.token_ids)
    assert not any(p.text.endswith("\ufffd") for p in parts[:-1])  # no split multi-byte character


def test_presence_and_frequency_penalties(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7,
                           output_logits=True)
    r = pipe(PROMPT, gen)
    raw = r.logits[len(PROMPT) - 1:]  # rows predicting each output token
    counts: dict[int, int] = {}
    for step, token in enumerate(r.token_ids):
        adjusted = raw[step].astype(np.float64).copy()
        for t, c in counts.items():
            adjusted[t] -= 1.5 + 0.7 * c
        assert token == int(np.argmax(adjusted)), f"step {step}"
        counts[token] = counts.get(token, 0) + 1
    plain = pipe(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    assert plain.token_ids != r.token_ids  # the penalties changed something


def test_logprobs_match_hf_log_softmax(tiny_llama, tiny_llama_pipe):
    _, ref = tiny_llama
    r = tiny_llama_pipe(PROMPT, GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=5))
    assert len(r.logprobs) == len(r.token_ids) == 8
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + r.token_ids])).logits[0].double()
    expect = torch.log_softmax(logits, dim=-1).numpy()
    for step, (token, entry) in enumerate(zip(r.token_ids, r.logprobs)):
        row = expect[len(PROMPT) - 1 + step]
        top5 = np.argsort(-row)[:5]
        assert set(entry) == {token, *top5.tolist()}
        for t, lp in entry.items():
            assert abs(lp - row[t]) < 1e-4
        assert token == top5[0]  # greedy picks the best


def test_n_completions_share_the_prompt(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    prompt = list(range(1, 40))  # > 2 blocks of 16: the first two are shared by the forks
    greedy = pipe(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    three = pipe(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True, n=3))
    assert [r.sample_index for r in three] == [0, 1, 2]
    assert all(r.token_ids == greedy.token_ids for r in three)
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True, n=4, do_sample=True, temperature=1.5, random_seed=9)
    a = pipe(prompt, gen)
    b = pipe(prompt, gen)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]  # seeded: reproducible
    assert len({tuple(x.token_ids) for x in a}) > 1  # but the completions differ
    batch = pipe([prompt, [5, 6]], GenerationConfig(max_new_tokens=4, ignore_eos=True, n=2))
    assert [(r.index, r.sample_index) for r in batch] == [(0, 0), (0, 1), (1, 0), (1, 1)]
