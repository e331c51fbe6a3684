"""What a model can do, in Ollama's words (``capabilities`` on /api/show and /api/tags):

- ``completion``: it generates text (every model that is not an embedding model);
- ``embedding``: an embedding model (its GGUF sets a pooling type, or it is a BERT-family encoder);
- ``vision``: it has a vision projector, so it takes images;
- ``tools``: its chat template renders tool definitions;
- ``thinking``: its chat template has a ``<think>`` block (the daemon's reasoning split).

One function, so every place that lists capabilities (show, list, tags) says the same.
"""

from __future__ import annotations

from localrun.library.gguf_info import GGUFInfo
from localrun.library.model import ResolvedModel

ENCODER_ARCHS = {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "t5encoder", "neo-bert", "modern-bert"}


def is_embedding_model(info: GGUFInfo | None) -> bool:
    if info is None:
        return False
    arch = info.architecture
    return f"{arch}.pooling_type" in info.metadata or arch in ENCODER_ARCHS


def capabilities_of(info: GGUFInfo | None, projector: object | None, template: str | None) -> list[str]:
    """From a model's parts: its GGUF header (None for safetensors), its projector (or None), its template."""
    from localrun.chat_template import template_supports_tools
    from localrun.server.output import THINK_OPEN

    caps = ["embedding"] if is_embedding_model(info) else ["completion"]
    if projector is not None:
        caps.append("vision")
    if template and template_supports_tools(template):
        caps.append("tools")
    if template and THINK_OPEN in template:
        caps.append("thinking")
    return caps


def capabilities(r: ResolvedModel) -> list[str]:
    return capabilities_of(r.info, r.projector, r.template)


__all__ = ["capabilities", "capabilities_of", "is_embedding_model"]
