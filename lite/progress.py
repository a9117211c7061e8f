"""What the layer-by-layer quantizers (``quantize_awq``, ``quantize_smooth_quant``) tell their caller as they go
(the CLI renders it with rich), and the perplexity entry of their report.json."""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    """Progress callbacks of a layer-by-layer quantizer."""

    def phase(self, description: str) -> None: ...

    def start_layers(self, num_layers: int) -> None: ...

    def layer_done(self, index: int, report: dict) -> None: ...


class SilentReporter:
    """A Reporter that says nothing (the default of the Python API)."""

    def phase(self, description: str) -> None:
        pass

    def start_layers(self, num_layers: int) -> None:
        pass

    def layer_done(self, index: int, report: dict) -> None:
        pass


def ppl_dict(result) -> dict | None:
    """report.json's entry of a PplResult (None: not measured)."""
    if result is None:
        return None
    return {"dataset": result.dataset, "ppl": result.ppl, "num_tokens": result.num_tokens}
