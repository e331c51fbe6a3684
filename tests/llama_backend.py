"""The bundled SmolLM2 in localrun's llama.cpp backend, in this process (no daemon): what the in-process
tests of the batched loop open, each with its own window and number of sequences."""

from __future__ import annotations

from pathlib import Path


def smollm2_backend(gguf: Path, num_ctx: int = 1024, parallel: int = 4, **extra):
    """A LlamaCppBackend on `gguf` with two threads (the caller closes it: asyncio.run(b.close()))."""
    from localrun.backends.base import LoadSpec
    from localrun.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(LoadSpec("smollm2:135m", gguf, "gguf", num_ctx=num_ctx, num_parallel=parallel,
                                    extra={"n_threads": 2, **extra}))
