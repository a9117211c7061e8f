"""Per-architecture knowledge as data: one module per HF architecture (tensor names, config flags, AWQ map,
KV-calibration hooks), the registry of them, and the loader that turns an HF folder into what the C++ engine
needs (model config, weight sources, eos ids) and the model's generation defaults."""

from lmkit.models.architecture import Architecture, KvCalibHooks, ModelFields
from lmkit.models.awq_map import AwqMap, MoeLayout, SmoothGroup
from lmkit.models.registry import ARCHITECTURES, get_architecture, get_awq_map
from lmkit.models.loader import ModelSpec, load_model_spec, read_generation_defaults

__all__ = ["ARCHITECTURES", "Architecture", "AwqMap", "KvCalibHooks", "MoeLayout", "ModelFields", "ModelSpec", "SmoothGroup",
           "get_architecture", "get_awq_map", "load_model_spec", "read_generation_defaults"]
