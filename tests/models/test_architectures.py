"""End to end, one tiny random model per architecture variant of issue 22 against HF transformers fp32:
every logit row (prompt and decode positions) within 1e-4 relative, greedy output token-identical to HF
generate alone, and the same output when the prompts run together with chunked prefill and prefix caching
(prompts sharing a prefix longer than one KV block, generation past the sliding window).

Each case (tests/factories.py's ARCH_CASES) is built once per module (config class, seeded random init a little
wider than HF's so that the logits are not flat, fp32 safetensors) and read back by HF as the reference. Cases
marked ``new`` need the architectures issue 22 adds to the engine; until the engine has them they fail with the
engine's own "unsupported" error, named per case. A few cases rewrite config.json into the layout the hub checkpoints
have (transformers 4.x keys), because lmkit reads config.json itself: HF is checked to read the rewritten
file the way the case means.

    pytest tests/models/test_architectures.py [-k gemma3]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lmkit import EngineConfig, GenerationConfig, pipeline
from tests.factories import ARCH_CASES as CASES
from tests.factories import Case, build_case
from tests.helpers import all_recurrent, hf_greedy, kv_quantized_logits

NEW_TOKENS = 24  # the 9-token prompt crosses every sliding window below during decode
SHARED_PREFIX_TOKENS = 40  # > two 16-token KV blocks
BLOCK_TOKENS = 16
PREFILL_BUDGET_TOKENS = 24  # < every prompt but the short one: prompts are chunked
REL_TOL = 1e-4
MIN_MARGIN = 1e-3  # smallest top-2 logit gap on HF's greedy path (logits are of order 5; fp32 engines differ by ~1e-6)
@dataclass
class Built:
    name: str
    case: Case
    folder: object
    ref: object
    prompts: list[list[int]]
    expected: list[list[int]]  # HF generate, greedy, alone
    hf_logits: list[np.ndarray]  # HF full forward over prompt + expected: [len - 1, vocab]


def make_prompts(seed: int) -> list[list[int]]:
    """Three prompts sharing a 40-token prefix (43, 57, 90 tokens), a 9-token one and an unrelated 61-token one."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, 256, size=SHARED_PREFIX_TOKENS).tolist()
    tail = lambda n: rng.integers(0, 256, size=n).tolist()  # noqa: E731
    return [doc + tail(3), tail(9), doc + tail(17), tail(61), doc + tail(50)]


