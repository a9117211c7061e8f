"""Embedding throughput: texts/s of lmkit's engine (Engine.embed: the prompts computed without generating, their
last token's final hidden state, normalized) side by side with sentence-transformers encoding the same texts
with the same model, pooling and normalization, in one run on the same machine.

    pip install -e ".[peers]"    # sentence-transformers
    python benchmark/bench_embeddings.py [--model smollm2] [--lengths 128 512] [--num-texts 64]
        [--threads 2] [--rounds 3] [--csv benchmark/results/embeddings.csv] [--smoke]

The texts are distinct windows of held-out text (pydoc's held-out topics, then Hamlet) of the given token
lengths, decoded to text; both sides tokenize them. lmkit runs in this process with --threads engine threads,
sentence-transformers with torch.set_num_threads(--threads) and batches of --st-batch-size, one after the other
(never both at once), each in fp32 and bf16. A warm-up round goes first; reported: texts/s and tokens/s (mean
over rounds), and the least cosine similarity between each side's vector of a text and lmkit fp32's.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server_hardening import cpu_name  # noqa: E402
from summary import append_csv  # noqa: E402


CSV_HEADER = ["date", "cpu", "model", "threads", "tokens", "texts", "side", "texts_per_s", "tokens_per_s", "min_cos"]


def texts(tokenizer, num: int, length: int) -> list[str]:
    from lmkit.lite.corpora import hamlet, pydoc_evaluation

    ids = tokenizer.encode("\n\n".join(pydoc_evaluation() + hamlet()), add_special_tokens=False)
    if len(ids) < num * length:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than {num} x {length}")
    return [tokenizer.decode(ids[i * length:(i + 1) * length]) for i in range(num)]


def timed(embed, batch: list[str], rounds: int) -> tuple[float, np.ndarray]:
    """Mean seconds of embed(batch) over ``rounds`` after a warm-up, and its vectors."""
    vectors = np.asarray(embed(batch))
    start = time.perf_counter()
    for _ in range(rounds):
        embed(batch)
    return (time.perf_counter() - start) / rounds, vectors


def lmkit_side(model: Path, dtype: str, threads: int, batch: list[str], rounds: int):
    from lmkit import EngineConfig
    from lmkit.engine import Engine

    engine = Engine(model, EngineConfig(dtype=dtype, num_threads=threads, max_batch_size=len(batch),
                                        session_len=2048))
    try:
        seconds, vectors = timed(engine.embed, batch, rounds)
        tokens = sum(len(engine.encode(t)) for t in batch)
    finally:
        engine.close()
    return seconds, vectors, tokens


def st_side(model: Path, dtype: str, threads: int, batch: list[str], rounds: int, batch_size: int):
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    torch.set_num_threads(threads)
    word = Transformer(str(model), model_kwargs={"dtype": getattr(torch, dtype)})
    word.modality_config.pop("message", None)  # plain texts as they are, not as chat messages (as lmkit's)
    if word.tokenizer.pad_token is None:
        word.tokenizer.pad_token = word.tokenizer.eos_token
    pooling = Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[word, pooling, Normalize()], device="cpu")
    with torch.inference_mode():
        seconds, vectors = timed(lambda b: st.encode(b, batch_size=batch_size, convert_to_numpy=True), batch, rounds)
    return seconds, vectors.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--num-texts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--csv", type=Path, default=HERE / "results" / "embeddings.csv")
    ap.add_argument("--smoke", action="store_true", help="8 texts of 32 tokens, one round, fp32 only, no CSV")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.num_texts, args.rounds, args.csv = [32], 8, 1, None
    from lmkit.model_path import resolve_model
    from lmkit.tokenizer import Tokenizer

    model = resolve_model(args.model)
    tokenizer = Tokenizer(model)
    dtypes = ["float32"] if args.smoke else ["float32", "bfloat16"]
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"# {cpu_name()}, {model.name}, {args.threads} threads, {args.num_texts} texts, {stamp}")
    print(f"{'tokens':>6} {'side':<30} {'texts/s':>8} {'tokens/s':>9} {'min cos':>8}")
    for length in args.lengths:
        batch = texts(tokenizer, args.num_texts, length)
        rows = []
        reference = None
        for dtype in dtypes:
            seconds, vectors, tokens = lmkit_side(model, dtype, args.threads, batch, args.rounds)
            reference = vectors if reference is None else reference
            rows.append((f"lmkit {dtype}", seconds, vectors))
            seconds, vectors = st_side(model, dtype, args.threads, batch, args.rounds, args.st_batch_size)
            rows.append((f"sentence-transformers {dtype}", seconds, vectors))
        for side, seconds, vectors in rows:
            cos = float(np.min(np.sum(vectors * reference, axis=1)))  # both normalized
            texts_s, tokens_s = len(batch) / seconds, tokens / seconds
            print(f"{length:>6} {side:<30} {texts_s:>8.1f} {tokens_s:>9.0f} {cos:>8.5f}")
            if args.csv is not None:
                append_csv(args.csv, CSV_HEADER, [[stamp, cpu_name(), model.name, args.threads, length, len(batch),
                                                   side, round(texts_s, 2), round(tokens_s), round(cos, 6)]])
        if args.smoke:
            assert all(float(np.min(np.sum(v * reference, axis=1))) > 0.999 for _, _, v in rows), rows


if __name__ == "__main__":
    main()
