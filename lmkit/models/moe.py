"""What the mixture-of-experts architectures share: the engine roles of an MoE layer (the router and every
expert's gate / up / down), mapped onto the names their checkpoints use."""

from __future__ import annotations

from lmkit.models.llama import layer_keys


def moe_keys(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict[str, str]:
    """Engine role -> HF tensor name of an MoE layer whose router is ``{block}.gate`` and whose experts are
    ``{block}.experts.{e}.<gate|up|down>`` ("{i}": layer, "{e}": expert, expanded by the loader)."""
    return layer_keys({
        "router": f"{block}.gate.weight",
        "experts.{e}.gate_proj": f"{block}.experts.{{e}}.{gate}.weight",
        "experts.{e}.up_proj": f"{block}.experts.{{e}}.{up}.weight",
        "experts.{e}.down_proj": f"{block}.experts.{{e}}.{down}.weight",
    })
