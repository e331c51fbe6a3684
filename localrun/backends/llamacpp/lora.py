"""LoRA adapters on a llama.cpp context: a Modelfile's ADAPTER, loaded with the model.

The batched context (``backend``) and the pooling context (``pooled``) both apply one this way.
"""

from __future__ import annotations

import ctypes

from localrun.errors import BackendError


def load_lora(lib, model, ctx, path: str, name: str):
    """A LoRA adapter (a GGUF) loaded for ``model`` and set on ``ctx`` at scale 1, as Ollama applies a Modelfile's
    ADAPTER; llama.cpp frees it with the model. An adapter whose tensors do not fit the model is a BackendError
    (llama.cpp returns no adapter; llama-cpp-python's Llama(lora_path=...) went on with the null pointer and
    crashed the process)."""
    adapter = lib.llama_adapter_lora_init(model, path.encode("utf-8"))
    if not adapter:
        raise BackendError(f"llama.cpp could not load the LoRA adapter of {name} ({path}; see the runner's log): "
                           "was it trained on this model? Its tensors must fit the model's")
    if lib.llama_set_adapters_lora(ctx, (lib.llama_adapter_lora_p_ctypes * 1)(adapter), 1,
                                   (ctypes.c_float * 1)(1.0)) != 0:
        raise BackendError(f"llama.cpp could not apply the LoRA adapter of {name} ({path})")
    return adapter
