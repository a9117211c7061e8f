"""Sampling in C++: seeded requests reproduce, top-k=1 equals greedy, every request of a batch keeps
its own parameters, and the filters keep the right tokens (checked through the distribution)."""

from __future__ import annotations

import numpy as np
import pytest

from lmkit import GenerationConfig
from tests.helpers import assert_draws_follow, reference_distribution


def test_seeded_sampling_is_reproducible(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    gen = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=1.5, top_p=0.95, random_seed=1234,
                           ignore_eos=True)
    a = pipe([5, 6, 7], gen).token_ids
    b = pipe([5, 6, 7], gen).token_ids
    assert a == b
    c = pipe([5, 6, 7], GenerationConfig(**{**gen.__dict__, "random_seed": 4321})).token_ids
    assert a != c  # 32 tokens at temperature 1.5 over ~300 ids: equal by chance is negligible
    # A batch where every request has its own seed: each equals its solo run.
    batch = pipe([[5, 6, 7], [9, 9], [5, 6, 7]], gen)
    assert batch[0].token_ids == a and batch[2].token_ids == a


def test_top_k_one_equals_greedy(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    greedy = pipe([1, 2, 3, 4], GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
    k1 = pipe([1, 2, 3, 4], GenerationConfig(max_new_tokens=24, do_sample=True, top_k=1, temperature=3.0,
                                               ignore_eos=True)).token_ids
    assert k1 == greedy


def test_greedy_reaches_the_engine_in_one_encoding():
    """do_sample=False, temperature 0 and top_k 1 all become the engine's one greedy encoding, temperature 0;
    sampling keeps its temperature."""
    def engine_temperature(**kw) -> float:
        return GenerationConfig(**kw).to_sampling_params().temperature

    assert engine_temperature() == 0.0
    assert engine_temperature(do_sample=False, temperature=0.7) == 0.0
    assert engine_temperature(do_sample=True, temperature=0.0) == 0.0
    assert engine_temperature(do_sample=True, temperature=3.0, top_k=1) == 0.0
    assert engine_temperature(do_sample=True, temperature=0.5, top_k=2) == pytest.approx(0.5)


def test_mixed_parameters_in_one_batch(tiny_llama_pipe):
    pipe = tiny_llama_pipe
    greedy_gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    solo = pipe([10, 20, 30], greedy_gen).token_ids
    # The same greedy request running beside a sampled one (engine level: two configs at once): unchanged.
    sampled_gen = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=2.0, random_seed=5, ignore_eos=True)
    outs = list(pipe.stream_infer([[10, 20, 30]], greedy_gen))
    assert [t for o in outs for t in o.token_ids] == solo
    batch = [pipe.encode([10, 20, 30]), pipe.encode([1, 1, 1])]
    q_greedy = pipe.engine.submit_to_queue(batch[0], greedy_gen)[1]
    q_sampled = pipe.engine.submit_to_queue(batch[1], sampled_gen)[1]
    got = []
    while True:
        o = q_greedy.get()
        got += o.token_ids
        if o.finished:
            break
    while not q_sampled.get().finished:
        pass
    assert got == solo


def test_filters_shape_the_distribution(tiny_llama_pipe):
    """First-token frequencies over many seeds: top_k=3 never leaves the 3 best tokens, top_p small
    keeps only the best, min_p keeps tokens near the best; and temperature sampling hits many tokens."""
    pipe = tiny_llama_pipe
    prompt = [42, 43, 44]
    logits = pipe(prompt, GenerationConfig(max_new_tokens=1, output_logits=True)).logits[-1]
    order = np.argsort(-logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()

    def first_tokens(**kw) -> set[int]:
        gens = [GenerationConfig(max_new_tokens=1, do_sample=True, random_seed=s, ignore_eos=True, **kw)
                for s in range(48)]
        return {pipe(prompt, g).token_ids[0] for g in gens}

    assert first_tokens(top_k=3) <= set(order[:3].tolist())
    assert first_tokens(top_p=1e-6) == {int(order[0])}
    allowed = set(np.nonzero(probs >= 0.5 * probs.max())[0].tolist())
    assert first_tokens(min_p=0.5) <= allowed
    assert len(first_tokens(temperature=5.0)) > 10


@pytest.mark.parametrize("filters", [dict(temperature=0.4), dict(top_k=20), dict(temperature=0.5, top_p=0.6),
                                     dict(top_k=50, top_p=0.8), dict(top_p=0.9, min_p=0.1)],
                         ids=["temperature", "top_k", "top_p", "top_k+top_p", "top_p+min_p"])
def test_sampled_distribution_matches_the_reference(tiny_llama_pipe, filters):
    """4,000 first tokens (250 seeded requests of n=16 samples) against the float64 reference of the
    filters: nothing outside its support, and a chi-square test on the rest (p > 1e-4; the seed makes the
    outcome fixed, so this never flakes once it passes)."""
    pipe = tiny_llama_pipe
    prompt = [42, 43, 44]
    logits = pipe(prompt, GenerationConfig(max_new_tokens=1, output_logits=True)).logits[-1]
    expect = reference_distribution(logits, **filters)
    tokens = [o.token_ids[0] for seed in range(250)
              for o in pipe(prompt, GenerationConfig(max_new_tokens=1, do_sample=True, n=16, random_seed=seed,
                                                     ignore_eos=True, **filters))]
    assert_draws_follow(tokens, expect, filters)


def test_tiny_temperature_is_greedy(tiny_llama_pipe):
    """temperature 1e-38 or 1e-44 (logit / t overflows fp32 to inf) samples the greedy tokens, with and without filters;
    the sampler must not turn inf - inf into NaN weights and draw an arbitrary token."""
    pipe = tiny_llama_pipe
    greedy = pipe([7, 8, 9], GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids
    for t in (1e-38, 1e-44):  # 1e-44 is subnormal in fp32: 1 / t is inf
        for filters in ({}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
            gen = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=t, random_seed=3, ignore_eos=True,
                                   **filters)
            assert pipe([7, 8, 9], gen).token_ids == greedy, (t, filters)
