"""What a model can do, in Ollama's words (``capabilities`` on /api/show and /api/tags, list's
CAPABILITIES column), from its files alone (nothing is loaded):

- ``completion``: it generates text (every model that is not an embedding model);
- ``embedding``: an embedding model (its GGUF sets a pooling type, or it is a BERT-family encoder);
  nothing else is listed for one;
- ``tools``: its chat template renders tool definitions;
- ``vision``: it has a vision projector, so it takes images;
- ``thinking``: its chat template has a ``<think>`` block (the daemon's reasoning split).

One function, so every place that lists capabilities says the same.
"""

from __future__ import annotations

from typing import Any

# encoder-only architectures: embeddings, no completion
EMBEDDING_ARCHS = {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert",
                   "t5encoder"}


def is_embedding_model(r: Any) -> bool:
    if r.info is None:
        return False
    arch = r.info.architecture
    return arch in EMBEDDING_ARCHS or f"{arch}.pooling_type" in r.info.metadata


def model_capabilities(r: Any) -> list[str]:
    """Ollama's capability list for a resolved model (localrun.library.model.ResolvedModel, or anything
    with its ``info``, ``template`` and ``projector``)."""
    from localrun.chat_template import template_supports_tools

    if is_embedding_model(r):
        return ["embedding"]
    caps = ["completion"]
    template = r.template or ""
    try:
        if template and template_supports_tools(template):
            caps.append("tools")
    except Exception:  # noqa: BLE001 - capabilities are informational
        pass
    if getattr(r, "projector", None) is not None:
        caps.append("vision")
    if "<think>" in template:
        caps.append("thinking")
    return caps


__all__ = ["EMBEDDING_ARCHS", "is_embedding_model", "model_capabilities"]