@pytest.fixture(scope="module", params=sorted(CASES))
def arch(request, tmp_path_factory) -> Built:
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    ref = build_case(name, folder)
    prompts = make_prompts(CASES[name].seed)
    expected, hf_logits = [], []
    for p in prompts:
        new = hf_greedy(ref, p, NEW_TOKENS, None)
        assert len(new) == NEW_TOKENS, f"{name}: HF generate stopped after {len(new)} tokens"
        with torch.no_grad():
            logits = ref(torch.tensor([p + new])).logits[0, :-1].numpy()
        # The oracle agrees with itself: its cached incremental decode picks its own full-forward argmax.
        forward_greedy = logits[len(p) - 1:].argmax(-1).tolist()
        assert forward_greedy == new, f"{name}: HF generate and HF forward disagree ({new} vs {forward_greedy})"
        # No near-tie in the reference: a 1e-4 relative difference cannot flip a greedy token.
        top2 = np.sort(logits[len(p) - 1:], axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin >= MIN_MARGIN, f"{name}: HF's greedy path has a near-tie ({margin:.2g}); pick another seed"
        expected.append(new)
        hf_logits.append(logits)
    return Built(name, CASES[name], folder, ref, prompts, expected, hf_logits)


def open_pipeline(built: Built, **config):
    """The engine on the case's folder; a model it cannot load fails the test with the engine's message."""
    base = dict(device="cpu", dtype="float32", cache_max_entry_count=64, cache_block_seq_len=BLOCK_TOKENS,
                max_batch_size=8, session_len=512)
    try:
        return pipeline(built.folder, EngineConfig(**{**base, **config}))
    except Exception as error:
        if not built.case.new:
            raise
        message = f"{type(error).__name__}: {error}"
    pytest.fail(f"{built.name} ({built.case.config_class}, issue 22): the engine does not load it: {message}",
                pytrace=False)


def assert_served(built: Built, i: int, response, label: str = "") -> None:
    """The engine finished prompt i's request without an error (its message otherwise)."""
    assert response.error is None and response.finish_reason == "length", (
        f"{built.name}{label}: prompt {i} ({len(built.prompts[i])} tokens): the engine stopped after "
        f"{len(response.token_ids)} tokens, finish_reason {response.finish_reason!r}: {response.error}")


def row_rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """||got - want|| / ||want|| of every row."""
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def describe_mismatch(built: Built, i: int, got: list[int]) -> str:
    """Where a greedy output first leaves HF's, and HF's top-2 logit margin there (a margin near 1e-4 of
    the logits' scale is a near-tie; a wide one is a real difference)."""
    want = built.expected[i]
    k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if k >= len(want):
        return f"lengths {len(got)} vs {len(want)}"
    row = built.hf_logits[i][len(built.prompts[i]) - 1 + k]
    top2 = np.sort(row)[-2:]
    return (f"prompt {i} ({len(built.prompts[i])} tokens): first difference at new token {k} "
            f"(position {len(built.prompts[i]) + k}): engine {got[k] if k < len(got) else None}, HF {want[k]}; "
            f"HF top-2 margin {top2[1] - top2[0]:.3g} (logit scale {np.abs(row).max():.3g})")


def test_logits_match_hf(arch: Built):
    """Every prompt and decode position's logits within 1e-4 relative of HF fp32, row by row, over the
    engine's own sequence; all prompts in one batch."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, output_logits=True, ignore_eos=True)
    with open_pipeline(arch) as pipe:
        responses = pipe(arch.prompts, gen)
    for i, (prompt, r) in enumerate(zip(arch.prompts, responses)):
        assert_served(arch, i, r)
        full = prompt + r.token_ids
        assert r.logits is not None and r.logits.shape == (len(full) - 1, arch.ref.config.vocab_size), (
            f"{arch.name}: prompt {i}: logits shape {None if r.logits is None else r.logits.shape}")
        if r.token_ids == arch.expected[i]:
            want = arch.hf_logits[i]
        else:
            with torch.no_grad():
                want = arch.ref(torch.tensor([full])).logits[0, :-1].numpy()
        err = row_rel_err(r.logits, want)
        bad = np.flatnonzero(err > REL_TOL)
        assert bad.size == 0, (
            f"{arch.name}: prompt {i} ({len(prompt)} tokens): {bad.size} of {len(err)} logit rows off by more than "
            f"{REL_TOL:g} relative; first bad position {bad[0]} (rel err {err[bad[0]]:.3g}), worst {err.max():.3g} "
            f"at position {err.argmax()}; position 0 {err[0]:.3g}")


def test_greedy_alone_matches_hf(arch: Built):
    """Each prompt alone: greedy output token-identical to HF generate."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with open_pipeline(arch) as pipe:
        responses = [pipe(p, gen) for p in arch.prompts]
    for i, r in enumerate(responses):
        assert_served(arch, i, r)
        assert r.token_ids == arch.expected[i], f"{arch.name}: {describe_mismatch(arch, i, r.token_ids)}"


def test_batched_chunked_prefix_cached_matches_hf(arch: Built):
    """All prompts at once through a 24-token prefill budget (chunked prompts), 4 running at most (the rest
    join later), 16-token blocks with prefix caching; then all again, their shared 40-token prefix (two full
    blocks) cached. Every output equals HF's alone."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with open_pipeline(arch, max_batch_size=4, max_prefill_token_num=PREFILL_BUDGET_TOKENS,
                       enable_prefix_caching=True) as pipe:
        first = pipe(arch.prompts, gen)
        again = pipe(arch.prompts, gen)
        hit_tokens = pipe.engine.metrics().num_prefix_hit_tokens
        pipe.engine.check_integrity()
    for label, responses in ((", first round", first), (", second round, prefix cached", again)):
        for i, r in enumerate(responses):
            assert_served(arch, i, r, label)
            assert r.token_ids == arch.expected[i], f"{arch.name}{label}: {describe_mismatch(arch, i, r.token_ids)}"
    assert hit_tokens >= 3 * 2 * BLOCK_TOKENS, f"{arch.name}: only {hit_tokens} prefix-hit tokens"


def _is_moe(case: Case) -> bool:
    return any(k in case.kwargs for k in ("num_experts", "num_local_experts"))


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_quantized_matches_fake_quant_reference(arch: Built, bits: int):
    """quant_policy 8 / 4 (int8 / int4 KV cache, every layer): the engine's logits over its own sequences
    follow HF with K and V fake-quantized the same way, far closer to it than to the fp model. The
    reference rounds K/V computed in another order, which can flip a rounding: a bound of 2e-3 (int8) and
    1e-2 (int4) relative over all rows, and 5x nearer the quantized reference than the fp one."""
    gen = GenerationConfig(max_new_tokens=12, output_logits=True, ignore_eos=True)
    with open_pipeline(arch, quant_policy=bits) as pipe:
        responses = pipe(arch.prompts, gen)
        pipe.engine.check_integrity()
    for i, (prompt, r) in enumerate(zip(arch.prompts, responses)):
        assert r.error is None and r.finish_reason == "length", f"{arch.name}: prompt {i}: {r.error}"
        full = prompt + r.token_ids
        want = kv_quantized_logits(arch.ref, full, bits)
        with torch.no_grad():
            fp = arch.ref(torch.tensor([full])).logits[0, :-1].numpy()
        bound = 2e-3 if bits == 8 else 1e-2
        if all_recurrent(arch.ref.config):
            # no layer keeps K/V: quant_policy changes nothing, the logits are the fp model's
            err = row_rel_err(r.logits, fp)
            assert err.max() <= REL_TOL, f"{arch.name}: int{bits} KV without a KV layer: rel err {err.max():.3g}"
            continue
        if _is_moe(arch.case):
            # A router is discontinuous: K/V rounded in another order can move a token to another expert, and
            # that row (and what follows from it) then differs by far more than the rounding. Most rows agree.
            rows, rows_fp = row_rel_err(r.logits, want), row_rel_err(r.logits, fp)
            close = float(np.mean(rows <= bound))
            assert close >= 0.8 and np.median(rows) < np.median(rows_fp) / 5, (
                f"{arch.name}: int{bits} KV, prompt {i}: {close:.0%} of rows within {bound:g} of the fake-quantized "
                f"reference; median row error {np.median(rows):.3g}, {np.median(rows_fp):.3g} to the fp model")
            continue
        err = float(np.linalg.norm(r.logits - want) / np.linalg.norm(want))
        err_fp = float(np.linalg.norm(r.logits - fp) / np.linalg.norm(fp))
        assert err <= bound and err < err_fp / 5, (
            f"{arch.name}: int{bits} KV, prompt {i} ({len(prompt)} tokens): rel err {err:.3g} to the fake-quantized "
            f"reference (bound {bound:g}), {err_fp:.3g} to the fp model")


def test_steps_count_the_weights_they_read(tmp_path):
    """The engine's num_weight_bytes_read: a dense model's step reads every weight; a one-row step of a
    mixture of experts (top 2 of 8 on two of three layers) reads the router and two experts there, the same
    every step, and less than all the weights."""
    def per_step(folder):
        with pipeline(folder, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32,
                                           speculative="off")) as pipe:
            before = pipe.engine.metrics()
            for _ in range(3):  # one-token prompts: every step has one row (no draft rows)
                pipe([7], GenerationConfig(max_new_tokens=4, ignore_eos=True))
            after = pipe.engine.metrics()
            total = pipe.engine.linear_weight_bytes
        steps = after.num_steps - before.num_steps
        read = after.num_weight_bytes_read - before.num_weight_bytes_read
        assert steps == 12 and read % steps == 0, (steps, read)
        return read // steps, total

    build_case("qwen3", tmp_path / "dense")
    read, total = per_step(tmp_path / "dense")
    assert read == total
    build_case("qwen3_moe", tmp_path / "moe")
    read, total = per_step(tmp_path / "moe")
    assert 0 < read < total, (read, total)
