"""Writes an HF model folder with random ("dummy") weights for a known shape, so that big models can be
benchmarked on machines without a model hub (the GPU machines; vLLM's load_format="dummy").

    python benchmark/make_dummy_model.py OUT [--shape llama-2-7b] [--awq GROUP]

The folder holds config.json, model.safetensors (fp16, values uniform in +-0.02: a random network whose
activations stay in range), and a word-level tokenizer with one token per id ("t0", "t1", ...) so every id
the model can produce decodes. With --awq GROUP the linear layers are AWQ int4 "GEMM" tensors instead
(random nibbles, scales 0.002, the quantization_config of DESIGN.md section 4): the bytes and shapes of a
real AWQ checkpoint, the same work for the engine. Weights are written shard by shard (one layer at a
time), never the whole model in memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SHAPES = {
    # Llama-2-7B's config.json (meta-llama/Llama-2-7b-hf)
    "llama-2-7b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float16",
                       bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    # Llama-3-8B's (GQA, 128k vocabulary)
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                       bos_token_id=128000, eos_token_id=128001, hidden_act="silu"),
    # a small one, for the smoke test
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                 max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 torch_dtype="float16", bos_token_id=1, eos_token_id=2, hidden_act="silu"),
}


class _Random:
    """Cheap dummy values: slices of one random pool (independence does not matter to a benchmark)."""

    def __init__(self, seed: int, pool: int = 1 << 24):
        rng = np.random.default_rng(seed)
        self.f16 = (rng.random(pool, dtype=np.float32) * 0.04 - 0.02).astype(np.float16)
        self.i32 = rng.integers(-2**31, 2**31 - 1, size=pool, dtype=np.int64).astype(np.int32)
        self.pos = 0

    def take(self, pool: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        reps = -(-(n + self.pos) // pool.size)
        out = np.tile(pool, reps)[self.pos:self.pos + n] if reps > 1 else pool[self.pos:self.pos + n]
        self.pos = (self.pos + 7919) % pool.size
        return np.ascontiguousarray(out).reshape(shape)


def write_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"t{bos}", "eos_token": f"t{eos}",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def make_dummy_model(out: Path, shape: str = "llama-2-7b", awq_group_size: int = 0, seed: int = 0) -> Path:
    """Writes the folder (see the module docstring) and returns it."""
    from safetensors.numpy import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    if awq_group_size:
        if awq_group_size not in (32, 64, 128):
            raise ValueError(f"--awq group size must be 32, 64 or 128, got {awq_group_size}")
        cfg["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4,
                                      "group_size": awq_group_size, "zero_point": True}
        cfg["torch_dtype"] = "float16"
    out.mkdir(parents=True, exist_ok=True)
    rnd = _Random(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = H // heads
    f16 = lambda *s: rnd.take(rnd.f16, s)  # noqa: E731
    ones = lambda n: np.ones(n, dtype=np.float16)  # noqa: E731

    def linear(prefix: str, out_f: int, in_f: int) -> dict:
        if not awq_group_size:
            return {f"{prefix}.weight": f16(out_f, in_f)}
        g = awq_group_size
        return {f"{prefix}.qweight": rnd.take(rnd.i32, (in_f, out_f // 8)),
                f"{prefix}.qzeros": np.full((in_f // g, out_f // 8), 0x88888888 - 2**32, dtype=np.int32),
                f"{prefix}.scales": np.full((in_f // g, out_f), 0.002, dtype=np.float16)}

    index = {}
    shards = [("model-embed.safetensors", {"model.embed_tokens.weight": f16(V, H), "model.norm.weight": ones(H),
                                           "lm_head.weight": f16(V, H)})]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": ones(H), f"{p}.post_attention_layernorm.weight": ones(H)}
        t |= linear(f"{p}.self_attn.q_proj", heads * hd, H)
        t |= linear(f"{p}.self_attn.k_proj", kv_heads * hd, H)
        t |= linear(f"{p}.self_attn.v_proj", kv_heads * hd, H)
        t |= linear(f"{p}.self_attn.o_proj", H, heads * hd)
        t |= linear(f"{p}.mlp.gate_proj", I, H)
        t |= linear(f"{p}.mlp.up_proj", I, H)
        t |= linear(f"{p}.mlp.down_proj", H, I)
        shards.append((f"model-layer{i:03d}.safetensors", t))
    for name, tensors in shards:  # one shard in memory at a time
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index |= {k: name for k in tensors}
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                            "eos_token_id": cfg["eos_token_id"]}))
    write_tokenizer(out, V, cfg["bos_token_id"], cfg["eos_token_id"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    ap.add_argument("--awq", type=int, default=0, metavar="GROUP", help="AWQ int4 linears with this group size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    make_dummy_model(args.out, args.shape, args.awq, args.seed)
    print(f"wrote {args.out} ({args.shape}{f', AWQ int4 g{args.awq}' if args.awq else ', fp16'})")


if __name__ == "__main__":
    main()
