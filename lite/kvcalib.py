"""KV cache calibration: per layer int4 where it is safe, int8 (or fp) where not, within a perplexity budget.

    1. measure   calibration windows -> per layer, the relative error int8 / int4 KV cause in that layer's
                 attention block output when only that layer is quantized (one fp pass, KvErrorProbe);
                 and, on the first ``sensitivity_samples`` windows, the KL divergence of the output
                 distribution from the fp one when only that layer's KV is int4 (one pass from that layer
                 on, per layer). On SmolLM2 the attention error ranks layers poorly for their effect on
                 perplexity, and one layer's perplexity change on a few thousand tokens is mostly noise
                 (its sign flips between two draws of 2,048 tokens); the KL divergence, its expected
                 value, is steady enough to rank by
    2. anchor    perplexity on the held-out evaluation text with fp, all-int8 and all-int4 KV
    3. choose    limit = ppl_fp * (1 + max_ppl_increase)
                 all-int8 <= limit: int4 on the k least int4-sensitive layers (by the KL divergence, else
                                    by the attention error), int8 elsewhere; the largest k whose
                                    perplexity is within the limit, by binary search over k
                 all-int8 >  limit: fp on the m layers with the largest int8 error, int8 elsewhere; the
                                    smallest m within the limit (m = all layers is fp: always within)
    4. write     kv_policy.json (lmkit.kv_policy) with the statistics the policy was chosen from

A hybrid's recurrent layers (Gated DeltaNet: Qwen3.5, Qwen3-Next) keep no KV cache: steps 1 and 3 run over the
attention layers only, and the policy writes the others as 0.
Gemma 4's E-models' last layers read an earlier layer's KV cache (one cache, its precision): the search runs over
the layers with a cache of their own, the one-layer int4 KL quantizes a cache for every layer that reads it, and the
policy writes a reading layer with its source's bits.

Every policy returned was measured: its perplexity on the evaluation text is within the budget (the
search assumes perplexity grows with k and shrinks with m; where it does not, it may stop short).
Calibration and evaluation text never overlap: calibration documents sharing text with the evaluation
text are dropped, and an empty remainder is an error.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from lmkit.lite.calib import CalibrationDataError, mixed_windows
from lmkit.lite.config import KvCalibConfig, resolve_device
from lmkit.lite.corpora import calibration_corpora, drop_shared_text, evaluation_corpus
from lmkit.lite.requirements import require_quantizer

POLICY_FILE = "kv_policy.json"


class Reporter(Protocol):
    def phase(self, description: str) -> None: ...

    def start_steps(self, description: str, total: int) -> None: ...

    def step_done(self) -> None: ...


class _SilentReporter:
    def phase(self, description: str) -> None:
        pass

    def start_steps(self, description: str, total: int) -> None:
        pass

    def step_done(self) -> None:
        pass


@dataclass
class KvCalibResult:
    """What ``calibrate_kv`` measured and chose."""

    policy_path: Path
    source: Path
    layers: list[int]  # per layer: 0 fp, 8 int8, 4 int4
    layer_errors: list[dict[str, float]]  # per layer: int8 / int4 / int4_k / int4_v relative error
    layer_int4_kl: list[float] | None  # per layer: KL(fp || that layer int4 alone), nats per token
    ppl: dict[str, float]  # fp, int8, int4, policy
    ppl_limit: float
    num_eval_tokens: int
    num_calib_tokens: int
    num_calib_docs_dropped: int
    search: list[dict] = field(default_factory=list)  # every policy evaluated: {"layers", "ppl", "within"}
    seconds: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def count(self, bits: int) -> int:
        """Layers at ``bits`` (0, 8 or 4)."""
        return sum(b == bits for b in self.layers)


def model_description(fields, architecture: str) -> dict:
    """The ``model`` block of kv_policy.json from the engine's fields of the model (lmkit.models ModelFields): the
    shape the engine checks a policy against (Gemma 4: the sliding layers' head_dim and KV heads, the spec's)."""
    return {"architecture": architecture, "num_layers": int(fields.num_layers),
            "num_kv_heads": int(fields.num_kv_heads), "head_dim": int(fields.head_dim)}


def _policy_path(work_dir: Path, overwrite: bool) -> Path:
    """work_dir/kv_policy.json after checking it may be written (the folder is created)."""
    work_dir = Path(work_dir).expanduser().absolute()
    if work_dir.exists() and not work_dir.is_dir():
        raise ValueError(f"work dir {work_dir} exists and is not a folder")
    path = work_dir / POLICY_FILE
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists (pass --overwrite to replace it)")
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the work dir {work_dir}: {e.strerror or e}") from None
    if not os.access(work_dir, os.W_OK):
        raise ValueError(f"work dir {work_dir} is not writable")
    return path


def _hooks_of(lm):
    """The KV calibration hooks of ``lm``'s architecture (lmkit.models)."""
    from lmkit.models import get_architecture

    return get_architecture(lm.config.architectures[0]).kv_calib


