"""What a model can do, in Ollama's words (``/api/show``'s ``capabilities``), from its files alone
(nothing is loaded): ``completion``, ``tools``, ``insert`` (fill in the middle), ``thinking``,
``embedding``; and the ``model_info`` keys IDE clients read for every model."""

from __future__ import annotations

import mmap
import os
import struct
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


def model_capabilities(r: Any) -> list[str]:
    """Ollama's capability list for a resolved model (localrun.library.model.ResolvedModel)."""
    from localrun.chat_template import template_supports_tools

    arch = r.info.architecture if r.info is not None else ""
    if arch in EMBEDDING_ARCHS:
        return ["embedding"]
    caps = ["completion"]
    template = r.template or ""
    try:
        if template and template_supports_tools(template):
            caps.append("tools")
    except Exception:  # noqa: BLE001 - capabilities are informational
        pass
    if r.format == "gguf" and has_fim_tokens(r):
        caps.append("insert")
    if "<think>" in template:
        caps.append("thinking")
    return caps


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
    """Walk the GGUF header to tokenizer.ggml.tokens and look for the FIM texts (bounded: the header
    walker's limits; one comparison per token whose length matches one of the texts)."""
    from localrun.library.gguf_info import GGUF_MAGIC, MAX_KEY_LEN, _Bad, _read_value, _value_types, _Walker

    wanted = [{t.encode() for t in group} for group in FIM_TEXTS]
    lengths = {len(t) for group in wanted for t in group}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            w = _Walker(buf, size)
            if bytes(buf[0:4]) != GGUF_MAGIC:
                return False
            w.pos = 4
            w.u32("version")
            w.u64("tensor count")
            n_kv = w.u64("metadata count")
            T, _, _ = _value_types()
            for i in range(min(n_kv, 1 << 16)):
                key = w.string(f"metadata key #{i}", limit=MAX_KEY_LEN)
                vtype = w.u32("type")
                if key != "tokenizer.ggml.tokens":
                    _read_value(w, vtype, key, 0, keep=False)
                    continue
                if vtype != int(T.ARRAY) or w.u32("array type") != int(T.STRING):
                    return False
                count = w.u64("array length")
                found = [False, False, False]
                pos, end, unpack = w.pos, size, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    if pos + 8 > end:
                        return False
                    n = unpack(buf, pos)[0]
                    pos += 8
                    if n in lengths:
                        text = buf[pos:pos + n]
                        for g, group in enumerate(wanted):
                            if text in group:
                                found[g] = True
                    pos += n
                return all(found)
    except (OSError, ValueError, _Bad, struct.error):
        return False
    return False


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


__all__ = ["model_capabilities", "has_fim_tokens", "model_info", "FIM_TEXTS"]
