"""What a model can do, in Ollama's words (``/api/show``'s ``capabilities``), from its files alone
(nothing is loaded), one function so every place that lists them (``/api/show``, ``/api/tags``,
``localrun list``) says the same:

- ``completion``: it generates text (every model that is not an embedding model);
- ``embedding``: an embedding model (its GGUF sets a pooling type, or it is a BERT-family encoder);
  nothing else is listed for one;
- ``rerank``: a reranker (its GGUF has a classifier head, or sets rank pooling: bge-reranker-v2-m3,
  Qwen3-Reranker), which scores documents against a query (``/v1/rerank``); nothing else is listed for one;
- ``tools``: its chat template renders tool definitions, or (LOCALRUN_GENERIC_TOOLS on, the
  default) the generic tool format stands in for a template that cannot (:func:`tool_format`);
- ``insert``: fill in the middle (its vocabulary has prefix, suffix and middle tokens);
- ``vision``: it has a vision projector, so it takes images;
- ``thinking``: its chat template has a ``<think>`` block (the daemon's reasoning split).

And the ``model_info`` keys IDE clients read for every model."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

# llama.cpp finds a vocabulary's fill-in-the-middle tokens by these texts when the GGUF names no ids
# (llama-vocab.cpp); a model needs all three (prefix, suffix, middle)
FIM_TEXTS = (
    {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
     "<|prefix|>"},
    {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
     "<|suffix|>"},
    {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
     "<|middle|>"},
)
_FIM_ID_KEYS = (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
                ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
                ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"))
# encoder-only architectures: embeddings, no completion
EMBEDDING_ARCHS = {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert",
                   "t5encoder"}


POOLING_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
# each kind of model that generates nothing, in words, and where a client uses it (what its refusals say)
KIND_USE = {"completion": ("a text generation model", "a chat or completion API"),
            "embedding": ("an embedding model", "/api/embed or /v1/embeddings"),
            "rerank": ("a reranker", "POST /v1/rerank")}


def gguf_kind(info: Any) -> str:
    """What a model with this GGUF header (a GGUFInfo; None: unknown) does: "rerank" (a classifier head or rank
    pooling), "embedding" (a pooling type, or an encoder-only architecture) or "completion" (it generates)."""
    if info is None:
        return "completion"
    arch, meta = info.architecture, info.metadata
    if f"{arch}.classifier.output_labels" in meta or meta.get(f"{arch}.pooling_type") == POOLING_RANK:
        return "rerank"
    if arch in EMBEDDING_ARCHS or f"{arch}.pooling_type" in meta:
        return "embedding"
    return "completion"


def model_kind(r: Any) -> str:
    """gguf_kind of a resolved model (anything with its ``info``)."""
    return gguf_kind(getattr(r, "info", None))


def is_embedding_model(r: Any) -> bool:
    return model_kind(r) == "embedding"


def model_capabilities(r: Any) -> list[str]:
    """Ollama's capability list for a resolved model (localrun.library.model.ResolvedModel, or anything
    with its ``info``, ``template``, ``projector``, ``format`` and ``weights``)."""
    kind = model_kind(r)
    if kind != "completion":
        return [kind]
    caps = ["completion"]
    template = r.template or ""
    if tool_format(r) is not None:
        caps.append("tools")
    if r.format == "gguf" and has_fim_tokens(r):
        caps.append("insert")
    if getattr(r, "projector", None) is not None:
        caps.append("vision")
    if "<think>" in template:
        caps.append("thinking")
    return caps


def tool_format(r: Any) -> str | None:
    """How tools reach the model: "template" (its chat template renders them), "generic" (the tool
    definitions in the system prompt, the output constrained to JSON: server/generic_tools.py), or
    None (LOCALRUN_GENERIC_TOOLS off and a template without tools)."""
    from localrun.templates.chat import template_supports_tools
    from localrun.config import settings

    try:
        if r.template and template_supports_tools(r.template):
            return "template"
    except Exception:  # noqa: BLE001 - capabilities are informational
        pass
    return "generic" if settings().generic_tools else None


def has_fim_tokens(r: Any) -> bool:
    """The GGUF's vocabulary has prefix, suffix and middle FIM tokens (as llama.cpp finds them)."""
    meta = r.info.metadata if r.info is not None else {}
    if all(any(isinstance(meta.get(k), int) and meta.get(k) >= 0 for k in keys) for keys in _FIM_ID_KEYS):
        return True
    try:
        st = os.stat(r.weights)
    except OSError:
        return False
    return _scan_fim(str(r.weights), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=256)
def _scan_fim(path: str, size: int, mtime_ns: int) -> bool:
    from localrun.library.gguf_info import has_token_texts

    return has_token_texts(path, size, FIM_TEXTS)



def model_info(r: Any, info: dict[str, Any]) -> dict[str, Any]:
    """``model_info`` with the keys IDE clients read for every model: general.architecture,
    <arch>.context_length, general.basename (Copilot Chat names the model by it)."""
    out = dict(info)
    arch = out.get("general.architecture") or (r.info.architecture if r.info is not None else None) \
        or str((r.details or {}).get("family") or "unknown")
    out["general.architecture"] = arch
    ctx = out.get(f"{arch}.context_length")
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx <= 0:
        ctx = (r.info.context_length if r.info is not None else None) or _param_ctx(r)
        if ctx:
            out[f"{arch}.context_length"] = ctx
    if not isinstance(out.get("general.basename"), str) or not out.get("general.basename"):
        out["general.basename"] = out.get("general.name") if isinstance(out.get("general.name"), str) and \
            out.get("general.name") else r.name.split(":")[0].rsplit("/", 1)[-1]
    return dict(sorted(out.items()))


def _param_ctx(r: Any) -> int | None:
    v = (r.parameters or {}).get("num_ctx")
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


__all__ = ["EMBEDDING_ARCHS", "FIM_TEXTS", "KIND_USE", "POOLING_RANK", "gguf_kind", "has_fim_tokens", "is_embedding_model",
           "model_capabilities", "model_info", "model_kind", "tool_format"]
