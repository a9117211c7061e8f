"""Per-architecture knowledge as data: the registry of supported architectures and the loader that
turns an HF folder into what the C++ engine needs (model config, weight sources, eos ids) and the model's
generation defaults."""

from lmkit.models.registry import ARCHITECTURES, Architecture, get_architecture
from lmkit.models.loader import ModelSpec, load_model_spec, read_generation_defaults

__all__ = ["ARCHITECTURES", "Architecture", "get_architecture", "ModelSpec", "load_model_spec",
           "read_generation_defaults"]
