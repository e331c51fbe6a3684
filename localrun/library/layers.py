"""A model's layers: built from files and uploaded blobs, and written as its config and manifest.

Pull and create both end here: the weights' layers they gathered (pinned against GC until the
manifest names them), plus the small layers (template, system, license, parameters, messages) and
the config, written as one manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest, LocalrunError
from localrun.library.blobs import MAX_SMALL_LAYER
from localrun.library.create import gguf_details, safetensors_description
from localrun.library.gguf_info import GGUFInfo, cached_gguf_info, read_gguf_info
from localrun.library.names import ModelName, validate_digest, validate_filename
from localrun.library.paths import shown as shown_path
from localrun.library.pull import Progress
from localrun.library.store import (CONFIG_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, MT_FILE, MT_LICENSE, MT_MESSAGES, MT_MODEL,
                                    MT_PARAMS, MT_SYSTEM, MT_TEMPLATE, Store)

MAX_FILES = 1000  # files in one create's `files` (a safetensors model has tens)
TEXT_LAYERS = {MT_TEMPLATE: "template", MT_SYSTEM: "system", MT_LICENSE: "license"}
MAX_MESSAGES = 1024  # a Modelfile's MESSAGE entries


def layer(media_type: str, digest: str, size: int, filename: str | None = None) -> dict:
    d = {"mediaType": media_type, "digest": digest, "size": size}
    if filename:
        d["filename"] = filename
    return d


def safe_name(name: str, default: str = "model.gguf") -> str:
    try:
        return validate_filename(name)
    except InvalidRequest:
        return default


def pin(store: Store, pins: list[str], digest: str) -> str:
    """Pin `digest` (GC leaves it alone) and note it in `pins`, which the caller unpins when done."""
    store.pin(digest)
    pins.append(digest)
    return digest


def gguf_layer(store: Store, digest: str, filename: str | None) -> dict:
    p = store.blob_path(digest)
    return layer(MT_MODEL, digest, p.stat().st_size, validate_filename(filename) if filename else None)


def copy_layer(store: Store, path: Path, info: GGUFInfo, shown: str, media_type: str, default_name: str, step: str,
               prog: Progress, pins: list[str]) -> dict:
    """A checked GGUF file (a projector, an adapter) copied into the store (the copy checked again) as a
    layer of `media_type`; `step` is its progress line."""
    prog.emit(step)
    digest, size = store.import_file(
        path, shown=shown, what=shown_path(path.name), progress=prog.counter(step, None, info.file_size),
        check=lambda p: read_gguf_info(p, display_name=shown))
    pin(store, pins, digest)
    return layer(media_type, digest, size, safe_name(path.name, default_name))


def check_files(store: Store, files: Any, field: str = "files") -> dict[str, tuple[str, Path]]:
        """Ollama's create `files` (or `adapters`) checked: {file name: (digest, blob path)}, each name a plain
        file name, each digest one the store holds (uploaded first); InvalidRequest saying what is wrong
        otherwise. The daemon calls it before it answers 200, and create again before it uses them."""
        if not isinstance(files, dict) or not files:
            raise InvalidRequest(f"'{field}' must be an object mapping file names to blob digests (sha256:...), "
                                 "each uploaded first with POST /api/blobs/<digest>")
        if len(files) > MAX_FILES:
            raise InvalidRequest(f"'{field}' names {len(files)} files: at most {MAX_FILES}")
        blobs: dict[str, tuple[str, Path]] = {}
        for fn, digest in files.items():
            fn = validate_filename(fn)
            if not isinstance(digest, str):
                raise InvalidRequest(f"'{field}': the digest of {fn} must be a string like 'sha256:<64 hex digits>'")
            d = validate_digest(digest)
            if not store.has_blob(d):
                raise InvalidRequest(f"'{field}': no blob {d} for {fn}: upload the file first "
                                     f"(POST /api/blobs/{d} with the file as the body)")
            blobs[fn] = (d, store.blob_path(d))
        return blobs


def read_config(store: Store, m: dict) -> dict:
    """The model's config (the manifest's config blob), {} when it has none or it cannot be read."""
    c = m.get("config")
    if not c:
        return {}
    try:
        return json.loads(store.read_small(c["digest"]))
    except (ValueError, LocalrunError):
        return {}


def describe_layers(store: Store, layers: list[dict]) -> tuple[dict, dict]:
    gguf = next((l for l in layers if l["mediaType"] == MT_MODEL), None)
    if gguf is not None:
        info = cached_gguf_info(store.blob_path(gguf["digest"]))
        return gguf_details(info), {}
    files = {l["filename"]: store.blob_path(l["digest"]) for l in layers if l["mediaType"] == MT_FILE}
    if not files:
        raise InvalidRequest("the model has no weights")
    return safetensors_description(files)


def write_model(store: Store, mn: ModelName, layers: list[dict], extra: dict, pins: list[str]) -> str:
    """The model `mn`: `layers` and the small layers and config `extra` says, written as its manifest."""
    layers = list(layers)
    # every small layer checked before any is written: one the reader would refuse (over MAX_SMALL_LAYER)
    # is a 400 here, never a stored model that cannot be read
    if len(extra.get("messages") or ()) > MAX_MESSAGES:
        raise InvalidRequest(f"{len(extra['messages'])} MESSAGE entries; at most {MAX_MESSAGES} (each chat renders "
                             "them all before its own turns)")
    small = [(mt, extra[key].encode("utf-8"), key.upper()) for key, mt in (
        ("template", MT_TEMPLATE), ("system", MT_SYSTEM), ("license", MT_LICENSE)) if extra.get(key)]
    if extra.get("parameters"):
        small.append((MT_PARAMS, json.dumps(extra["parameters"], sort_keys=True).encode(), "PARAMETER"))
    if extra.get("messages"):
        small.append((MT_MESSAGES, json.dumps(extra["messages"]).encode(), "MESSAGE"))
    for _, data, what in small:
        if len(data) > MAX_SMALL_LAYER:
            raise InvalidRequest(f"{what} is too long ({len(data)} bytes in all; at most "
                                 f"{MAX_SMALL_LAYER // (1024 * 1024)} MiB)")
    for mt, data, _ in small:
        d, s = store.put_bytes(data)
        pin(store, pins, d)
        layers.append(layer(mt, d, s))
    details, model_info = describe_layers(store, layers)
    if extra.get("parent_model"):
        details["parent_model"] = extra["parent_model"]
    config = {
        "model_format": details["format"],
        "model_family": details["family"],
        "model_families": details["families"],
        "model_type": details["parameter_size"],
        "file_type": details["quantization_level"],
        "details": details,
        "model_info": model_info if details["format"] == "safetensors" else {},
        "source": extra.get("source") or {},
    }
    cd, cs = store.put_bytes(json.dumps(config, sort_keys=True).encode())
    pin(store, pins, cd)
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                "config": layer(CONFIG_MEDIA_TYPE, cd, cs), "layers": layers}
    return store.write_manifest(mn, manifest)
