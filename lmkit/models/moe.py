"""What the mixture-of-experts architectures share: the engine roles of an MoE layer (the router and every
expert's gate / up / down), mapped onto the names their checkpoints use."""

from __future__ import annotations

from lmkit.models.llama import layer_keys


def moe_keys(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict[str, str]:
    """Engine role -> HF tensor name of an MoE layer whose router is ``{block}.gate`` and whose experts are
    ``{block}.experts.{e}.<gate|up|down>`` ("{i}": layer, "{e}": expert, expanded by the loader). The
    ``experts.<gate|up|down>_exps`` roles are every expert's tensor in one, as llama.cpp's converter merges them
    (named here as the gguf package's table knows them; GGUF files only)."""
    return layer_keys({
        "router": f"{block}.gate.weight",
        "experts.{e}.gate_proj": f"{block}.experts.{{e}}.{gate}.weight",
        "experts.{e}.up_proj": f"{block}.experts.{{e}}.{up}.weight",
        "experts.{e}.down_proj": f"{block}.experts.{{e}}.{down}.weight",
        "experts.gate_exps": f"{block}.experts.{gate}.weight",
        "experts.up_exps": f"{block}.experts.{up}.weight",
        "experts.down_exps": f"{block}.experts.{down}.weight",
    })


def fused_moe_keys(block: str) -> dict[str, str]:
    """Engine role -> HF tensor name of an MoE layer whose experts are stored together, as transformers 5 holds
    them in memory: ``{block}.experts.gate_up_proj`` [experts, 2 moe_inter, hidden] (each expert's gate rows,
    then its up rows) and ``{block}.experts.down_proj`` [experts, hidden, moe_inter] (Qwen3.5-MoE as shipped)."""
    return layer_keys({
        "experts.gate_up_proj": f"{block}.experts.gate_up_proj",
        "experts.down_proj": f"{block}.experts.down_proj",
    })
