"""lmkit: compress, run and serve large language models."""

from lmkit.config import EngineConfig
from lmkit.messages import GenerationConfig, GenerationConfigError, Response
from lmkit.engine import AsyncEngine
from lmkit.pipeline import Pipeline, pipeline
from lmkit.structured import StructuredOutput, StructuredOutputError

__all__ = ["pipeline", "Pipeline", "AsyncEngine", "EngineConfig", "GenerationConfig", "GenerationConfigError", "Response",
           "StructuredOutput", "StructuredOutputError"]
__version__ = "0.1.0"
