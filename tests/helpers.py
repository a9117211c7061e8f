"""Assertions and reference math the tests share: relative errors, the engine's logits against an HF reference,
the KV-block check every engine must pass, HF's greedy decode, fake quantization (and HF's logits over a
fake-quantized KV cache), hand-unpacked AWQ weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from lmkit import EngineConfig

if TYPE_CHECKING:
    import torch

SMALL_ENGINE = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                            max_batch_size=4)
"""A small CPU engine with fp32 weights (int8 activations where the CPU has them): engine_logits' default."""
EXACT_ENGINE = EngineConfig(dtype="float32", device="cpu", cache_max_entry_count=64, cache_block_seq_len=16,
                            max_batch_size=4, int8_activations=False)
"""SMALL_ENGINE with fp32 activations: the exact path, held to 1e-4 of HF."""
TINY_CALIB = dict(calib_dataset="pydoc", calib_samples=8, calib_seqlen=64, search_samples=4)
"""lmkit lite's calibration small enough to run in seconds: 8 windows of 64 tokens of pydoc text, scores on 4."""


def random_prompts(seed: int, lengths: tuple[int, ...] = (1, 11, 45)) -> list[list[int]]:
    """Random token prompts (ids below 256) of these lengths, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


def tensor_rewriter(st: Path, key: str):
    """(the tensors of safetensors file ``st``, rewrite): rewrite(name=tensor, ...) writes ``st`` back as it is now
    with ``key + name`` replaced (None: left out), for checks that a broken checkpoint is refused by name."""
    from safetensors.torch import load_file, save_file

    good = load_file(str(st))

    def rewrite(**changes) -> None:
        tensors = dict(good)
        for name, value in changes.items():
            if value is None:
                tensors.pop(key + name)
            else:
                tensors[key + name] = value
        save_file(tensors, str(st))

    return good, rewrite


def cuda_usable() -> bool:
    """Whether the engine was built with CUDA and both it and torch see a GPU."""
    try:
        import torch

        from lmkit import _engine
    except ImportError:
        return False
    return bool(_engine.cuda.is_built and _engine.cuda.is_available() and torch.cuda.is_available())


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def logits_error(model, ref, prompts, config, new_tokens: int = 5, per_row: bool = True) -> float:
    """Largest relative error of the engine's logits on ``model`` (a folder or file lmkit loads) against the HF
    model ``ref`` (fp32) over each prompt and its greedy continuation: of any row, or (per_row False) of any
    prompt's rows together."""
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


def prefill_logits_vs_transformers(folder, prompt: list[int], config: EngineConfig):
    """(the engine's, transformers') logits of every prompt position but the last on the checkpoint in ``folder``
    (an export of lmkit lite, read back by lmkit.lite.checkpoint.load_causal_lm), as fp32 torch tensors."""
    import torch

    from lmkit import GenerationConfig, pipeline
    from lmkit.lite.checkpoint import load_causal_lm

    with pipeline(folder, config) as pipe:
        response = pipe([prompt], GenerationConfig(max_new_tokens=1, output_logits=True, ignore_eos=True))[0]
    got = torch.from_numpy(np.asarray(response.logits[: len(prompt) - 1], dtype=np.float32))
    with torch.no_grad():
        want = load_causal_lm(folder)(input_ids=torch.tensor([prompt])).logits[0, :-1]
    return got, want


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
    assert m.num_free_state_slots + m.num_state_snapshots == m.num_total_state_slots, (
        f"state slots leaked: {m.num_free_state_slots} free and {m.num_state_snapshots} snapshots of "
        f"{m.num_total_state_slots}")


