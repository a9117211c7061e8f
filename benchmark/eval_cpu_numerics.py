"""What the CPU's fast paths cost in quality: perplexity of a model scored by the engine's prefill (prompt
logprobs over held-out text) and greedy agreement, one engine setting against another on the same tokens.

    python benchmark/eval_cpu_numerics.py [MODEL] --compare dtype        # dtype='auto' (bf16 on AVX512_BF16 CPUs) vs float32
    python benchmark/eval_cpu_numerics.py AWQ_FOLDER --compare int8      # int8 activations (AMX / VNNI) vs the exact fp32 path
        [--dataset hamlet] [--tokens 8192] [--window 512] [--greedy-prompts 16] [--greedy-tokens 32]

MODEL defaults to the bundled SmolLM2-135M-Instruct. The accuracy guards of the CPU-speed issue: perplexity
within 0.2% of float32, and the greedy agreement stated (tokens equal at the same place, identical leading
tokens, completions identical to the end).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SETTINGS = {
    "dtype": [("dtype=auto", dict(dtype="auto")), ("dtype=float32", dict(dtype="float32"))],
    "int8": [("int8 activations", dict(dtype="float32", int8_activations=True)),
             ("fp32 activations", dict(dtype="float32", int8_activations=False))],
}


def main() -> None:
    from lmkit import EngineConfig, GenerationConfig, pipeline
    from lmkit.lite.ppl import evaluation_tokens
    from lmkit.model_path import resolve_model
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--compare", choices=sorted(SETTINGS), default="dtype")
    ap.add_argument("--dataset", default="hamlet")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--greedy-prompts", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    args = ap.parse_args()
    model = resolve_model(args.model)
    ids = evaluation_tokens(AutoTokenizer.from_pretrained(str(model)), args.dataset, args.tokens).tolist()
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    prompts = [ids[i * 97:i * 97 + 48] for i in range(args.greedy_prompts)]
    n = sum(len(w) - 1 for w in windows)
    ppl, greedy = {}, {}
    for label, settings in SETTINGS[args.compare]:
        config = EngineConfig(device="cpu", max_batch_size=8, **settings)
        with pipeline(model, config) as pipe:
            scored = pipe(windows, GenerationConfig(max_new_tokens=0, prompt_logprobs=0))
            nll = -sum(next(iter(entry.values())) for r in scored for entry in r.prompt_logprobs[1:])
            ppl[label] = math.exp(nll / n)
            out = pipe(prompts, GenerationConfig(max_new_tokens=args.greedy_tokens, ignore_eos=True))
            greedy[label] = [r.token_ids for r in out]
        print(f"{label}: perplexity {ppl[label]:.4f} over {n} tokens of {args.dataset} "
              f"({len(windows)} windows of {args.window})", flush=True)
    (a, pa), (b, pb) = [(label, ppl[label]) for label, _ in SETTINGS[args.compare]]
    print(f"{a} vs {b}: perplexity {100 * (pa / pb - 1):+.3f}%")
    x, y = greedy[a], greedy[b]
    total = sum(len(t) for t in x)
    same = sum(p == q for s, t in zip(x, y) for p, q in zip(s, t))
    lead = [next((i for i, (p, q) in enumerate(zip(s, t)) if p != q), len(s)) for s, t in zip(x, y)]
    print(f"greedy agreement over {len(x)} prompts x {args.greedy_tokens} tokens: {same}/{total} tokens equal at "
          f"the same place, {sum(lead)}/{total} before the first difference, "
          f"{sum(k == args.greedy_tokens for k in lead)}/{len(x)} completions identical")


if __name__ == "__main__":
    main()
