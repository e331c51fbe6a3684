"""LoRA adapters in a create: checked against the model and stored as one of its layers.

An adapter comes as the Modelfile's ADAPTER (a LoRA GGUF file, or a PEFT directory converted to a
LoRA GGUF first by adapters.py) or as Ollama's uploaded `adapters`. Every check happens before
anything is copied into the store: what is no LoRA adapter, or does not fit the model, is a 400.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest
from localrun.library import adapters as _adapters
from localrun.library.gguf_info import GGUFInfo, cached_gguf_info, read_gguf_info
from localrun.library.layers import check_files, copy_layer, layer, pin, safe_name
from localrun.library.modelfile import local_source
from localrun.library.paths import check_regular, shown as shown_path, user_path_errors
from localrun.library.pull import Progress
from localrun.library.store import MT_ADAPTER, MT_MODEL, Store


def adapter_base(store: Store, layers: list[dict]) -> GGUFInfo:
    """The GGUF header of the model an adapter goes on (adapters go on GGUF models only: llama.cpp applies
    them, the native engine merges them as it reads the GGUF)."""
    model = [l for l in layers if l["mediaType"] == MT_MODEL]
    if not model:
        raise InvalidRequest("a LoRA adapter needs a GGUF model (llama.cpp applies it; the native engine merges "
                             "it as it reads a GGUF), and this model is safetensors. Import a GGUF of the model, "
                             "or merge the adapter into the safetensors weights (PEFT's merge_and_unload) first")
    return cached_gguf_info(store.blob_path(model[0]["digest"]))


def check_lora(info: GGUFInfo, shown: str) -> None:
    """A LoRA adapter GGUF, not a model or another kind of adapter."""
    kind = info.adapter_type
    if kind is None:
        raise InvalidRequest(f"{shown} is not a LoRA adapter but a model (a GGUF of architecture "
                             f"{info.architecture!r}). ADAPTER takes a LoRA adapter in GGUF: llama.cpp's "
                             "convert_lora_to_gguf.py makes one from a PEFT adapter directory")
    if kind != "lora":
        raise InvalidRequest(f"{shown} is a {kind!r} adapter: only LoRA adapters are applied")


def check_adapter(info: GGUFInfo, shown: str, model: GGUFInfo) -> None:
    """An adapter GGUF that fits `model`: a LoRA adapter of the model's architecture and shapes."""
    check_lora(info, shown)
    if info.architecture != model.architecture:
        raise InvalidRequest(f"{shown} is a LoRA adapter for {info.architecture!r} models, but the model is "
                             f"{model.architecture!r}: FROM must name the model the adapter was trained on")
    # each pair (X.lora_a [in, r], X.lora_b [r, out], ggml's order) must fit the model's X [in, out], as
    # llama.cpp checks when it loads the adapter: a misfit found here is a 400, not a failed load later
    pairs = [n[:-len(".lora_a")] for n in info.tensor_dims if n.endswith(".lora_a")]
    if not pairs:
        raise InvalidRequest(f"{shown} holds no LoRA tensors (no .lora_a / .lora_b pairs)")
    for name in pairs:
        a, b, w = info.tensor_dims[name + ".lora_a"], info.tensor_dims.get(name + ".lora_b"), model.tensor_dims.get(name)
        if w is None:
            raise InvalidRequest(f"{shown} adapts {name}, which the model does not have: FROM must name the model "
                                 "the adapter was trained on")
        if b is None or len(a) != 2 or len(b) != 2 or len(w) < 2 or a[1] != b[0] or a[0] != w[0] or b[1] != w[1]:
            fits = "x".join(str(d) for d in (a[0], b[1] if b and len(b) > 1 else "?"))
            raise InvalidRequest(f"{shown} does not fit the model: its {name} update is {fits}, the model's "
                                 f"{name} is {'x'.join(str(d) for d in w)}; FROM must name the model the "
                                 "adapter was trained on")