def run_with_random_cancellations(engine, rng, num_requests: int, max_prompt: int, n_choices=(1, 1, 1, 2),
                                  predictions: bool = False) -> int:
    """Submits num_requests random requests (prompts of 1 to max_prompt - 1 tokens, up to 11 new tokens, n from
    n_choices; with predictions, half of them predict 8 random tokens: drafts a speculating engine verifies),
    cancelling a random earlier one (whole, or one completion) after ~30% of them, then waits for every
    completion's final output (length or cancelled). Returns the completions finished."""
    from lmkit import GenerationConfig

    queues = []
    for _ in range(num_requests):
        prediction = [rng.randrange(1, 250) for _ in range(8)] if predictions and rng.random() < 0.5 else None
        gen = GenerationConfig(max_new_tokens=rng.randrange(1, 12), ignore_eos=True, n=rng.choice(list(n_choices)),
                               prediction=prediction)
        rid, q = engine.submit_to_queue([rng.randrange(1, 250) for _ in range(rng.randrange(1, max_prompt))], gen)
        queues.append((rid, q, gen.n))
        if rng.random() < 0.3:
            victim = queues[rng.randrange(len(queues))]
            engine.cancel(victim[0], rng.choice([-1, 0, 1]))
    finished = 0
    for rid, q, n in queues:
        done = 0
        while done < n:
            out = q.get(timeout=120)
            if out.finished:
                assert out.finish_reason in ("length", "cancelled"), out.error
                done += 1
        finished += done
    return finished


def all_recurrent(config) -> bool:
    """Every layer of the HF config is a recurrent (linear-attention) one: no attention layer, no K/V."""
    return set(getattr(config, "layer_types", None) or ()) == {"linear_attention"}


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """HF generate, greedy. A model whose every layer is recurrent (no attention layer) cannot use HF's cache
    (transformers 5.24: get_seq_length needs an attention layer): its tokens come from full forwards instead."""
    import torch

    if all_recurrent(model.config):
        seq = list(ids)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
                if seq[-1] == eos:
                    break
        new = seq[len(ids):]
        return new[:-1] if eos is not None and new and new[-1] == eos else new
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos)]
    return new


def engine_logits(folder: Path, prompts: list[list[int]], config: EngineConfig = SMALL_ENGINE, new_tokens: int = 8):
    from lmkit import GenerationConfig, pipeline

    gen = GenerationConfig(max_new_tokens=new_tokens, output_logits=True, ignore_eos=True)
    with pipeline(folder, config) as pipe:
        return [(p + r.token_ids, r.logits) for p, r in zip(prompts, pipe(prompts, gen))]


def check_against(ref, results, tol: float) -> None:
    import torch

    for full, got in results:
        with torch.no_grad():
            expect = ref(torch.tensor([full])).logits[0].numpy()
        assert got.shape == (len(full) - 1, expect.shape[1])
        assert rel_err(got, expect[: len(full) - 1]) <= tol


def fake_quant(x: "torch.Tensor", bits: int) -> "torch.Tensor":
    """Per token and head over head_dim, as lmkit/kv_policy.py defines it (fp16 scale and zero)."""
    import torch

    qmax = float(2**bits - 1)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / qmax).half().float()
    zero = lo.half().float()
    q = torch.where(scale == 0, torch.zeros_like(x), torch.round((x - zero) / scale).clamp(0, qmax))
    return q * scale + zero


def kv_quantized_logits(ref, full: list[int], bits) -> np.ndarray:
    """HF's logits over ``full`` ([len - 1, vocab]) with each layer's K (after its norm and RoPE) and V
    fake-quantized to ``bits`` (one width for every layer, or a list per layer: 0 keeps a layer's K/V), through
    the model's own attention function (eager for models that run eager, such as Gemma 2's soft-capping) and its
    masks (causal, sliding window); the model's attention is restored after."""
    import sys

    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = ref.config._attn_implementation
    base = (sys.modules[type(ref).__module__].eager_attention_forward if impl == "eager"
            else ALL_ATTENTION_FUNCTIONS[impl])

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer_bits = bits if isinstance(bits, int) else bits[module.layer_idx]
        if layer_bits:
            key, value = fake_quant(key, layer_bits), fake_quant(value, layer_bits)
        return base(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("lmkit_kv_quantized", attention)
    AttentionMaskInterface.register("lmkit_kv_quantized", ALL_MASK_ATTENTION_FUNCTIONS[impl])
    ref.config._attn_implementation = "lmkit_kv_quantized"
    try:
        with torch.no_grad():
            return ref(torch.tensor([full])).logits[0, :-1].numpy()
    finally:
        ref.config._attn_implementation = impl


def _hand_unpack(packed: "torch.Tensor") -> "torch.Tensor":
    """int32 [rows, cols/8] -> int64 [rows, cols]: column 8c + order[k] sits at bits 4k of word c."""
    import torch

    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = packed.long() & 0xFFFFFFFF
    out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.long)
    for k in range(8):
        out[:, order[k]::8] = (words >> (4 * k)) & 0xF
    return out


