"""Supported architectures by name. A new Llama-like architecture is one table entry here."""

from __future__ import annotations

from dataclasses import dataclass, field

# Engine role -> HF tensor name. "{i}" is the layer index.
LLAMA_KEY_MAP: dict[str, str] = {
    "embed_tokens": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layers.{i}.input_norm": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.down_proj": "model.layers.{i}.mlp.down_proj.weight",
}


@dataclass(frozen=True)
class Architecture:
    """What the engine must know about one HF architecture name."""

    name: str
    key_map: dict[str, str] = field(default_factory=lambda: dict(LLAMA_KEY_MAP))
    qkv_bias: bool = False
    # How the config states its sliding window: "sliding_window" is used when this returns True.
    uses_sliding_window: str = "never"  # "never" | "always" | "if_use_sliding_window"


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("MistralForCausalLM", uses_sliding_window="always"),
    "Qwen2ForCausalLM": Architecture("Qwen2ForCausalLM", qkv_bias=True, uses_sliding_window="if_use_sliding_window"),
}


def get_architecture(name: str) -> Architecture:
    """The registry entry for ``name``; ValueError listing the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {name!r}; lmkit supports {', '.join(sorted(ARCHITECTURES))}"
        ) from None
