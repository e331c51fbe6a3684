"""The tiny embedding model and reranker (no package ships a small one): random XLM-RoBERTa models laid out as
bge-m3 (CLS pooling) and bge-reranker-v2-m3 (a classifier head) are, written by tests/tools/tiny_xlmr.py and
converted by the converter in the llama-cpp-python sdist, cached under the pytest cache directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vlm_model import write_hf_model


def build_tiny_xlmr(cache: Path) -> tuple[Path, Path]:
    """(embedding model GGUF, reranker GGUF), built once into ``cache``."""
    out = cache / "tiny-xlmr"
    embed, rerank = out / "tiny-embed.gguf", out / "tiny-rerank.gguf"
    if embed.exists() and rerank.exists():
        return embed, rerank
    hf, vendor, env = write_hf_model("tiny_xlmr.py", out, cache)
    for name, dst in (("embed", embed), ("rerank", rerank)):
        tmp = dst.with_suffix(".part")
        r = subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(hf / name), "--outfile", str(tmp)],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        tmp.rename(dst)
    return embed, rerank