@torch.no_grad()
def _attention_errors(lm, windows: torch.Tensor, batch_size: int, device, reporter: Reporter, hooks=None
                      ) -> tuple[list[dict[str, float]], int]:
    """Per layer attention block errors (KvErrorProbe) over ``windows`` [n, seqlen]; and the token count."""
    from lmkit.lite.kvquant import KvErrorProbe

    probe = KvErrorProbe(lm.config.num_hidden_layers, (hooks or _hooks_of(lm)).o_proj)
    batches = windows.split(batch_size)
    reporter.start_steps("attention error per layer", len(batches))
    for batch in batches:
        lm(input_ids=batch.to(device), kv_probe=probe, use_cache=False)
        reporter.step_done()
    return probe.errors(), probe.num_tokens


def _head(lm, hooks, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the last decoder layer's output, as the model's forward computes them (final norm,
    lm_head, the final soft-cap where the architecture has one: Gemma 2)."""
    logits = lm.get_submodule(hooks.lm_head)(lm.get_submodule(hooks.final_norm)(hidden))
    cap = getattr(lm.config, hooks.final_logit_softcap, None) if hooks.final_logit_softcap else None
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def _int4_kl(lm, windows: torch.Tensor, batch_size: int, device, reporter: Reporter, hooks=None,
             sources: list[int] | None = None) -> list[float]:
    """Per layer: mean KL(p_fp || p_q) in nats per predicted token over ``windows`` [n, seqlen] when only
    that layer's KV is int4 (``sources``: the layer whose KV cache each layer reads, Gemma 4's E-models; a layer's
    int4 cache is then int4 for the layers that read it too, and those have no KL of their own). The layers before
    it compute what they compute in fp, so each run starts from the fp input of that layer (recorded with the
    arguments HF passes to every decoder layer; runs in layer order, so a cache an earlier layer shares was last
    written from its fp input)."""
    hooks = hooks or _hooks_of(lm)
    layers = lm.get_submodule(hooks.layers)
    num_layers = len(layers)
    sources = sources or list(range(num_layers))
    kl = [0.0] * num_layers
    count = 0
    batches = windows.split(batch_size)
    kv_layers = kv_cache_layers(lm, hooks, sources)
    reporter.start_steps("int4 KV one layer at a time", len(batches) * len(kv_layers))
    for batch in batches:
        # per layer: (positional arguments: the hidden states in first, Gemma 4's per-layer input next; keywords)
        inputs: list[tuple[tuple, dict]] = []
        handles = [layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append((args, kwargs)),
                                                   with_kwargs=True) for layer in layers]
        try:
            logits = lm(input_ids=batch.to(device), kv_bits=[0] * num_layers, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        ref = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [b, seq - 1, vocab]: predicted positions
        ref_p = ref.exp()
        del logits
        for i in kv_layers:  # (a layer without attention has no KV to quantize: its KL stays 0)
            bits = [4 if sources[j] == i else 0 for j in range(num_layers)]
            hidden = inputs[i][0][0]
            for j in range(i, num_layers):
                hidden = layers[j](hidden, *inputs[j][0][1:], **{**inputs[j][1], "kv_bits": bits})
            q = torch.log_softmax(_head(lm, hooks, hidden)[:, :-1].float(), dim=-1)
            kl[i] += float((ref_p * (ref - q)).sum())
            reporter.step_done()
        count += ref.shape[0] * ref.shape[1]
    return [v / count for v in kl]


def attention_layers(lm, hooks) -> list[int]:
    """The decoder layers with attention (a hybrid's recurrent layers have none)."""
    return [i for i, layer in enumerate(lm.get_submodule(hooks.layers)) if hasattr(layer, hooks.attention)]


def kv_cache_layers(lm, hooks, sources: list[int]) -> list[int]:
    """The layers with a KV cache of their own: attention layers that read no earlier layer's (``sources``)."""
    return [i for i in attention_layers(lm, hooks) if sources[i] == i]


def choose_policy(order_int4: list[int], order_fp: list[int], ppl_of, limit: float,
                  ppl_int8: float, ppl_int4: float) -> list[int]:
    """The policy (per layer bits) by the binary searches of the module doc.

    ``order_int4``: layers by int4 sensitivity, least first; ``order_fp``: layers by int8 error, largest first;
    ``ppl_of(layers)``: perplexity of a policy (cached by the caller); the all-int8 / all-int4 perplexities
    are known already.
    """
    num_layers = len(order_int4)

    def int4_on(k: int) -> list[int]:
        bits = [8] * num_layers
        for layer in order_int4[:k]:
            bits[layer] = 4
        return bits

    def fp_on(m: int) -> list[int]:
        bits = [8] * num_layers
        for layer in order_fp[:m]:
            bits[layer] = 0
        return bits

    def last_within(good: int, bad: int, policy) -> list[int]:
        """policy(good) is within the limit, policy(bad) is not: bisect to the within-limit end that is
        nearest ``bad`` (works in either direction)."""
        while abs(bad - good) > 1:
            mid = (good + bad) // 2
            if ppl_of(policy(mid)) <= limit:
                good = mid
            else:
                bad = mid
        return policy(good)

    if ppl_int8 <= limit:
        if ppl_int4 <= limit:
            return int4_on(num_layers)
        return last_within(0, num_layers, int4_on)  # as many int4 layers as fit
    return last_within(num_layers, 0, fp_on)  # as few fp layers as needed (all fp is within the limit)


def calibrate_kv(model: str | Path | None, config: KvCalibConfig, reporter: Reporter | None = None) -> KvCalibResult:
    """Choose the per-layer KV precision of the checkpoint ``model`` (fp or AWQ; a folder, a hub id, or
    None/"smollm2" for the bundled SmolLM2) and write ``config.work_dir/kv_policy.json``.

    The model runs in fp32 through transformers (the torch reference path, not the engine) with KV fake
    quantization exactly as the engine's (``lmkit.lite.kvquant``). Nothing is written unless the policy
    is complete (the file is written beside and renamed into place). Raises ValueError /
    FileNotFoundError naming the problem (model, architecture, data, work dir).
    """
    from transformers import AutoTokenizer

    from lmkit.kv_policy import save_kv_policy
    from lmkit.lite.checkpoint import load_causal_lm
    from lmkit.lite.kvquant import use_kv_fake_quant_attention
    from lmkit.lite.layerwise import architecture_of, read_config
    from lmkit.lite.ppl import evaluation_tokens, sum_nll
    from lmkit.model_path import resolve_model
    from lmkit.models import get_architecture

    reporter = reporter or _SilentReporter()
    require_quantizer("calibrate", config)
    start = time.perf_counter()
    source = resolve_model(model)
    device = resolve_device(config.device)
    raw = read_config(source)
    architecture = architecture_of(raw, source)
    hooks = get_architecture(architecture).kv_calib  # the policy is for lmkit's engine: refuse what it cannot run
    if hooks is None:
        raise ValueError(f"lmkit lite calibrate does not calibrate {architecture} yet (its fake-quantized attention "
                         "is not written); serve "
                         "it with a uniform quant_policy=8 or 4 instead")
    fields = get_architecture(architecture).model_fields(raw)
    policy_path = _policy_path(config.work_dir, config.overwrite)

    reporter.phase(f"tokenizing {config.calib_dataset} (calibration) and {config.eval_dataset} (evaluation)")
    tokenizer = AutoTokenizer.from_pretrained(source)
    eval_ids = evaluation_tokens(tokenizer, config.eval_dataset, config.eval_max_tokens)
    eval_docs = evaluation_corpus(config.eval_dataset)
    calib_corpora, num_dropped = [], 0
    for name, docs in calibration_corpora(config.calib_dataset):
        kept, dropped = drop_shared_text(docs, eval_docs)
        if not kept:
            raise CalibrationDataError(f"calibration dataset {name!r} shares all its text with the evaluation "
                                       f"dataset {config.eval_dataset!r}: calibrate on other text")
        calib_corpora.append((name, kept))
        num_dropped += dropped

    reporter.phase("loading the model")
    lm = load_causal_lm(source, device)
    use_kv_fake_quant_attention(lm, hooks)
    description = model_description(fields, architecture)
    num_layers = description["num_layers"]
    max_seqlen = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
    seqlen = min(config.calib_seqlen, max_seqlen) if max_seqlen else config.calib_seqlen
    windows = mixed_windows(tokenizer, calib_corpora, config.calib_samples, seqlen, config.seed)

    # the layer whose KV cache each layer reads: its own, or (Gemma 4's E-models) an earlier layer's, whose precision
    # it then has (one cache)
    sources = list(fields.layer_kv_source) or list(range(num_layers))
    phase_seconds = {"prepare": time.perf_counter() - start}
    t = time.perf_counter()
    layer_errors, num_calib_tokens = _attention_errors(lm, windows, config.batch_size, device, reporter, hooks)
    phase_seconds["attention_errors"] = time.perf_counter() - t
    int4_kl = None
    if config.sensitivity_samples:
        t = time.perf_counter()
        int4_kl = _int4_kl(lm, windows[:config.sensitivity_samples], config.batch_size, device, reporter, hooks,
                           sources)
        phase_seconds["int4_kl"] = time.perf_counter() - t
    t = time.perf_counter()

    search: list[dict] = []
    cache: dict[tuple[int, ...], float] = {}
    num_eval_tokens = 0

    def ppl_of(layers: list[int]) -> float:
        nonlocal num_eval_tokens
        key = tuple(layers)
        if key not in cache:
            reporter.phase(f"perplexity: {layers.count(4)} int4, {layers.count(8)} int8, {layers.count(0)} fp layers")
            run = functools.partial(lm, kv_bits=list(layers), use_cache=False)
            nll, count, _ = sum_nll(run, eval_ids, config.eval_seqlen, config.eval_seqlen, config.batch_size, device)
            cache[key] = math.exp(nll / count)
            num_eval_tokens = count
            search.append({"layers": list(layers), "ppl": cache[key]})
        return cache[key]

    # the search runs over the layers with a KV cache of their own; a layer that reads another's cache is written with
    # that layer's bits (the engine keeps one cache), the others as 0 (nothing to quantize)
    kv_layers = kv_cache_layers(lm, hooks, sources)

    def on_kv_layers(bits: list[int]) -> list[int]:
        full = [0] * num_layers
        for i, b in zip(kv_layers, bits):
            full[i] = b
        return [full[sources[i]] for i in range(num_layers)]

    n = len(kv_layers)
    ppl = {"fp": ppl_of([0] * num_layers), "int8": ppl_of(on_kv_layers([8] * n)),
           "int4": ppl_of(on_kv_layers([4] * n))}
    limit = ppl["fp"] * (1 + config.max_ppl_increase)
    def cache_error(i: int, variant: str) -> float:  # a cache's error: its layer's and its readers' (root sum of squares)
        return math.sqrt(sum(layer_errors[j][variant] ** 2 for j in range(num_layers) if sources[j] == i))

    order_int4 = sorted(range(n), key=lambda k: (int4_kl[kv_layers[k]] if int4_kl else 0.0,
                                                 cache_error(kv_layers[k], "int4"), k))
    order_fp = sorted(range(n), key=lambda k: (-cache_error(kv_layers[k], "int8"), k))
    layers = on_kv_layers(choose_policy(order_int4, order_fp, lambda bits: ppl_of(on_kv_layers(bits)), limit,
                                        ppl["int8"], ppl["int4"]))
    ppl["policy"] = ppl_of(layers)
    if ppl["policy"] > limit:
        raise RuntimeError(f"internal error: the chosen KV policy has perplexity {ppl['policy']:.4f} over the "
                           f"limit {limit:.4f}")
    for entry in search:
        entry["within_budget"] = entry["ppl"] <= limit
    phase_seconds["perplexity_search"] = time.perf_counter() - t
    seconds = time.perf_counter() - start

    temp = policy_path.with_name(f".{POLICY_FILE}.tmp-{os.getpid()}")
    try:
        save_kv_policy(
            temp, layers, description,
            source=str(source),
            budget={"max_ppl_increase": config.max_ppl_increase, "ppl_limit": limit},
            perplexity={**ppl, "dataset": config.eval_dataset, "num_tokens": num_eval_tokens,
                        "seqlen": config.eval_seqlen},
            layer_errors=[{name: round(v, 6) for name, v in errs.items()} for errs in layer_errors],
            error_metric="per layer with only that layer quantized: ||attn_q - attn_fp|| / ||attn_fp|| of the "
                         "attention block output (after o_proj), over all calibration tokens",
            layer_int4_kl=None if int4_kl is None else [float(f"{v:.6g}") for v in int4_kl],
            ranking="layer_int4_kl: KL(p_fp || p_q) in nats per token on the first sensitivity_samples "
                    "calibration windows, only that layer int4" if int4_kl else "layer_errors int4",
            search=[{"num_int4": e["layers"].count(4), "num_int8": e["layers"].count(8),
                     "num_fp": e["layers"].count(0), "ppl": e["ppl"], "within_budget": e["within_budget"]}
                    for e in search],
            calibration={"dataset": config.calib_dataset, "num_samples": config.calib_samples, "seqlen": seqlen,
                         "seed": config.seed, "num_tokens": num_calib_tokens,
                         "sensitivity_samples": config.sensitivity_samples, "num_docs_dropped": num_dropped},
            settings=config.as_dict(),
            seconds=round(seconds, 2),
            phase_seconds={k: round(v, 2) for k, v in phase_seconds.items()},
        )
        os.replace(temp, policy_path)
    finally:
        temp.unlink(missing_ok=True)
    return KvCalibResult(policy_path=policy_path, source=source, layers=layers, layer_errors=layer_errors,
                         layer_int4_kl=int4_kl, ppl=ppl, ppl_limit=limit,
                         num_eval_tokens=num_eval_tokens, num_calib_tokens=num_calib_tokens,
                         num_calib_docs_dropped=num_dropped, search=search, seconds=seconds)
