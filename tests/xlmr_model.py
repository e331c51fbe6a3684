"""The tiny embedding model and reranker (no package ships a small one): random XLM-RoBERTa models laid out as
bge-m3 (CLS pooling) and bge-reranker-v2-m3 (a classifier head) are, written by tests/tools/tiny_xlmr.py and
converted by the converter in the llama-cpp-python sdist, cached under the pytest cache directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vlm_model import _sdist, build_models

# a rerank template (as Qwen3-Reranker's GGUF carries one): the pair is laid out by it instead of
# [BOS] query [EOS] [SEP] document [EOS]
RERANK_TEMPLATE = "<s>{query}</s> what : {document}</s>"

_ADD_TEMPLATE = """
import sys, gguf
from gguf_new_metadata import MetadataDetails, copy_with_new_metadata
src, dst, template = sys.argv[1:]
reader = gguf.GGUFReader(src, "r")
writer = gguf.GGUFWriter(dst, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(), endianess=reader.endianess)
copy_with_new_metadata(reader, writer, {"tokenizer.chat_template.rerank": MetadataDetails(gguf.GGUFValueType.STRING, template)}, [])
"""


def build_tiny_xlmr(cache: Path) -> tuple[Path, Path, Path]:
    """(embedding model GGUF, reranker GGUF, the reranker with RERANK_TEMPLATE), built once into ``cache``."""
    embed, rerank = build_models(cache, "tiny_xlmr.py", {"tiny-embed.gguf": ("embed",), "tiny-rerank.gguf": ("rerank",)})
    templated = rerank.with_name("tiny-rerank-templated.gguf")
    if not templated.exists():  # the reranker's GGUF again, with the template added by gguf-py's own copier
        gguf_py = _sdist(cache) / "vendor" / "llama.cpp" / "gguf-py"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(gguf_py), str(gguf_py / "gguf" / "scripts")])}
        tmp = templated.with_name(templated.name + ".part")
        r = subprocess.run([sys.executable, "-c", _ADD_TEMPLATE, str(rerank), str(tmp), RERANK_TEMPLATE],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        tmp.rename(templated)
    return embed, rerank, templated