def adapter_file(store: Store, text: str, base: Path, from_: str | None) -> tuple[Path, GGUFInfo | None, str]:
    """ADAPTER <path>: (the file, its GGUF header, the words errors name it by) for a LoRA adapter GGUF, or
    (the directory, None, ...) for a PEFT adapter directory (converted once the model is known). What is no
    LoRA adapter, or does not fit a FROM file, is refused here: before anything is copied in."""
    if "\x00" in text:
        raise InvalidRequest("ADAPTER contains a NUL byte")
    shown = f"ADAPTER {shown_path(text)}"
    path = Path(os.path.expanduser(text))
    path = path if path.is_absolute() else base / path
    with user_path_errors(shown):
        is_dir = path.is_dir()
        if is_dir and not _adapters.is_peft_dir(path):
            raise InvalidRequest(f"{shown}: a directory without {_adapters.CONFIG}; ADAPTER takes a LoRA "
                                 f"adapter in GGUF, or a PEFT adapter directory ({_adapters.CONFIG} and "
                                 f"{_adapters.WEIGHTS})")
    if is_dir:
        _adapters.read_config(path / _adapters.CONFIG, shown)  # refused before anything is copied
        check_regular(path / _adapters.WEIGHTS, f"{shown}: {_adapters.WEIGHTS}")
        return path, None, shown
    info = read_gguf_info(path, display_name=shown)
    check_lora(info, shown)
    src = local_source(from_, base) if from_ else None
    if src is not None:
        with user_path_errors(f"FROM {shown_path(from_)}"):
            is_file, is_dir = src.is_file(), src.is_dir()
        if is_dir:
            adapter_base(store, [])  # (a safetensors model: its refusal)
        if is_file:
            check_adapter(info, shown, read_gguf_info(src, display_name=f"FROM {shown_path(from_)}"))
    return path, info, shown


def import_adapter(store: Store, path: Path, info: GGUFInfo | None, shown: str, prog: Progress, pins: list[str],
                   model: GGUFInfo) -> dict:
    """The adapter layer for ADAPTER <path>: the LoRA adapter (a PEFT directory converted to GGUF first),
    checked against the model and copied into the store."""
    if info is None:
        return converted_adapter(store, path / _adapters.CONFIG, path / _adapters.WEIGHTS,
                                 safe_name(path.name + ".gguf", "adapter.gguf"), shown, prog, pins, model)
    check_adapter(info, shown, model)
    return copy_layer(store, path, info, shown, MT_ADAPTER, "adapter.gguf", "copying adapter", prog, pins)


def converted_adapter(store: Store, config: Path, weights: Path, name: str, shown: str, prog: Progress,
                      pins: list[str], model: GGUFInfo) -> dict:
    """The adapter layer for a PEFT adapter (its config and weights files): converted to a LoRA GGUF `name`."""
    with tempfile.TemporaryDirectory(prefix="localrun-adapter-") as tmp:
        prog.emit("converting adapter")
        out = Path(tmp) / name
        _adapters.convert(config, weights, model, out, shown)
        return import_adapter(store, out, read_gguf_info(out, display_name=shown), shown, prog, pins, model)


def adapter_from_blobs(store: Store, adapters: Any, prog: Progress, pins: list[str], model: GGUFInfo) -> dict:
    """The adapter layer for Ollama's `adapters`: one uploaded LoRA adapter GGUF, or a PEFT adapter's two files
    (converted to GGUF), by file name."""
    peft = {_adapters.CONFIG, _adapters.WEIGHTS}
    if not isinstance(adapters, dict) or not (len(adapters) == 1 or set(adapters) == peft):
        raise InvalidRequest("'adapters' must map one LoRA adapter GGUF's file name, or a PEFT adapter's "
                             f"{_adapters.CONFIG} and {_adapters.WEIGHTS}, to their blob digests (sha256:...), "
                             "each uploaded first with POST /api/blobs/<digest>")
    blobs = check_files(store, adapters, "adapters")
    for digest, _ in blobs.values():
        pin(store, pins, digest)
    if set(blobs) == peft:
        return converted_adapter(store, blobs[_adapters.CONFIG][1], blobs[_adapters.WEIGHTS][1], "adapter.gguf",
                                 "'adapters'", prog, pins, model)
    (fn, (digest, path)), = blobs.items()
    shown = f"'adapters': {fn}"
    check_adapter(read_gguf_info(path, display_name=shown), shown, model)
    prog.emit(f"using adapter {digest[:19]}")
    return layer(MT_ADAPTER, digest, path.stat().st_size, fn)
