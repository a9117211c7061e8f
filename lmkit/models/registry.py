"""Supported architectures by HF name. A new architecture is one module (lmkit/models/<arch>.py) and one
line here; the engine (loader) and lite (AWQ maps, KV calibration hooks) both read this registry."""

from __future__ import annotations

from lmkit.models import gemma2, gemma3, gemma4, gpt_oss, llama, mistral, mixtral, olmoe, phi3, qwen2, qwen3, qwen3_5, \
    qwen3_5_moe, qwen3_moe, qwen3_next, smollm3
from lmkit.models.architecture import Architecture
from lmkit.models.awq_map import AwqMap

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (
    llama.ARCHITECTURE,
    mistral.ARCHITECTURE,
    qwen2.ARCHITECTURE,
    qwen3.ARCHITECTURE,
    gemma2.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    phi3.ARCHITECTURE,
    smollm3.ARCHITECTURE,
    qwen3_moe.ARCHITECTURE,
    mixtral.ARCHITECTURE,
    olmoe.ARCHITECTURE,
    qwen3_5.ARCHITECTURE,
    qwen3_5.MULTIMODAL_ARCHITECTURE,
    qwen3_5_moe.ARCHITECTURE,
    qwen3_5_moe.MULTIMODAL_ARCHITECTURE,
    qwen3_next.ARCHITECTURE,
    gpt_oss.ARCHITECTURE,
    gemma4.ARCHITECTURE,
    gemma4.MULTIMODAL_ARCHITECTURE,
)}


# Architectures users bring that lmkit knows and cannot run yet: what each lacks, named at load (issue 62).
NOT_YET: dict[str, str] = {}


def get_architecture(name: str) -> Architecture:
    """The registry entry for ``name``; ValueError naming what lmkit lacks for a known one it cannot run yet
    (NOT_YET), or listing the supported ones otherwise."""
    if name in NOT_YET:
        raise ValueError(f"{name} is not supported yet: {NOT_YET[name]}. lmkit runs {', '.join(sorted(ARCHITECTURES))}")
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {name!r}; lmkit supports {', '.join(sorted(ARCHITECTURES))} "
            "(adding one is a module in lmkit/models/ and a line in lmkit/models/registry.py)"
        ) from None


def get_awq_map(name: str) -> AwqMap:
    """The AWQ table of ``name`` (``get_architecture(name).awq_map``); ValueError listing the supported ones, or
    saying that lite cannot quantize this one yet."""
    awq_map = get_architecture(name).awq_map
    if awq_map is None:
        quantizable = sorted(n for n, a in ARCHITECTURES.items() if a.awq_map is not None)
        raise ValueError(f"lmkit lite awq does not quantize {name} yet (it has no AWQ table); it quantizes "
                         f"{', '.join(quantizable)}. The engine runs {name} in fp16/bf16/fp32.")
    return awq_map
