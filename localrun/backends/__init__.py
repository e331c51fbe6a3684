"""Backends behind one small protocol (``localrun.backends.base``).

``localrun.backends.select`` picks one (``choose``) and hands back its module
(``backend_module``), which exposes ``load(spec)`` and ``estimate_memory(spec)``.
Backend modules import their heavy dependencies lazily.
"""

from localrun.backends.base import (  # noqa: F401
    Backend,
    BackendInfo,
    Chunk,
    GenerationRequest,
    LoadSpec,
    MemoryEstimate,
    SamplingOptions,
    TokenLogprob,
    Usage,
)
