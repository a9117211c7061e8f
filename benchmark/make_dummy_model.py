"""Writes an HF model folder with random ("dummy") weights for a known shape, so that big models can be
benchmarked on machines without a model hub (the GPU machines; vLLM's load_format="dummy").

    python benchmark/make_dummy_model.py OUT [--shape llama-2-7b] [--awq GROUP | --w8a8] [--layers N]
        [--tokenizer FOLDER]

The folder holds config.json, model.safetensors (fp16, values uniform in +-0.02: a random network whose
activations stay in range), and a word-level tokenizer with one token per id ("t0", "t1", ...) so every id
the model can produce decodes. With --awq GROUP the linear layers are AWQ int4 "GEMM" tensors instead
(random nibbles, scales 0.002, the quantization_config of DESIGN.md section 4): the bytes and shapes of a
real AWQ checkpoint, the same work for the engine (mixture-of-experts shapes: every expert quantized, the
router left fp16, as AutoAWQ does). With --w8a8 they are compressed-tensors int8 (`int-quantized`, llm-compressor's
W8A8: random int8 weights, an fp16 scale per output channel of 0.02 / 127, int8 dynamic per-token activations;
the lm_head and routers in its `ignore` list). Weights are written shard by shard (one layer at a time), never the
whole model in memory. --layers N keeps the first N decoder layers of the shape (a big shape on a small
disk); --tokenizer FOLDER copies that folder's tokenizer instead of the word-level one (llama.cpp's
converter only accepts tokenizers it knows: `--tokenizer bundled` takes the bundled SmolLM2's, padded to
the shape's vocabulary by the converter; a shape whose vocabulary is smaller than the tokenizer's, Mixtral's
32000, gets the tokenizer's size).
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
    # the CPU-speed issue's 1.2B Llama: Llama-3.2-1B's layers (hidden 2048, 16 layers, GQA 32/8, intermediate
    # 8192) with SmolLM2's vocabulary (use --tokenizer bundled), lm_head untied
    "llama-1.2b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                       intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="float16",
                       bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    # Qwen3-30B-A3B's (Qwen/Qwen3-30B-A3B): 128 experts of 768, top-8, q/k norm
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                          bos_token_id=151643, eos_token_id=151645, hidden_act="silu"),
    # Mixtral-8x7B's (mistralai/Mixtral-8x7B-v0.1): 8 experts of 14336, top-2
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    # small ones, for the smoke tests
    "tiny-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256,
                     intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                     max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False, torch_dtype="float16", bos_token_id=1, eos_token_id=2,
                     hidden_act="silu"),
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
        """A view of the pool where it holds n values from the current offset (no copy: many tensors of a
        layer share the pool's memory), else a tiled copy (tensors larger than the pool)."""
        n = int(np.prod(shape))
        if n <= pool.size:
            start = self.pos if self.pos + n <= pool.size else 0
            out = pool[start:start + n]
        else:
            out = np.tile(pool, -(-n // pool.size))[:n]
        self.pos = (self.pos + 7919) % pool.size
        return out.reshape(shape)


def write_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"t{bos}", "eos_token": f"t{eos}",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def _tokenizer_folder(source: Path) -> Path:
    if str(source) == "bundled":
        from lmkit.model_path import default_model_dir

        return default_model_dir()
    return source


def tokenizer_size(source: Path) -> int:
    """Token ids the tokenizer of ``source`` uses (its largest id + 1)."""
    from tokenizers import Tokenizer

    return max(Tokenizer.from_file(str(_tokenizer_folder(source) / "tokenizer.json")).get_vocab().values()) + 1


def copy_tokenizer(source: Path, out: Path) -> tuple[int | None, int | None]:
    """The tokenizer files of ``source`` (``bundled``: the bundled SmolLM2) into ``out``; its bos / eos ids."""
    import shutil

    source = _tokenizer_folder(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "vocab.json", "merges.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    cfg = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
    return cfg.get("bos_token_id"), cfg.get("eos_token_id")


def make_dummy_model(out: Path, shape: str = "llama-2-7b", awq_group_size: int = 0, seed: int = 0,
                     layers: int | None = None, tokenizer: Path | None = None, w8a8: bool = False) -> Path:
    """Writes the folder (see the module docstring) and returns it."""
    from safetensors.numpy import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be 1..{cfg['num_hidden_layers']} for {shape}, got {layers}")
        cfg["num_hidden_layers"] = layers
    if awq_group_size:
        if awq_group_size not in (32, 64, 128):
            raise ValueError(f"--awq group size must be 32, 64 or 128, got {awq_group_size}")
        cfg["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4,
                                      "group_size": awq_group_size, "zero_point": True}
        cfg["torch_dtype"] = "float16"
    if w8a8:
        if awq_group_size:
            raise ValueError("--w8a8 and --awq exclude each other")
        int8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "group_size": None}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                                          "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$"]}
        cfg["torch_dtype"] = "float16"
    if tokenizer is not None:  # a vocabulary the tokenizer fits in (Mixtral's 32000 < SmolLM2's 49152)
        cfg["vocab_size"] = max(cfg["vocab_size"], tokenizer_size(tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    rnd = _Random(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", H // heads)
    f16 = lambda *s: rnd.take(rnd.f16, s)  # noqa: E731
    ones = lambda n: np.ones(n, dtype=np.float16)  # noqa: E731

    def linear(prefix: str, out_f: int, in_f: int) -> dict:
        if w8a8:
            return {f"{prefix}.weight": rnd.take(rnd.i32, (out_f, in_f // 4)).view(np.int8),
                    f"{prefix}.weight_scale": np.full((out_f, 1), 0.02 / 127, dtype=np.float16)}
        if not awq_group_size:
            return {f"{prefix}.weight": f16(out_f, in_f)}
        g = awq_group_size
        return {f"{prefix}.qweight": rnd.take(rnd.i32, (in_f, out_f // 8)),
                f"{prefix}.qzeros": np.full((in_f // g, out_f // 8), 0x88888888 - 2**32, dtype=np.int32),
                f"{prefix}.scales": np.full((in_f // g, out_f), 0.002, dtype=np.float16)}

    def mlp(prefix: str) -> dict:
        if cfg["model_type"] == "qwen3_moe":  # router mlp.gate, experts mlp.experts.{e}.gate/up/down_proj
            E, MI = cfg["num_experts"], cfg["moe_intermediate_size"]
            t = {f"{prefix}.mlp.gate.weight": f16(E, H)}
            for e in range(E):
                x = f"{prefix}.mlp.experts.{e}"
                t |= linear(f"{x}.gate_proj", MI, H) | linear(f"{x}.up_proj", MI, H) | linear(f"{x}.down_proj", H, MI)
            return t
        if cfg["model_type"] == "mixtral":  # block_sparse_moe.gate, experts .w1 (gate), .w3 (up), .w2 (down)
            E = cfg["num_local_experts"]
            t = {f"{prefix}.block_sparse_moe.gate.weight": f16(E, H)}
            for e in range(E):
                x = f"{prefix}.block_sparse_moe.experts.{e}"
                t |= linear(f"{x}.w1", I, H) | linear(f"{x}.w3", I, H) | linear(f"{x}.w2", H, I)
            return t
        return (linear(f"{prefix}.mlp.gate_proj", I, H) | linear(f"{prefix}.mlp.up_proj", I, H)
                | linear(f"{prefix}.mlp.down_proj", H, I))

    def shards():  # made one at a time, each written before the next is made
        yield "model-embed.safetensors", {"model.embed_tokens.weight": f16(V, H), "model.norm.weight": ones(H),
                                          "lm_head.weight": f16(V, H)}
        for i in range(cfg["num_hidden_layers"]):
            yield f"model-layer{i:03d}.safetensors", layer(i)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": ones(H), f"{p}.post_attention_layernorm.weight": ones(H)}
        if cfg["model_type"] == "qwen3_moe":
            t |= {f"{p}.self_attn.q_norm.weight": ones(hd), f"{p}.self_attn.k_norm.weight": ones(hd)}
        t |= linear(f"{p}.self_attn.q_proj", heads * hd, H)
        t |= linear(f"{p}.self_attn.k_proj", kv_heads * hd, H)
        t |= linear(f"{p}.self_attn.v_proj", kv_heads * hd, H)
        t |= linear(f"{p}.self_attn.o_proj", H, heads * hd)
        return t | mlp(p)

    index = {}
    for name, tensors in shards():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index |= {k: name for k in tensors}
        del tensors
    if tokenizer is not None:
        bos, eos = copy_tokenizer(tokenizer, out)
        cfg["bos_token_id"] = bos if bos is not None else cfg["bos_token_id"]
        cfg["eos_token_id"] = eos if eos is not None else cfg["eos_token_id"]
    else:
        write_tokenizer(out, V, cfg["bos_token_id"], cfg["eos_token_id"])
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                            "eos_token_id": cfg["eos_token_id"]}))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    ap.add_argument("--awq", type=int, default=0, metavar="GROUP", help="AWQ int4 linears with this group size")
    ap.add_argument("--w8a8", action="store_true", help="compressed-tensors W8A8 int8 linears (per-channel scales)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers of the shape")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="copy this folder's tokenizer ('bundled': SmolLM2's) instead of the word-level one")
    args = ap.parse_args(argv)
    make_dummy_model(args.out, args.shape, args.awq, args.seed, args.layers, args.tokenizer, args.w8a8)
    layers = f", {args.layers} layers" if args.layers else ""
    kind = f", AWQ int4 g{args.awq}" if args.awq else ", W8A8 int8" if args.w8a8 else ", fp16"
    print(f"wrote {args.out} ({args.shape}{layers}{kind})")


if __name__ == "__main__":
    main()
