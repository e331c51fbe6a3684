"""Describing and importing model files: GGUF details and safetensors directories.

Used by pull (files from the hub) and create (FROM ./file.gguf, FROM ./dir).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest
from localrun.library.gguf_info import GGUFInfo, format_parameter_count, read_gguf_info
from localrun.library.paths import check_regular, user_path_errors
from localrun.library.pull import is_safetensors_model, kept_safetensors_file

from localrun.library.st_header import safetensors_header_params

MAX_DIR_ENTRIES = 10_000


def gguf_details(info: GGUFInfo) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture],
        "parameter_size": info.parameter_size,
        "quantization_level": info.file_type,
    }


def safetensors_description(files: dict[str, Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(details, model_info) for a safetensors model from config.json and the headers."""
    try:
        config = json.loads(files["config.json"].read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError
    except (KeyError, ValueError, UnicodeDecodeError, OSError):
        raise InvalidRequest("the safetensors model's config.json is missing or not a JSON object") from None
    params = 0
    dtypes: dict[str, int] = {}
    for fn, p in files.items():
        if fn.endswith(".safetensors"):
            n, d = safetensors_header_params(p, fn)
            params += n
            for k, v in d.items():
                dtypes[k] = dtypes.get(k, 0) + v
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    cfg = {**text_cfg, **{k: v for k, v in config.items() if k != "text_config"}}
    arch = str(cfg.get("model_type") or (cfg.get("architectures") or ["unknown"])[0])

    def num(*keys):
        for k in keys:
            v = cfg.get(k, text_cfg.get(k))
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    model_info = {
        "general.architecture": arch,
        "general.parameter_count": params,
        "general.architectures": cfg.get("architectures"),
        f"{arch}.context_length": num("max_position_embeddings", "n_positions"),
        f"{arch}.block_count": num("num_hidden_layers", "n_layer"),
        f"{arch}.embedding_length": num("hidden_size", "n_embd"),
        f"{arch}.attention.head_count": num("num_attention_heads", "n_head"),
        f"{arch}.attention.head_count_kv": num("num_key_value_heads", "num_attention_heads"),
        f"{arch}.feed_forward_length": num("intermediate_size"),
        f"{arch}.vocab_size": num("vocab_size"),
        f"{arch}.rope.freq_base": cfg.get("rope_theta"),
        # a mixture of experts (llama.cpp's key names): experts, those each token runs, one expert's size
        f"{arch}.expert_count": num("num_local_experts", "num_experts"),
        f"{arch}.expert_used_count": num("num_experts_per_tok"),
        f"{arch}.expert_feed_forward_length": num("moe_intermediate_size"),
        "general.torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
    }
    quant = (max(dtypes, key=dtypes.get) if dtypes else str(cfg.get("torch_dtype") or "unknown")).upper()
    details = {
        "parent_model": "",
        "format": "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": format_parameter_count(params),
        "quantization_level": quant,
    }
    return details, {k: v for k, v in model_info.items() if v is not None}


def safetensors_dir_files(d: Path, shown: str) -> dict[str, Path]:
    """The files localrun keeps from a local safetensors directory (validated)."""
    files: dict[str, Path] = {}
    entries = []
    with user_path_errors(shown):
        for p in d.iterdir():
            if len(entries) >= MAX_DIR_ENTRIES:  # e.g. FROM / or a home directory: bounded work
                raise InvalidRequest(f"{shown} holds more than {MAX_DIR_ENTRIES} entries: not a model directory")
            entries.append(p)
    for p in sorted(entries):
        n = p.name
        if kept_safetensors_file(n):
            check_regular(p, f"{shown}/{n}")
            files[n] = p
    if not is_safetensors_model(files):
        raise InvalidRequest(f"{shown} is not a safetensors model directory: it needs config.json and *.safetensors files")
    return files


def template_from_files(files: dict[str, Path]) -> str | None:
    """chat_template from chat_template.jinja, chat_template.json or tokenizer_config.json."""
    p = files.get("chat_template.jinja")
    if p is not None:
        return p.read_text(encoding="utf-8", errors="replace")
    for fn in ("chat_template.json", "tokenizer_config.json"):
        p = files.get(fn)
        if p is None:
            continue
        try:
            t = json.loads(p.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, OSError, AttributeError):
            continue
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        if isinstance(t, str):
            return t
    return None


__all__ = ["gguf_details", "safetensors_description", "safetensors_dir_files",
           "template_from_files", "read_gguf_info"]