def hand_dequantize(tensors: dict[str, "torch.Tensor"], name: str, group_size: int) -> "torch.Tensor":
    """float32 [out, in] of AWQ linear ``name`` in ``tensors``, unpacked here by hand: (q - zero) * scale."""
    q = _hand_unpack(tensors[f"{name}.qweight"])
    z = _hand_unpack(tensors[f"{name}.qzeros"]).repeat_interleave(group_size, dim=0)
    s = tensors[f"{name}.scales"].float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t()


def assert_int4_kl_per_layer(lm, windows: "torch.Tensor", num_layers: int, sources: list[int] | None = None) -> None:
    """_int4_kl (in batches of 2) equals the KL of the fp model to the model with only layer i's KV at int4,
    computed here in full, for every layer i (windows [n, len]: KL per predicted token); sources: the layer whose
    KV cache each layer reads (Gemma 4's E-models: a cache at int4 for every layer reading it; a reading layer has
    no KL of its own)."""
    import torch

    from lmkit.lite.kvcalib import _int4_kl, _SilentReporter

    sources = sources or list(range(num_layers))
    got = _int4_kl(lm, windows, 2, torch.device("cpu"), _SilentReporter(), sources=sources)
    n, length = windows.shape
    with torch.no_grad():
        ref = torch.log_softmax(lm(input_ids=windows, kv_bits=[0] * num_layers, use_cache=False).logits[:, :-1], -1)
        for i in range(num_layers):
            if sources[i] != i:
                assert got[i] == 0.0, (i, got[i])
                continue
            bits = [4 if sources[j] == i else 0 for j in range(num_layers)]
            q = torch.log_softmax(lm(input_ids=windows, kv_bits=bits, use_cache=False).logits[:, :-1], -1)
            want = float((ref.exp() * (ref - q)).sum()) / (n * (length - 1))
            assert got[i] == pytest.approx(want, rel=1e-4), (i, got[i], want)


