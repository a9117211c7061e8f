"""lmkit.lite: compression and evaluation. AWQ int4 weights (``quantize_awq``) in the AutoAWQ GEMM
format, and perplexity on held-out text (``evaluate_perplexity``) through a torch reference reader.

Names are imported on first use, so ``import lmkit.lite`` (and the ``lmkit`` CLI) does not import torch.
"""

from lmkit.lite.config import AwqConfig, PplConfig

__all__ = ["AwqConfig", "PplConfig", "AwqResult", "PplResult", "quantize_awq", "evaluate_perplexity",
           "load_causal_lm"]

_LAZY = {"AwqResult": "lmkit.lite.awq", "quantize_awq": "lmkit.lite.awq", "PplResult": "lmkit.lite.ppl",
         "evaluate_perplexity": "lmkit.lite.ppl", "load_causal_lm": "lmkit.lite.checkpoint"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmkit.lite' has no attribute {name!r}")
