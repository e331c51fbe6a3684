"""What a model can do, in Ollama's words (``capabilities`` on /api/show and /api/tags):

- ``completion``: it generates text (every model that is not an embedding model);
- ``embedding``: an embedding model (its GGUF sets a pooling type, or it is a BERT-family encoder);
- ``vision``: it has a vision projector, so it takes images;
- ``tools``: its chat template renders tool definitions;
- ``thinking``: its chat template has a ``<think>`` block (the daemon's reasoning split).

One function, so every place that lists capabilities (show, list, tags) says the same.
"""

from __future__ import annotations

from localrun.library.model import ResolvedModel

ENCODER_ARCHS = {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "t5encoder", "neo-bert", "modern-bert"}


def is_embedding_model(r: ResolvedModel) -> bool:
    if r.info is None:
        return False
    arch = r.info.architecture
    return f"{arch}.pooling_type" in r.info.metadata or arch in ENCODER_ARCHS


def capabilities(r: ResolvedModel) -> list[str]:
    from localrun.chat_template import template_supports_tools
    from localrun.server.output import THINK_OPEN

    caps = ["embedding"] if is_embedding_model(r) else ["completion"]
    if r.projector is not None:
        caps.append("vision")
    if r.template and template_supports_tools(r.template):
        caps.append("tools")
    if r.template and THINK_OPEN in r.template:
        caps.append("thinking")
    return caps


__all__ = ["capabilities", "is_embedding_model"]
