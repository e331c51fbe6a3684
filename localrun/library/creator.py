"""Creating a model from a Modelfile or uploaded files.

Its weights come FROM a stored model, a GGUF file or a safetensors directory, or as uploaded
`files`. A create may quantize the GGUF (llama.cpp, a child process), add a vision projector (a
second FROM) and a LoRA adapter (adapter_layers.py); every file is checked before it is copied into
the store, and the manifest is written last.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest, LocalrunError, NotFound
from localrun.library import adapter_layers
from localrun.library import catalog as _catalog
from localrun.library import quantize as _quantize
from localrun.library.create import safetensors_description, safetensors_dir_files
from localrun.library.disk_errors import storage_errors
from localrun.library.gguf_info import GGUFInfo, read_gguf_info
from localrun.library.layers import TEXT_LAYERS, check_files, copy_layer, gguf_layer, layer, pin, read_config, safe_name, \
    write_model
from localrun.library.model import ProgressFn, ResolvedModel
from localrun.library.modelfile import Modelfile, local_source, parse_modelfile
from localrun.library.names import parse_name, validate_filename
from localrun.library.paths import shown as shown_path, user_path_errors
from localrun.library.puller import Puller
from localrun.library.pull import Progress, is_safetensors_model, kept_safetensors_file
from localrun.library.resolver import Resolver
from localrun.library.st_header import safetensors_header_params
from localrun.library.store import MT_ADAPTER, MT_FILE, MT_MESSAGES, MT_MODEL, MT_PARAMS, MT_PROJECTOR, Store


def _not_gguf(target: str) -> InvalidRequest:
    return InvalidRequest(f"quantizing to {target} needs a GGUF model; this one is safetensors files: convert it to a "
                          "GGUF in F16 first (llama.cpp's convert_hf_to_gguf.py), then create from that")


class Creator:
    """Creates models in `store`; `resolver` finds the stored ones a FROM names, `puller` pulls one not yet stored."""

    def __init__(self, store: Store, resolver: Resolver, puller: Puller):
        self.store, self.resolver, self.puller = store, resolver, puller

    def create(self, name: str, modelfile: str | Modelfile, base_dir: Path | None = None,
               progress: ProgressFn = None, cancel: threading.Event | None = None,
               files: dict[str, str] | None = None, adapters: dict[str, str] | None = None,
               quantize: str | None = None) -> ResolvedModel:
        """A model from a Modelfile: its FROM (a model, a GGUF file, a safetensors directory), or
        `files`: {file name: digest} of blobs already in the store (Ollama's /api/create after
        POST /api/blobs), the Modelfile then giving the rest (template, system, parameters, ...).
        A LoRA adapter (a GGUF, or a PEFT directory converted to one) comes as the Modelfile's ADAPTER or as
        `adapters` (uploaded as `files` are); it replaces the base model's. `quantize` (Ollama's: 'q4_K_M', ...)
        stores the GGUF model quantized to that type by llama.cpp (it must be F16, BF16 or F32)."""
        mn = parse_name(name)
        if mn.is_hf:
            raise InvalidRequest("cannot create a model named hf.co/...: that namespace belongs to the Hugging Face hub")
        mf = modelfile if isinstance(modelfile, Modelfile) else parse_modelfile(modelfile, require_from=files is None)
        if files is not None and mf.from_ is not None:
            raise InvalidRequest("give the model as FROM or as 'files', not both")
        if adapters is not None and mf.adapter is not None:
            raise InvalidRequest("give the adapter as ADAPTER or as 'adapters', not both")
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        target = _quantize.quant_type(quantize) if quantize is not None else None
        adapter_file = (adapter_layers.adapter_file(self.store, mf.adapter, base, mf.from_) if mf.adapter is not None
                        else None)
        prog = Progress(progress, cancel)
        prog.emit("parsing modelfile")
        self.store.ensure()
        pins: list[str] = []
        try:
            if files is not None:
                layers, extra = self._create_from_files(files, prog, pins)
                if target is not None:
                    layers = self._quantize_layers(layers, target, prog, pins)
            else:
                layers, extra = self._create_from(mf, base, prog, pins, target)
            if mf.projector is not None:  # the second FROM replaces any projector the base model had
                layers = [l for l in layers if l["mediaType"] != MT_PROJECTOR]
                layers.append(self._import_projector(mf.projector, base, prog, pins))
            if mf.adapter is not None or adapters is not None:  # it replaces any adapter the base model had
                model = adapter_layers.adapter_base(self.store, layers)
                layers = [l for l in layers if l["mediaType"] != MT_ADAPTER]
                layers.append(adapter_layers.import_adapter(self.store, *adapter_file, prog, pins, model)
                              if adapter_file is not None
                              else adapter_layers.adapter_from_blobs(self.store, adapters, prog, pins, model))
            params = dict(extra.get("parameters") or {})
            params.update(mf.parameters)
            extra["parameters"] = params
            for key in ("template", "system", "license"):
                if getattr(mf, key) is not None:
                    extra[key] = getattr(mf, key)
            if mf.messages:
                extra["messages"] = mf.messages
            prog.check()
            prog.emit("writing manifest")
            write_model(self.store, mn, layers, extra, pins)
            if files is not None:
                self.store.claimed(files.values())
            prog.emit("success", check=False)
        finally:
            for d in pins:
                self.store.unpin(d)
        return self.resolver.resolve(mn.display)

    def _create_from(self, mf: Modelfile, base: Path, prog: Progress, pins: list[str], target: str | None = None):
        src = mf.from_ or ""
        path = local_source(src, base)
        if path is not None:
            return self._import(path, f"FROM {shown_path(src)}", prog, pins, target)
        base_name = parse_name(src)
        if not self.resolver.exists(base_name.display):
            if _catalog.lookup(base_name) is None and not base_name.is_hf:
                raise NotFound(f"FROM {src}: model '{base_name.display}' not found; pull it first or give a path like ./model.gguf")
            self.puller.pull(base_name.display, progress=prog.callback, cancel=prog.cancel)
        self.resolver.resolve(base_name.display)  # a damaged base model is a ModelDamaged naming it, before anything is written
        m, mdigest, _ = self.store.read_manifest(self.resolver.find(base_name))
        extra: dict[str, Any] = {"parent_model": self.resolver.find(base_name).display}
        layers = []
        for l in m["layers"]:
            mt = l["mediaType"]
            if mt in (MT_MODEL, MT_FILE, MT_ADAPTER, MT_PROJECTOR):
                pin(self.store, pins, l["digest"])
                layers.append(l)
            elif mt in TEXT_LAYERS:
                extra[TEXT_LAYERS[mt]] = self.store.read_small(l["digest"]).decode("utf-8")
            elif mt == MT_PARAMS:
                extra["parameters"] = json.loads(self.store.read_small(l["digest"]))
            elif mt == MT_MESSAGES:
                extra["messages"] = json.loads(self.store.read_small(l["digest"]))
        cfg = read_config(self.store, m)
        extra["source"] = cfg.get("source") or {}
        return (self._quantize_layers(layers, target, prog, pins) if target is not None else layers), extra

    def _create_from_files(self, files: Any, prog: Progress, pins: list[str]):
        """Layers for Ollama's `files`: uploaded blobs by file name. GGUF files: one model, plus a
        vision projector (a GGUF whose architecture is clip); or a safetensors model's files."""
        blobs = check_files(self.store, files)
        for d, _ in blobs.values():
            pin(self.store, pins, d)  # from here until the manifest names it, GC leaves it alone
        ggufs = [fn for fn in blobs if fn.lower().endswith(".gguf")]
        prog.emit("parsing files")
        if not ggufs:
            keep = {fn: p for fn, (_, p) in blobs.items() if kept_safetensors_file(fn)}
            if not is_safetensors_model(keep):
                raise InvalidRequest("'files' holds no model: give a .gguf file, or a safetensors model's config.json "
                                     "and *.safetensors files")
            safetensors_description(keep)  # every header checked, config.json read
            layers = [layer(MT_FILE, blobs[fn][0], p.stat().st_size, fn) for fn, p in keep.items()]
            return layers, {"source": {"import": "files"}}
        others = sorted(set(blobs) - set(ggufs))
        if others:
            raise InvalidRequest(f"'files' mixes GGUF files with others ({', '.join(others[:5])}): "
                                 "a GGUF model is its .gguf file (and a vision projector .gguf)")
        model, projector = [], []
        for fn in ggufs:
            info = read_gguf_info(blobs[fn][1], display_name=fn)
            if info.adapter_type is not None:
                raise InvalidRequest(f"'files': {fn} is a {info.adapter_type} adapter, not a model: send it in "
                                     "'adapters' beside the model's files")
            (projector if info.architecture == "clip" else model).append(fn)
        if len(model) != 1 or len(projector) > 1:
            raise InvalidRequest(f"'files' must hold one GGUF model (and at most one vision projector), not "
                                 f"{len(model)} models ({', '.join(model) or 'none'}) and {len(projector)} projectors")
        layers = [gguf_layer(self.store, blobs[model[0]][0], model[0])]
        if projector:
            d, p = blobs[projector[0]]
            layers.append(layer(MT_PROJECTOR, d, p.stat().st_size, projector[0]))
        prog.emit(f"using layer {blobs[model[0]][0][:19]}")
        return layers, {"source": {"import": model[0]}}

    def _import(self, path: Path, shown: str, prog: Progress, pins: list[str], target: str | None = None):
        """Layers for FROM <path>: a safetensors directory or a GGUF file, validated and
        copied into the store (or, with `target`, quantized into it: the unquantized file is never stored).
        Errors name the path only as the user wrote it (`shown`)."""
        with user_path_errors(shown):
            is_dir = path.is_dir()
        if is_dir:
            if target is not None:
                raise _not_gguf(target)
            files = safetensors_dir_files(path, shown)
            safetensors_description(files)  # refuse a broken model before copying gigabytes
            layers = []
            for fn, p in files.items():
                prog.emit(f"copying file {fn}")
                check = (lambda name: (lambda q: safetensors_header_params(q, name)))(fn) if fn.endswith(".safetensors") else None
                digest, size = self.store.import_file(p, shown=f"{shown}/{fn}", what=fn, check=check)
                pin(self.store, pins, digest)
                layers.append(layer(MT_FILE, digest, size, fn))
            return layers, {"source": {"import": safe_name(path.name, "model")}}
        info = read_gguf_info(path, display_name=shown)  # refuse a broken file before copying it
        if info.adapter_type is not None:
            raise InvalidRequest(f"{shown} is a {info.adapter_type} adapter, not a model: write FROM <the model it was "
                                 f"trained on> and ADAPTER {shown.removeprefix('FROM ')} below it")
        if target is not None:
            quantized = self._quantized(path, info, target, safe_name(path.name), prog, pins)
            return [quantized], {"source": {"import": safe_name(path.name)}}
        size = info.file_size
        prog.emit("copying file")
        digest, size = self.store.import_file(
            path, shown=shown, what=shown_path(path.name), progress=prog.counter("copying file", None, size),
            check=lambda p: read_gguf_info(p, display_name=shown))  # the copy is what counts
        pin(self.store, pins, digest)
        prog.emit(f"using layer {digest[:19]}", digest, size, size)
        return [gguf_layer(self.store, digest, safe_name(path.name))], {"source": {"import": safe_name(path.name)}}

    def _quantize_layers(self, layers: list[dict], target: str, prog: Progress, pins: list[str]) -> list[dict]:
        """`layers` with the GGUF model's layer quantized to `target`."""
        model = next((l for l in layers if l["mediaType"] == MT_MODEL), None)
        if model is None:
            raise _not_gguf(target)
        path = self.store.blob_path(model["digest"])
        quantized = self._quantized(path, read_gguf_info(path, display_name="the model"), target, model.get("filename"),
                                    prog, pins)
        return [quantized if l is model else l for l in layers]

    def _quantized(self, path: Path, info: GGUFInfo, target: str, filename: str | None, prog: Progress,
                   pins: list[str]) -> dict:
        """The model layer of the GGUF at `path` quantized to `target` by llama.cpp (a child process)."""
        _quantize.check_source(info.file_type, target)
        status = f"quantizing {info.file_type.upper()} model to {target}"
        prog.emit(status)
        need = _quantize.expected_bytes(info.file_size, info.file_type, target)
        with storage_errors("quantize the model"):
            free = shutil.disk_usage(self.store.root).free
        if free < need + 64 * 2**20:
            raise LocalrunError(f"not enough disk space to quantize: about {need / 2**30:.1f} GiB needed in "
                                f"{self.store.root}, {free / 2**30:.1f} GiB free; free some space or set LOCALRUN_MODELS "
                                "to a larger disk", status=507, code="insufficient_storage")
        import psutil

        threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        counter = prog.counter(status, None, need)
        with self.store.temp_file() as (tmp, _f):
            _quantize.quantize(path, tmp, target, threads, need, counter,
                               lambda: prog.cancel is not None and prog.cancel.is_set())
            prog.emit("verifying quantized model")
            digest, size = self.store.adopt(tmp, what=f"the {target} model",
                                            check=lambda p: read_gguf_info(p, display_name=f"the {target} model"))
        pin(self.store, pins, digest)
        prog.emit(f"using layer {digest[:19]}", digest, size, size)
        return layer(MT_MODEL, digest, size, validate_filename(filename) if filename else None)

    def _import_projector(self, text: str, base: Path, prog: Progress, pins: list[str]) -> dict:
        """The projector layer for a second FROM: a local GGUF whose architecture is clip (a vision
        projector, as llama.cpp's converter writes it with --mmproj), copied into the store."""
        shown = f"FROM {shown_path(text)}"
        path = local_source(text, base)
        if path is None:
            raise InvalidRequest(f"{shown}: a second FROM must be a vision projector file (an mmproj .gguf)")
        with user_path_errors(shown):
            if path.is_dir():
                raise InvalidRequest(f"{shown}: a second FROM must be a vision projector .gguf file, not a directory")
        info = read_gguf_info(path, display_name=shown)
        if info.architecture != "clip":
            raise InvalidRequest(f"{shown}: a second FROM must be a vision projector (a GGUF whose architecture is "
                                 f"clip), but this one's architecture is {info.architecture!r}")
        return copy_layer(self.store, path, info, shown, MT_PROJECTOR, "mmproj.gguf", "copying projector", prog, pins)
