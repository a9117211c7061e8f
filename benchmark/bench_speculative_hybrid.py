"""What speculative decoding costs and gains on a Gated DeltaNet hybrid (Qwen3.5's layer pattern), where every draft
row also runs the recurrent layers and a rejection rolls their state back to a checkpoint.

    python benchmark/bench_speculative_hybrid.py [--layers 24] [--new-tokens 128] [--rounds 2] [--threads 2]
        [--folder PATH] [--smoke]

The model: random weights (HF's initialisation, bf16) in a Qwen3.5-0.8B-like shape: hidden 1024, MLP 3584, 3 Gated
DeltaNet layers (16 key and 16 value heads of 128, convolution of 4) to 1 gated attention layer (8 query and 2 KV
heads of 256, a quarter rotary), SmolLM2's 49,152-token vocabulary and tokenizer (the real 248k would add a larger
lm_head to every step), --layers of them; written once under LMKIT_CACHE/peers/ (or --folder). Random weights say nothing
of how often real drafts are right, so the rows fix acceptance instead, with the request's prediction:

  off             one token a step
  all kept        the prediction is the exact greedy answer: every step verifies 8 drafts and keeps them
  every 4th wrong the prediction has every 4th token wrong, every proposal verified (speculative_adaptive=False):
                  a step keeps the drafts up to the wrong one and rolls the state back to that row's checkpoint
  wrong, adaptive a prediction right in its first token only, under the default adaptive rule: it stops proposing
                  after its first misses and probes now and then (an always-wrong proposer costs its probes)
A random network falls into loops that n-gram lookup predicts, so the n-gram proposer adds drafts of its own where
the prediction proposes none (counted apart in the table).

The model carries a random multi-token-prediction head (mtp.*, as Qwen3.5 ships one), so a row prices
speculative='mtp' where its drafts are (almost) never right:
  mtp, adaptive   the head runs after every step (its K/V stay complete) and drafts until its misses switch it off,
                  then probes: what the head costs where it does not pay (what it gains needs trained weights)

Batch-1 decode tokens/s after a 256-token random prompt (prefill excluded), greedy, eos ignored; each row's tokens
must equal the off row's. One process, rows one after another, rounds alternating their order; medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_prefill import cpu_description  # noqa: E402
from bench_speculative import decode_rate, stamps_lmkit  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, vocab_size=49152, full_attention_interval=4, tie_word_embeddings=True)
SMOKE = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def make_model(folder: Path, layers: int, smoke: bool) -> Path:
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    shape = SMOKE if smoke else SHAPE
    config = Qwen3_5TextConfig(**shape, num_hidden_layers=layers, max_position_embeddings=4096, bos_token_id=1,
                               eos_token_id=2, pad_token_id=0,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    add_random_mtp_head(folder, layers)
    from lmkit.model_path import default_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's, whose vocabulary the shape takes
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


def add_random_mtp_head(folder: Path, layers: int) -> None:
    """A one-layer MTP head as Qwen3.5 ships it (mtp.fc, its norms, mtp.layers.0.* shaped as the last full-attention
    layer), random: HF's initialisation (normal, std 0.02; norms zero, i.e. (1 + w) = 1)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    last = max(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    prefix = f"model.layers.{last}."
    g = torch.Generator().manual_seed(1)
    hidden = cfg["hidden_size"]

    def like(shape, norm: bool):
        return torch.zeros(shape, dtype=torch.bfloat16) if norm else \
            (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    mtp = {"mtp.fc.weight": like((hidden, 2 * hidden), False)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = like((hidden,), True)
    for name, t in tensors.items():
        if name.startswith(prefix):
            mtp["mtp.layers.0." + name[len(prefix):]] = like(tuple(t.shape), "norm" in name)
    save_file({**tensors, **mtp}, str(shard), metadata={"format": "pt"})


def decode(engine, prompt: list[int], gen) -> tuple[list[int], float]:
    """Greedy tokens and decode tokens/s (tokens after the first over the time from the first to the last)."""
    tokens, stamps = stamps_lmkit(engine, prompt, gen)
    return tokens, decode_rate([stamps])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--folder", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 16 tokens, one round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.new_tokens, args.rounds = 4, 16, 1
    from lmkit import EngineConfig, GenerationConfig, env
    from lmkit.engine import Engine

    name = f"qwen3.5-hybrid-{'smoke' if args.smoke else 'h1024'}-{args.layers}l-mtp"
    folder = make_model(args.folder or env.cache_dir() / "peers" / name, args.layers, args.smoke)
    vocab = SHAPE["vocab_size"]
    prompt = np.random.default_rng(7).integers(3, vocab, size=256).tolist()
    base = dict(num_threads=args.threads, max_batch_size=4, session_len=1024)
    gen = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    with closing(Engine(folder, EngineConfig(**base, speculative="off"))) as engine:
        exact, _ = decode(engine, prompt, GenerationConfig(**gen))
    # right in its first token (the prefill's, never a draft): the first proposals follow it, then it realigns
    wrong = exact[:1] + [(t + 17) % vocab for t in exact[1:]]
    every_4th = [(t + 17) % vocab if i % 4 == 3 else t for i, t in enumerate(exact)]
    rows = {
        "off": (dict(speculative="off"), None),
        "all kept": (dict(speculative="ngram", speculative_adaptive=False), exact),
        "every 4th wrong": (dict(speculative="ngram", speculative_adaptive=False), every_4th),
        "wrong, adaptive": (dict(speculative="ngram"), wrong),
        "mtp, adaptive": (dict(speculative="mtp"), None),
    }
    rates: dict[str, list[float]] = {r: [] for r in rows}
    same: dict[str, bool] = {}
    drafts: dict[str, tuple[int, int]] = {}
    for rnd in range(args.rounds):
        for row in (list(rows) if rnd % 2 == 0 else list(reversed(rows))):
            config, prediction = rows[row]
            with closing(Engine(folder, EngineConfig(**base, **config))) as engine:
                decode(engine, prompt[:32], GenerationConfig(max_new_tokens=4))  # warm
                tokens, rate = decode(engine, prompt, GenerationConfig(**gen, prediction=prediction))
                m = engine.metrics()
            rates[row].append(rate)
            same[row] = same.get(row, True) and tokens == exact
            drafts[row] = {src: (m.num_draft_tokens[src], m.num_accepted_draft_tokens[src])
                           for src in ("prediction", "ngram", "mtp") if m.num_draft_tokens[src]}
    off = statistics.median(rates["off"])
    print(f"# {cpu_description()}, {args.threads} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {name}: {folder}; 256-token prompt, {args.new_tokens} new tokens, {args.rounds} rounds")
    print("| row | decode tok/s (rounds) | / off | drafts verified / kept, by proposer | tokens as off |")
    print("|---|---:|---:|---|---:|")
    for row in rows:
        r = statistics.median(rates[row])
        each = ", ".join(f"{x:.1f}" for x in rates[row])
        d = ", ".join(f"{src} {v} / {k}" for src, (v, k) in drafts[row].items()) or "-"
        print(f"| {row} | {r:.1f} ({each}) | {r / off:.2f}x | {d} | {'yes' if same[row] else 'NO'} |")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