def reference_distribution(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """HF's order, in float64: temperature, top-k (the k best become the distribution), top-p over what
    is left (the smallest best-first prefix whose mass reaches top_p), min-p against the best token."""
    x = logits.astype(np.float64) / temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    keep = len(order)
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
    if min_p > 0.0:
        keep = min(keep, int(np.sum(p >= min_p * p[0])))
    out = np.zeros(len(x))
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


def assert_draws_follow(tokens: list[int], expect: np.ndarray, label) -> None:
    """Nothing drawn outside the support of ``expect`` and a chi-square test of the draws against it (p > 1e-4)."""
    draws = len(tokens)
    counts = np.bincount(tokens, minlength=len(expect))
    assert counts[expect == 0].sum() == 0
    support = expect > 0
    # pool the rare tokens (expected count < 5) into one cell, as the chi-square test needs
    rare = support & (expect * draws < 5)
    obs = np.append(counts[support & ~rare], counts[rare].sum())
    exp = np.append(expect[support & ~rare], expect[rare].sum()) * draws
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    # the chi-square quantile at p = 1e-4 (z = 3.719), Wilson-Hilferty: exact to ~1% for dof >= 3
    limit = dof * (1 - 2 / (9 * dof) + 3.719 * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < limit, (label, stat, dof)


def assert_text_logits_match_hf(folder, ref, seed: int, label: str = "") -> None:
    """The engine's logits on checkpoint ``folder`` (fp32) equal HF model ``ref``'s (its text input) within 1e-4 row
    by row, over a 7- and a 40-token prompt of ``seed`` and 10 greedy tokens each."""
    import torch

    from lmkit import EngineConfig, GenerationConfig, pipeline

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (7, 40)]
    gen = GenerationConfig(max_new_tokens=10, output_logits=True, ignore_eos=True)
    with pipeline(folder, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=32,
                                       cache_block_seq_len=16, max_batch_size=4, session_len=256)) as pipe:
        responses = pipe(prompts, gen)
    for prompt, r in zip(prompts, responses):
        full = prompt + r.token_ids
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([full])).logits[0, :-1].numpy()
        err = np.linalg.norm(r.logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert err.max() <= 1e-4, f"{label}{len(prompt)}-token prompt: worst row rel err {err.max():.3g}"


def submit_all(engine, prompts, gens) -> list[tuple[list[int], list[float]]]:
    """Every prompt with its own GenerationConfig, all in flight at once: each completion's (tokens, logprobs),
    in order of prompt, then completion."""
    gens = gens if isinstance(gens, list) else [gens] * len(prompts)
    queues = [(engine.submit_to_queue(list(p), g)[1], g.n) for p, g in zip(prompts, gens)]
    out = []
    for q, n in queues:
        got = {i: ([], []) for i in range(n)}
        done = 0
        while done < n:
            o = q.get(timeout=120)
            got[o.sample_index][0].extend(o.token_ids)
            got[o.sample_index][1].extend(round(x, 4) for x in o.logprobs)
            if o.finished:
                assert o.finish_reason in ("length", "stop"), o.error
                done += 1
        out += [got[i] for i in range(n)]
    return out


def speculation_keeps_tokens(folder, settings: dict, prompts, gen, speculative: str, check_plain=None):
    """Decodes ``prompts`` with an engine of ``settings`` (EngineConfig fields) without speculation (handed to
    ``check_plain`` when given) and with ``speculative``, every draft verified; asserts the same tokens and returns
    the speculating engine's metrics."""
    from lmkit import pipeline

    outs = {}
    for spec in ("off", speculative):
        with pipeline(folder, EngineConfig(**settings, speculative=spec, speculative_adaptive=False)) as pipe:
            if spec == "off" and check_plain is not None:
                check_plain(pipe.engine)
            outs[spec] = [r.token_ids for r in pipe(prompts, gen)]
            metrics = pipe.engine.metrics()
    assert outs[speculative] == outs["off"]
    return metrics


# A pool that preempts, prefix caching and prompts longer than the step budget (EngineConfig fields; with BASE-like
# settings), for spec_stress_requests
SPEC_STRESS_POOL = dict(cache_max_entry_count=16, max_prefill_token_num=24, max_batch_size=6,
                        enable_prefix_caching=True)


def spec_stress_requests(rng) -> tuple[list[list[int]], list]:
    """Six prompts sharing a 48-token document and their GenerationConfigs: n = 3 seeded completions, penalties,
    min_new_tokens, sampling and logprobs (speculative decoding's stress case, with SPEC_STRESS_POOL)."""
    from lmkit import GenerationConfig

    doc = rng.integers(0, 256, size=48).tolist()
    prompts = [doc + rng.integers(0, 256, size=int(rng.integers(5, 40))).tolist() for _ in range(6)]
    gens = [GenerationConfig(max_new_tokens=40, ignore_eos=True, n=3 if i == 0 else 1, logprobs=2,
                             repetition_penalty=1.3 if i == 1 else 1.0, min_new_tokens=10 if i == 2 else 0,
                             do_sample=i in (0, 3), random_seed=5, temperature=0.7)
            for i in range(len(prompts))]
    return prompts, gens
