"""lmkit: compress, run and serve large language models."""

from lmkit.config import EngineConfig
from lmkit.messages import GenerationConfig, GenerationConfigError, Response
from lmkit.engine import AsyncEngine
from lmkit.pipeline import Pipeline, pipeline

__all__ = ["pipeline", "Pipeline", "AsyncEngine", "EngineConfig", "GenerationConfig", "GenerationConfigError", "Response"]
__version__ = "0.1.0"
