"""Which model architectures the native engine runs (no imports: the daemon reads this on
machines without torch, to route other GGUFs to llama.cpp before anything is loaded).

Names are Hugging Face ``model_type`` values, which are also llama.cpp's GGUF
``general.architecture`` names for these families (gemma3_text: the HF name only; llama.cpp writes
qwen3moe and gpt-oss for qwen3_moe and gpt_oss).
"""

from __future__ import annotations

NATIVE_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma3_text",
                "qwen3_moe", "qwen3moe", "mixtral", "gpt_oss", "gpt-oss")
# qwen3moe / gpt-oss: llama.cpp's names of Qwen3-MoE / gpt-oss (a Mixtral GGUF is llama)

# Families close to one we run that the engine still refuses, with the reason users see.
_NOT_YET = {
    "qwen2_moe": "Qwen2-MoE (mixture-of-experts layers) is not supported by the native engine",
    "phimoe": "Phi-3.5-MoE (mixture-of-experts layers) is not supported by the native engine",
    "phi3small": "Phi-3-small (blocksparse attention, GEGLU) is not supported by the native engine",
}


def is_native(arch: str | None) -> bool:
    return str(arch or "").lower() in NATIVE_ARCHS


def unsupported_message(arch: str | None, what: str = "model_type") -> str:
    """The error for an architecture the native engine does not run: it names the architecture
    and says what to do instead."""
    name = str(arch or "unknown")
    why = _NOT_YET.get(name.lower(), f"{what} {name!r} is not supported by the native engine")
    return (f"{why} (it runs {', '.join(NATIVE_ARCHS)}); use the llama.cpp backend for it "
            "(LOCALRUN_BACKEND=llamacpp with a GGUF of the model)")
