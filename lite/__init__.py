"""lmkit.lite: compression and evaluation. AWQ int4 weights (``quantize_awq``) in the AutoAWQ GEMM or
compressed-tensors format, SmoothQuant W8A8 int8 (``quantize_smooth_quant``, compressed-tensors), FP8 E4M3
weights (``quantize_fp8``) and NVFP4 / MXFP4 ones (``quantize_fp4``), compressed-tensors, a calibrated per-layer
int8/int4 KV cache policy (``calibrate_kv`` -> kv_policy.json), and perplexity on held-out text (``evaluate_perplexity``) through a torch reference reader.

Names are imported on first use, so ``import lmkit.lite`` (and the ``lmkit`` CLI) does not import torch.
"""

from lmkit.lite.config import AwqConfig, Fp4Config, Fp8Config, KvCalibConfig, PplConfig, SmoothQuantConfig

__all__ = ["AwqConfig", "Fp4Config", "Fp8Config", "KvCalibConfig", "PplConfig", "SmoothQuantConfig", "AwqResult",
           "SmoothQuantResult", "quantize_smooth_quant", "Fp8Result", "quantize_fp8", "Fp4Result", "quantize_fp4",
           "KvCalibResult", "PplResult", "quantize_awq", "calibrate_kv", "fake_quant_kv", "evaluate_perplexity", "load_causal_lm"]

_LAZY = {"SmoothQuantResult": "lmkit.lite.smoothquant", "quantize_smooth_quant": "lmkit.lite.smoothquant",
         "AwqResult": "lmkit.lite.awq", "quantize_awq": "lmkit.lite.awq", "PplResult": "lmkit.lite.ppl",
         "evaluate_perplexity": "lmkit.lite.ppl", "load_causal_lm": "lmkit.lite.checkpoint",
         "KvCalibResult": "lmkit.lite.kvcalib", "calibrate_kv": "lmkit.lite.kvcalib",
         "fake_quant_kv": "lmkit.lite.kvquant", "Fp8Result": "lmkit.lite.fp8", "quantize_fp8": "lmkit.lite.fp8",
         "Fp4Result": "lmkit.lite.fp4", "quantize_fp4": "lmkit.lite.fp4"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmkit.lite' has no attribute {name!r}")
