"""The tiny embedding model and reranker (no package ships a small one): random XLM-RoBERTa models laid out as
bge-m3 (CLS pooling) and bge-reranker-v2-m3 (a classifier head) are, written by tests/tools/tiny_xlmr.py and
converted by the converter in the llama-cpp-python sdist, cached under the pytest cache directory."""

from __future__ import annotations

from pathlib import Path

from vlm_model import convert, write_hf_model


def build_tiny_xlmr(cache: Path) -> tuple[Path, Path]:
    """(embedding model GGUF, reranker GGUF), built once into ``cache``."""
    out = cache / "tiny-xlmr"
    embed, rerank = out / "tiny-embed.gguf", out / "tiny-rerank.gguf"
    if embed.exists() and rerank.exists():
        return embed, rerank
    hf, vendor, env = write_hf_model("tiny_xlmr.py", out, cache)
    convert(vendor, env, hf / "embed", embed)
    convert(vendor, env, hf / "rerank", rerank)
    return embed, rerank
