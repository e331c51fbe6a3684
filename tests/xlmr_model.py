"""The tiny embedding model and reranker (no package ships a small one): random XLM-RoBERTa models laid out as
bge-m3 (CLS pooling) and bge-reranker-v2-m3 (a classifier head) are, written by tests/tools/tiny_xlmr.py and
converted by the converter in the llama-cpp-python sdist, cached under the pytest cache directory."""

from __future__ import annotations

from pathlib import Path

from vlm_model import build_models


def build_tiny_xlmr(cache: Path) -> tuple[Path, Path]:
    """(embedding model GGUF, reranker GGUF), built once into ``cache``."""
    embed, rerank = build_models(cache, "tiny_xlmr.py", {"tiny-embed.gguf": ("embed",), "tiny-rerank.gguf": ("rerank",)})
    return embed, rerank
