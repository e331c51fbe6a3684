"""localrun's own inference engine: paged KV cache, radix prefix cache, continuous batching.

Importable with torch and numpy alone; gguf/safetensors/transformers are imported by the loaders
that need them.
"""

from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.engine import LLMEngine
from localrun.engine.requests import GenerationOutput, RequestStream, StreamDelta
from localrun.engine.sampler import SamplingParams

__all__ = ["LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "GenerationOutput",
           "RequestStream", "StreamDelta"]
