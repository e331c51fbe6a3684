"""Model families, one file each, registered into models.registry.

llama: Llama / Qwen / Mistral / SmolLM2 / Phi-3; gemma: Gemma 2 / 3; moe_llama: Qwen3-MoE / Mixtral. loader reads GGUF /
safetensors checkpoints; shapes names test shapes."""

from localrun.engine.models import gemma, llama, moe_llama  # noqa: F401 - each registers its family
from localrun.engine.models.registry import build_model, model_class

__all__ = ["build_model", "model_class"]
