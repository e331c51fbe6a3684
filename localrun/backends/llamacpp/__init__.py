"""The llama.cpp backend: a GGUF model in one batched llama.cpp context (llama-cpp-python's bindings).

``localrun.backends.select.backend_module("llamacpp")`` hands back this package, which exposes
``load(spec)`` and ``estimate_memory(spec)``; ``backend.LlamaCppBackend`` is a generating model's backend,
``pooled.PooledBackend`` an embedding model's or a reranker's. ``batch`` is the batched loop (with
``admission``, ``sampling`` and ``output``), ``memory`` the memory estimate and KV cache types.
"""

from localrun.backends.llamacpp.backend import LlamaCppBackend, load  # noqa: F401
from localrun.backends.llamacpp.memory import estimate_memory  # noqa: F401
