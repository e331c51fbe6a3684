"""Library: pull, create, list, show, resolve, copy, remove (the daemon's one entry point)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from localrun.errors import InvalidRequest, LocalrunError, ModelDamaged, NotFound
from localrun.library import adapters as _adapters
from localrun.library import catalog as _catalog
from localrun.library import quantize as _quantize
from localrun.library.capabilities import model_capabilities, tool_format
from localrun.library.capabilities import model_info as with_ide_keys
from localrun.library.create import gguf_details, safetensors_description, safetensors_dir_files, template_from_files
from localrun.library.gguf_info import GGUFInfo, read_gguf_info
from localrun.library.model import ModelSummary, PullEvent, ResolvedModel
from localrun.library.modelfile import Modelfile, local_source, parameter_lines, parse_modelfile
from localrun.library.names import ModelName, parse_name, validate_digest, validate_filename
from localrun.library.paths import check_regular, shown as shown_path, user_path_errors
from localrun.library.pull import (Hub, HubUnreachable, Progress, RemoteFile, choose_gguf, choose_projector, choose_safetensors,
                                   is_safetensors_model, kept_safetensors_file)
from localrun.library.store import (CONFIG_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, MT_ADAPTER, MT_FILE, MT_PROJECTOR, MT_LICENSE, MT_MESSAGES,
                                    MT_MODEL, MT_PARAMS, MT_SYSTEM, MT_TEMPLATE, MAX_SMALL_LAYER, DamagedBlob, Store,
                                    short_blob, storage_errors)

ProgressFn = Callable[[PullEvent], None] | None
MAX_FILES = 1000  # files in one create's `files` (a safetensors model has tens)
_TEXT_LAYERS = {MT_TEMPLATE: "template", MT_SYSTEM: "system", MT_LICENSE: "license"}
# what a damaged layer is called in messages
_PART_NAMES = {MT_MODEL: "weights file", MT_PROJECTOR: "vision projector", MT_ADAPTER: "LoRA adapter",
               MT_TEMPLATE: "template", MT_SYSTEM: "system prompt", MT_LICENSE: "license", MT_PARAMS: "parameters",
               MT_MESSAGES: "messages"}
_FILE_LAYERS = (MT_MODEL, MT_FILE, MT_PROJECTOR, MT_ADAPTER)  # the model's files (not its small text layers)
# where a model's files came from, not what they are: a re-pull that finds the same files keeps the stored record
_PROVENANCE = ("local_package", "revision")
MAX_MESSAGES = 1024  # a Modelfile's MESSAGE entries
_info_cache: dict[tuple, GGUFInfo] = {}
_info_lock = threading.Lock()


def _gguf_info(path: Path) -> GGUFInfo:
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _info_lock:
        hit = _info_cache.get(key)
    if hit is None:
        hit = read_gguf_info(path)
        with _info_lock:
            if len(_info_cache) > 64:
                _info_cache.clear()
            _info_cache[key] = hit
    return hit


def _stat_sig(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _copy_resolved(r: ResolvedModel) -> ResolvedModel:
    """A copy whose containers the caller may change without changing the cached one."""
    return dataclasses.replace(r, parameters=dict(r.parameters), details=dict(r.details),
                               messages=[dict(x) if isinstance(x, dict) else x for x in r.messages])


def _layer(media_type: str, digest: str, size: int, filename: str | None = None) -> dict:
    d = {"mediaType": media_type, "digest": digest, "size": size}
    if filename:
        d["filename"] = filename
    return d


def _not_gguf(target: str) -> InvalidRequest:
    return InvalidRequest(f"quantizing to {target} needs a GGUF model; this one is safetensors files: convert it to a "
                          "GGUF in F16 first (llama.cpp's convert_hf_to_gguf.py), then create from that")


class Library:
    def __init__(self, root: Path | None = None):
        if root is None:
            from localrun.config import settings

            root = settings().models_dir
        self.root = Path(root)
        self.store = Store(self.root)
        # name -> (its manifest's stat and path, the exact name's manifest path when the catalog's tag was taken
        # instead, the resolved model): every generation request resolves its model (see resolve)
        self._resolved: dict[str, tuple[tuple, Path, Path | None, ResolvedModel]] = {}

    # ------------------------------------------------------------------ pull
    def pull(self, name: str, progress: ProgressFn = None, cancel: threading.Event | None = None) -> ResolvedModel:
        mn = parse_name(name)
        prog = Progress(progress, cancel)
        prog.emit("pulling manifest")
        self.store.ensure()
        pins: list[str] = []
        try:
            src = _catalog.lookup(mn)
            if src is None and not mn.is_hf:
                raise NotFound(f"model '{mn.display}' is not in the catalog; known names: {', '.join(_catalog.catalog_names())}, "
                               "or pull hf.co/ORG/REPO[:QUANT] from the Hugging Face hub")
            try:
                layers, extra = self._pull_catalog(src, prog, pins) if src else self._pull_hf(mn, prog, pins)
            except HubUnreachable:
                if self.exists(mn.display):  # offline, but we already have it: keep using it
                    prog.emit("success", check=False)
                    return self.resolve(mn.display)
                raise
            prog.check()
            prog.emit("writing manifest")
            self._write(mn, layers, self._kept_source(mn, layers, extra), pins)
            prog.emit("success", check=False)
        finally:
            for d in pins:
                self.store.unpin(d)
        return self.resolve(mn.display)

    def _kept_source(self, mn: ModelName, layers: list[dict], extra: dict) -> dict:
        """`extra` with the stored model's `source` when a re-pull found the same files from the same place,
        only fetched another way (the installed package's copy vs the store's or the hub's, another hub
        commit): the config, and so the model's ID (its manifest's digest), stays the same, as Ollama's does."""
        try:
            m, _, _ = self.store.read_manifest(mn)
        except LocalrunError:
            return extra

        def files(ls: list[dict]) -> list[tuple]:
            return [(l.get("mediaType"), l.get("digest"), l.get("filename")) for l in ls if l.get("mediaType") in _FILE_LAYERS]

        def place(src: dict) -> dict:
            return {k: v for k, v in src.items() if k not in _PROVENANCE}

        old, new = self._config(m).get("source"), extra.get("source") or {}
        if files(m["layers"]) == files(layers) and isinstance(old, dict) and place(old) == place(new):
            return {**extra, "source": old}
        return extra

    def _pin(self, pins: list[str], digest: str) -> str:
        self.store.pin(digest)
        pins.append(digest)
        return digest

    def _pull_catalog(self, src: _catalog.CatalogSource, prog: Progress, pins: list[str]):
        extra: dict[str, Any] = {"parameters": src.parameters, "license": src.license,
                                 "source": {"catalog": src.alias, "repo": src.repo, "file": src.file}}
        if src.format == "safetensors":
            layers, more = self._pull_repo_safetensors(src.repo, prog, pins)
            return layers, {**extra, **more}
        short = (src.sha256 or "")[7:19]
        status = f"pulling {short}" if short else f"pulling {src.file}"
        damaged = None
        if src.sha256:
            # the stored copy is taken only whole: its size and its GGUF header (a truncated or damaged blob is
            # fetched again, and the new copy replaces it in one rename)
            damaged = self.store.blob_problem(src.sha256, src.size, src.file or "model.gguf")
            if damaged is None:
                self._pin(pins, src.sha256)
                prog.emit(status, src.sha256, src.size, src.size)
                return [self._gguf_layer(src.sha256, src.file)], extra
            if self.store.blob_path(src.sha256).exists():
                prog.emit(f"the stored copy of {src.file} {damaged}: replacing it", src.sha256)
            else:
                damaged = None
        local = src.local_path()
        if local is not None and src.sha256 and (src.size is None or local.stat().st_size == src.size):
            prog.emit(status, src.sha256, src.size, 0)
            prog.emit("verifying sha256 digest", src.sha256)
            try:
                digest, size = self.store.import_file(
                    local, shown=f"the copy of {src.file} in {src.local_package}", expected=src.sha256,
                    what=src.file or local.name, progress=prog.counter("verifying sha256 digest", src.sha256, src.size),
                    check=lambda p: read_gguf_info(p, display_name=src.file), replace=damaged is not None)
                self._pin(pins, digest)
                prog.emit(status, digest, size, size)
                extra["source"]["local_package"] = src.local_package
                return [self._gguf_layer(digest, src.file)], extra
            except LocalrunError as e:
                if e.code != "digest_mismatch":
                    raise
                prog.emit(f"the copy in {src.local_package} is damaged; downloading instead")
        hub = Hub(src.repo)
        files = hub.list_files()
        rf = next((f for f in files if f.filename == src.file), None)
        if rf is None:
            raise NotFound(f"file {src.file} not found in {src.repo} on the Hugging Face hub")
        if src.sha256:
            rf.sha256 = src.sha256
        digest, _ = hub.download(self.store, rf, prog, check=lambda p: read_gguf_info(p, display_name=rf.filename))
        self._pin(pins, digest)
        extra["source"]["revision"] = hub.commit
        return [self._gguf_layer(digest, src.file)], extra

    def _gguf_layer(self, digest: str, filename: str | None) -> dict:
        p = self.store.blob_path(digest)
        return _layer(MT_MODEL, digest, p.stat().st_size, validate_filename(filename) if filename else None)

    def _pull_hf(self, mn: ModelName, prog: Progress, pins: list[str]):
        repo = mn.repo_id
        hub = Hub(repo)
        files = hub.list_files()
        source = {"repo": repo}
        if mn.explicit_tag and mn.tag.lower() != "latest":
            rf = choose_gguf(files, mn.tag, repo)
        else:
            try:
                chosen = choose_safetensors(files, repo)
            except NotFound:
                rf = choose_gguf(files, None, repo)  # a GGUF-only repo: take its default quant
            else:
                layers, more = self._download_safetensors(hub, chosen, prog, pins)
                return layers, {"source": {**source, "revision": hub.commit}, **more}
        def check(p: Path) -> None:
            kind = read_gguf_info(p, display_name=rf.filename).adapter_type
            if kind is not None:
                raise InvalidRequest(f"hf.co/{repo}: {rf.filename} is a {kind} adapter, not a model: pull the model it "
                                     f"was trained on, then create a model FROM it with ADAPTER <this file>")

        digest, _ = hub.download(self.store, rf, prog, check=check)
        check(self.store.blob_path(digest))  # also when those bytes were already in the store
        self._pin(pins, digest)
        layers = [self._gguf_layer(digest, rf.filename)]
        source.update({"file": rf.filename, "revision": hub.commit})
        proj = choose_projector(files, rf.filename)
        if proj is not None:
            layer = self._pull_projector(hub, proj, prog, pins)
            if layer is not None:
                layers.append(layer)
                source["projector"] = proj.filename
        return layers, {"source": source}

    def _pull_projector(self, hub: Hub, rf: RemoteFile, prog: Progress, pins: list[str]) -> dict | None:
        """The projector layer for an mmproj GGUF the repo ships beside the model, or None (with a
        progress line saying why) when that file is not a vision projector (its architecture is not clip)."""
        def check(p: Path) -> None:
            arch = read_gguf_info(p, display_name=rf.filename).architecture
            if arch != "clip":
                raise _NotAProjector(arch)

        try:
            digest, size = hub.download(self.store, rf, prog, check=check)
            check(self.store.blob_path(digest))  # also when those bytes were already in the store
        except _NotAProjector as e:
            prog.emit(f"skipping {rf.filename}: not a vision projector (its architecture is {e.args[0]!r}, not clip)")
            return None
        self._pin(pins, digest)
        return _layer(MT_PROJECTOR, digest, size, rf.filename)

    def _pull_repo_safetensors(self, repo: str, prog: Progress, pins: list[str]):
        hub = Hub(repo)
        layers, more = self._download_safetensors(hub, choose_safetensors(hub.list_files(), repo), prog, pins)
        return layers, more

    def _download_safetensors(self, hub: Hub, files: list[RemoteFile], prog: Progress, pins: list[str]):
        layers = []
        for rf in files:
            check = None
            if rf.filename.endswith(".safetensors"):
                check = (lambda name: (lambda p: _check_st(p, name)))(rf.filename)
            digest, size = hub.download(self.store, rf, prog, check=check)
            self._pin(pins, digest)
            layers.append(_layer(MT_FILE, digest, size, rf.filename))
        return layers, {}

    # ------------------------------------------------------------------ create
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
        adapter_file = self._adapter_file(mf.adapter, base, mf.from_) if mf.adapter is not None else None
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
                model = self._adapter_base(layers)
                layers = [l for l in layers if l["mediaType"] != MT_ADAPTER]
                layers.append(self._import_adapter(*adapter_file, prog, pins, model) if adapter_file is not None
                              else self._adapter_from_blobs(adapters, prog, pins, model))
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
            self._write(mn, layers, extra, pins)
            if files is not None:
                self.store.claimed(files.values())
            prog.emit("success", check=False)
        finally:
            for d in pins:
                self.store.unpin(d)
        return self.resolve(mn.display)

    def _create_from(self, mf: Modelfile, base: Path, prog: Progress, pins: list[str], target: str | None = None):
        src = mf.from_ or ""
        path = local_source(src, base)
        if path is not None:
            return self._import(path, f"FROM {shown_path(src)}", prog, pins, target)
        base_name = parse_name(src)
        if not self.exists(base_name.display):
            if _catalog.lookup(base_name) is None and not base_name.is_hf:
                raise NotFound(f"FROM {src}: model '{base_name.display}' not found; pull it first or give a path like ./model.gguf")
            self.pull(base_name.display, progress=prog.callback, cancel=prog.cancel)
        self.resolve(base_name.display)  # a damaged base model is a ModelDamaged naming it, before anything is written
        m, mdigest, _ = self.store.read_manifest(self._find(base_name))
        extra: dict[str, Any] = {"parent_model": self._find(base_name).display}
        layers = []
        for l in m["layers"]:
            mt = l["mediaType"]
            if mt in (MT_MODEL, MT_FILE, MT_ADAPTER, MT_PROJECTOR):
                self._pin(pins, l["digest"])
                layers.append(l)
            elif mt in _TEXT_LAYERS:
                extra[_TEXT_LAYERS[mt]] = self.store.read_small(l["digest"]).decode("utf-8")
            elif mt == MT_PARAMS:
                extra["parameters"] = json.loads(self.store.read_small(l["digest"]))
            elif mt == MT_MESSAGES:
                extra["messages"] = json.loads(self.store.read_small(l["digest"]))
        cfg = self._config(m)
        extra["source"] = cfg.get("source") or {}
        return (self._quantize_layers(layers, target, prog, pins) if target is not None else layers), extra

    def check_files(self, files: Any, field: str = "files") -> dict[str, tuple[str, Path]]:
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
            if not self.store.has_blob(d):
                raise InvalidRequest(f"'{field}': no blob {d} for {fn}: upload the file first "
                                     f"(POST /api/blobs/{d} with the file as the body)")
            blobs[fn] = (d, self.store.blob_path(d))
        return blobs

    def _create_from_files(self, files: Any, prog: Progress, pins: list[str]):
        """Layers for Ollama's `files`: uploaded blobs by file name. GGUF files: one model, plus a
        vision projector (a GGUF whose architecture is clip); or a safetensors model's files."""
        blobs = self.check_files(files)
        for d, _ in blobs.values():
            self._pin(pins, d)  # from here until the manifest names it, GC leaves it alone
        ggufs = [fn for fn in blobs if fn.lower().endswith(".gguf")]
        prog.emit("parsing files")
        if not ggufs:
            keep = {fn: p for fn, (_, p) in blobs.items() if kept_safetensors_file(fn)}
            if not is_safetensors_model(keep):
                raise InvalidRequest("'files' holds no model: give a .gguf file, or a safetensors model's config.json "
                                     "and *.safetensors files")
            safetensors_description(keep)  # every header checked, config.json read
            layers = [_layer(MT_FILE, blobs[fn][0], p.stat().st_size, fn) for fn, p in keep.items()]
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
        layers = [self._gguf_layer(blobs[model[0]][0], model[0])]
        if projector:
            d, p = blobs[projector[0]]
            layers.append(_layer(MT_PROJECTOR, d, p.stat().st_size, projector[0]))
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
                check = (lambda name: (lambda q: _check_st(q, name)))(fn) if fn.endswith(".safetensors") else None
                digest, size = self.store.import_file(p, shown=f"{shown}/{fn}", what=fn, check=check)
                self._pin(pins, digest)
                layers.append(_layer(MT_FILE, digest, size, fn))
            return layers, {"source": {"import": _safe_name(path.name, "model")}}
        info = read_gguf_info(path, display_name=shown)  # refuse a broken file before copying it
        if info.adapter_type is not None:
            raise InvalidRequest(f"{shown} is a {info.adapter_type} adapter, not a model: write FROM <the model it was "
                                 f"trained on> and ADAPTER {shown.removeprefix('FROM ')} below it")
        if target is not None:
            layer = self._quantized(path, info, target, _safe_name(path.name), prog, pins)
            return [layer], {"source": {"import": _safe_name(path.name)}}
        size = info.file_size
        prog.emit("copying file")
        digest, size = self.store.import_file(
            path, shown=shown, what=shown_path(path.name), progress=prog.counter("copying file", None, size),
            check=lambda p: read_gguf_info(p, display_name=shown))  # the copy is what counts
        self._pin(pins, digest)
        prog.emit(f"using layer {digest[:19]}", digest, size, size)
        return [self._gguf_layer(digest, _safe_name(path.name))], {"source": {"import": _safe_name(path.name)}}

    def _quantize_layers(self, layers: list[dict], target: str, prog: Progress, pins: list[str]) -> list[dict]:
        """`layers` with the GGUF model's layer quantized to `target`."""
        model = next((l for l in layers if l["mediaType"] == MT_MODEL), None)
        if model is None:
            raise _not_gguf(target)
        path = self.store.blob_path(model["digest"])
        layer = self._quantized(path, read_gguf_info(path, display_name="the model"), target, model.get("filename"),
                                prog, pins)
        return [layer if l is model else l for l in layers]

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
        self._pin(pins, digest)
        prog.emit(f"using layer {digest[:19]}", digest, size, size)
        return _layer(MT_MODEL, digest, size, validate_filename(filename) if filename else None)

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
        return self._copy_layer(path, info, shown, MT_PROJECTOR, "mmproj.gguf", "copying projector", prog, pins)

    def _copy_layer(self, path: Path, info: GGUFInfo, shown: str, media_type: str, default_name: str, step: str,
                    prog: Progress, pins: list[str]) -> dict:
        """A checked GGUF file (a projector, an adapter) copied into the store (the copy checked again) as a
        layer of `media_type`; `step` is its progress line."""
        prog.emit(step)
        digest, size = self.store.import_file(
            path, shown=shown, what=shown_path(path.name), progress=prog.counter(step, None, info.file_size),
            check=lambda p: read_gguf_info(p, display_name=shown))
        self._pin(pins, digest)
        return _layer(media_type, digest, size, _safe_name(path.name, default_name))

    def _adapter_base(self, layers: list[dict]) -> GGUFInfo:
        """The GGUF header of the model an adapter goes on (adapters go on GGUF models only: llama.cpp applies
        them, the native engine merges them as it reads the GGUF)."""
        model = [l for l in layers if l["mediaType"] == MT_MODEL]
        if not model:
            raise InvalidRequest("a LoRA adapter needs a GGUF model (llama.cpp applies it; the native engine merges "
                                 "it as it reads a GGUF), and this model is safetensors. Import a GGUF of the model, "
                                 "or merge the adapter into the safetensors weights (PEFT's merge_and_unload) first")
        return _gguf_info(self.store.blob_path(model[0]["digest"]))

    @staticmethod
    def _check_lora(info: GGUFInfo, shown: str) -> None:
        """A LoRA adapter GGUF, not a model or another kind of adapter."""
        kind = info.adapter_type
        if kind is None:
            raise InvalidRequest(f"{shown} is not a LoRA adapter but a model (a GGUF of architecture "
                                 f"{info.architecture!r}). ADAPTER takes a LoRA adapter in GGUF: llama.cpp's "
                                 "convert_lora_to_gguf.py makes one from a PEFT adapter directory")
        if kind != "lora":
            raise InvalidRequest(f"{shown} is a {kind!r} adapter: only LoRA adapters are applied")

    @classmethod
    def _check_adapter(cls, info: GGUFInfo, shown: str, model: GGUFInfo) -> None:
        """An adapter GGUF that fits `model`: a LoRA adapter of the model's architecture and shapes."""
        cls._check_lora(info, shown)
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

    def _adapter_file(self, text: str, base: Path, from_: str | None) -> tuple[Path, GGUFInfo | None, str]:
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
        self._check_lora(info, shown)
        src = local_source(from_, base) if from_ else None
        if src is not None:
            with user_path_errors(f"FROM {shown_path(from_)}"):
                is_file, is_dir = src.is_file(), src.is_dir()
            if is_dir:
                self._adapter_base([])  # (a safetensors model: its refusal)
            if is_file:
                self._check_adapter(info, shown, read_gguf_info(src, display_name=f"FROM {shown_path(from_)}"))
        return path, info, shown

    def _import_adapter(self, path: Path, info: GGUFInfo | None, shown: str, prog: Progress, pins: list[str],
                        model: GGUFInfo) -> dict:
        """The adapter layer for ADAPTER <path>: the LoRA adapter (a PEFT directory converted to GGUF first),
        checked against the model and copied into the store."""
        if info is None:
            return self._converted_adapter(path / _adapters.CONFIG, path / _adapters.WEIGHTS,
                                           _safe_name(path.name + ".gguf", "adapter.gguf"), shown, prog, pins, model)
        self._check_adapter(info, shown, model)
        return self._copy_layer(path, info, shown, MT_ADAPTER, "adapter.gguf", "copying adapter", prog, pins)

    def _converted_adapter(self, config: Path, weights: Path, name: str, shown: str, prog: Progress, pins: list[str],
                           model: GGUFInfo) -> dict:
        """The adapter layer for a PEFT adapter (its config and weights files): converted to a LoRA GGUF `name`."""
        with tempfile.TemporaryDirectory(prefix="localrun-adapter-") as tmp:
            prog.emit("converting adapter")
            out = Path(tmp) / name
            _adapters.convert(config, weights, model, out, shown)
            return self._import_adapter(out, read_gguf_info(out, display_name=shown), shown, prog, pins, model)

    def _adapter_from_blobs(self, adapters: Any, prog: Progress, pins: list[str], model: GGUFInfo) -> dict:
        """The adapter layer for Ollama's `adapters`: one uploaded LoRA adapter GGUF, or a PEFT adapter's two files
        (converted to GGUF), by file name."""
        peft = {_adapters.CONFIG, _adapters.WEIGHTS}
        if not isinstance(adapters, dict) or not (len(adapters) == 1 or set(adapters) == peft):
            raise InvalidRequest("'adapters' must map one LoRA adapter GGUF's file name, or a PEFT adapter's "
                                 f"{_adapters.CONFIG} and {_adapters.WEIGHTS}, to their blob digests (sha256:...), "
                                 "each uploaded first with POST /api/blobs/<digest>")
        blobs = self.check_files(adapters, "adapters")
        for digest, _ in blobs.values():
            self._pin(pins, digest)
        if set(blobs) == peft:
            return self._converted_adapter(blobs[_adapters.CONFIG][1], blobs[_adapters.WEIGHTS][1], "adapter.gguf",
                                           "'adapters'", prog, pins, model)
        (fn, (digest, path)), = blobs.items()
        shown = f"'adapters': {fn}"
        self._check_adapter(read_gguf_info(path, display_name=shown), shown, model)
        prog.emit(f"using adapter {digest[:19]}")
        return _layer(MT_ADAPTER, digest, path.stat().st_size, fn)

    # ------------------------------------------------------------------ manifests
    def _write(self, mn: ModelName, layers: list[dict], extra: dict, pins: list[str]) -> str:
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
            d, s = self.store.put_bytes(data)
            self._pin(pins, d)
            layers.append(_layer(mt, d, s))
        details, model_info = self._describe_layers(layers)
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
        cd, cs = self.store.put_bytes(json.dumps(config, sort_keys=True).encode())
        self._pin(pins, cd)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                    "config": _layer(CONFIG_MEDIA_TYPE, cd, cs), "layers": layers}
        return self.store.write_manifest(mn, manifest)

    def _describe_layers(self, layers: list[dict]) -> tuple[dict, dict]:
        gguf = next((l for l in layers if l["mediaType"] == MT_MODEL), None)
        if gguf is not None:
            info = _gguf_info(self.store.blob_path(gguf["digest"]))
            return gguf_details(info), {}
        files = {l["filename"]: self.store.blob_path(l["digest"]) for l in layers if l["mediaType"] == MT_FILE}
        if not files:
            raise InvalidRequest("the model has no weights")
        return safetensors_description(files)

    def _config(self, m: dict) -> dict:
        c = m.get("config")
        if not c:
            return {}
        try:
            return json.loads(self.store.read_small(c["digest"]))
        except (ValueError, LocalrunError):
            return {}

    def _find(self, mn: ModelName) -> ModelName:
        """The stored name for mn: exact, else (no tag given) the catalog's default tag."""
        if self.store.manifest_path(mn).is_file():
            return mn
        if not mn.explicit_tag and not mn.is_hf:
            tag = _catalog.load_catalog()["latest"].get(mn.model)
            if tag and mn.namespace == "library":
                alt = mn.with_tag(tag)
                if self.store.manifest_path(alt).is_file():
                    return alt
        return mn

    # ------------------------------------------------------------------ blobs (Ollama's /api/blobs)
    def has_blob(self, digest: str) -> bool:
        return self.store.has_blob(validate_digest(digest))

    def upload(self, digest: str):
        """A blob to receive (Store.upload): for a create whose `files` will name it."""
        self.store.ensure()
        return self.store.upload(digest)

    # ------------------------------------------------------------------ read side
    def exists(self, name: str) -> bool:
        return self.store.manifest_path(self._find(parse_name(name))).is_file()

    def stored_name(self, name: str) -> str:
        """The stored model's full name for `name` (what delete unloads and removes): its manifest
        only, not its layers, so a model whose weights went missing can still be removed."""
        found = self._find(parse_name(name))
        if not self.store.manifest_path(found).is_file():
            raise NotFound(f"model '{name}' not found; `localrun list` shows the models in the library")
        return found.display

    def resolve(self, name: str) -> ResolvedModel:
        """The stored model `name` names. Every generation request asks, so the answer is kept while
        nothing it was read from changed: one stat of the manifest (a pull, create, copy or rm replaces
        or removes it; the layers it lists are content-addressed) and of its GGUF files (a truncated or
        replaced blob is seen) instead of about ten small reads. A model whose files are missing or
        invalid is a ModelDamaged (500) naming it and how to repair it; NotFound (404) is only for no
        such model."""
        hit = self._resolved.get(name)  # (a cached name was parsed, and found valid, when it was cached)
        if hit is not None:
            sig, path, exact, r, files = hit
            if (_stat_sig(path) == sig and (exact is None or not exact.is_file())
                    and r.weights.exists() and all(_stat_sig(p) == s for p, s in files)):
                return _copy_resolved(r)
        given = parse_name(name)
        mn = self._find(given)
        path = self.store.manifest_path(mn)
        sig = _stat_sig(path)  # before the read: a change after it misses next time
        files: list[tuple[Path, tuple | None]] = []  # (the same for its GGUF files)
        r = self._resolve(mn, sigs=files)
        if sig is not None:
            if len(self._resolved) >= 256:
                self._resolved.clear()
            self._resolved[name] = (sig, path, self.store.manifest_path(given) if mn != given else None, r, files)
        return _copy_resolved(r)

    def _resolve(self, mn: ModelName, damage: list[ModelDamaged] | None = None,
                 sigs: list[tuple[Path, tuple | None]] | None = None) -> ResolvedModel:
        """The model's manifest and layers read, and its files checked: each one's size, and the GGUF header
        of its weights, projector and adapter. A problem is a ModelDamaged; with `damage` (a list), the
        problems of those files are added to it instead (show's answer for a damaged model: what the manifest
        and the small layers say), and the answer has no GGUF header (info None). `sigs` (a list) gets each
        GGUF file's stat from before it was checked (what resolve's cache compares)."""
        m, digest, mtime = self.store.read_manifest(mn)
        cfg = self._config(m)

        def bad(l: dict, problem: str, part: str | None = None) -> None:
            err = self._damaged(mn, cfg, f"its {part or _PART_NAMES.get(l['mediaType'], 'file')} (blob "
                                         f"{short_blob(l['digest'])}) {problem}", l["digest"])
            if damage is None:
                raise err
            damage.append(err)

        vals: dict[str, Any] = {"template": None, "system": None, "license": None}
        params: dict = {}
        messages: list = []
        adapter = None
        projector: Path | None = None
        weights: Path | None = None
        info: GGUFInfo | None = None
        files: list[tuple[str, str]] = []
        files_ok = True
        fmt = "gguf"
        for l in m["layers"]:
            mt = l["mediaType"]
            size = l.get("size") if isinstance(l.get("size"), int) and not isinstance(l.get("size"), bool) else None
            if mt in (MT_MODEL, MT_ADAPTER, MT_PROJECTOR):
                p = self.store.blob_path(l["digest"])
                if sigs is not None:
                    sigs.append((p, _stat_sig(p)))
                header, problem = None, self.store.blob_problem(l["digest"], size)
                if problem is None:
                    try:
                        header = _gguf_info(p)
                    except InvalidRequest as e:  # "sha256-... is not a valid GGUF: ...", "sha256-...: <why>"
                        problem = e.message.removeprefix(p.name + " ") if e.message.startswith(p.name + " ") else \
                            f"cannot be read ({e.message.removeprefix(p.name + ': ')})"
                    except OSError as e:
                        problem = f"cannot be read ({e.strerror or e})"
                if problem is not None:
                    bad(l, problem)
                if mt == MT_MODEL:
                    weights, info = p, header
                elif mt == MT_ADAPTER:
                    adapter = str(p)
                else:
                    projector = p
            elif mt == MT_FILE:
                files.append((l["filename"], l["digest"]))
                problem = self.store.blob_problem(l["digest"], size)
                if problem is not None:
                    files_ok = False
                    bad(l, problem, f"file {l['filename']}")
            elif mt in _TEXT_LAYERS or mt in (MT_PARAMS, MT_MESSAGES):
                try:
                    raw = self.store.read_small(l["digest"])
                    if mt in _TEXT_LAYERS:
                        vals[_TEXT_LAYERS[mt]] = raw.decode("utf-8", errors="replace")
                    elif mt == MT_PARAMS:
                        params = json.loads(raw)
                        if not isinstance(params, dict):
                            raise ValueError
                    else:
                        messages = json.loads(raw)
                        if not isinstance(messages, list):
                            raise ValueError
                except DamagedBlob as e:
                    raise self._damaged(mn, cfg, f"its {_PART_NAMES[mt]} (blob {short_blob(l['digest'])}) {e.problem}",
                                        l["digest"]) from None
                except ValueError:
                    raise self._damaged(mn, cfg, f"its {_PART_NAMES[mt]} (blob {short_blob(l['digest'])}) is not "
                                                 "what localrun writes there (not valid JSON)", l["digest"]) from None
        if weights is None:
            if not files:
                raise self._damaged(mn, cfg, "its manifest lists no weights")
            fmt = "safetensors"
            if files_ok:
                weights = self.store.view_dir(digest, files)
                if vals["template"] is None:
                    vals["template"] = template_from_files({fn: weights / fn for fn, _ in files})
            else:  # (damage holds why; nothing is linked to damaged files)
                weights = self.store.views / digest.removeprefix("sha256:")
        elif info is not None and vals["template"] is None:
            vals["template"] = info.chat_template
        details = dict(cfg.get("details") or (gguf_details(info) if info else {}))
        return ResolvedModel(
            name=mn.display, digest=digest, weights=weights, format=fmt, template=vals["template"],
            system=vals["system"], parameters=params, messages=messages, license=vals["license"], adapter=adapter,
            info=info, size=sum(int(l["size"]) for l in m["layers"]),
            modified_at=datetime.fromtimestamp(mtime, tz=timezone.utc), details=details, projector=projector,
        )

    # ------------------------------------------------------------------ damaged models
    def _damaged(self, mn: ModelName, cfg: dict, what: str, digest: str | None = None) -> ModelDamaged:
        """The error for a stored model whose files are missing or invalid: it names the model, says what is
        wrong (`what`) and how to repair it. A file the model shares with the model it was made from (FROM it,
        or copied from it) is repaired there."""
        todo = self._repair(mn, cfg)
        src = cfg.get("source") if isinstance(cfg.get("source"), dict) else {}
        origin = (cfg.get("details") or {}).get("parent_model") or ("" if "import" in src else src.get("catalog"))
        if digest and isinstance(origin, str) and origin:
            with_origin = self._origin_repair(mn, origin, digest)
            if with_origin:
                todo = with_origin
        return ModelDamaged(f"model '{mn.display}' is damaged: {what}; {todo}")

    @staticmethod
    def _repair(mn: ModelName, cfg: dict) -> str:
        """What repairs model `mn`: a pull for one that came from the catalog or a hub (it fetches what is
        missing or damaged again), else removing it and creating it again."""
        src = cfg.get("source") if isinstance(cfg.get("source"), dict) else {}
        created = bool((cfg.get("details") or {}).get("parent_model")) or "import" in src
        if not created and (mn.is_hf or _catalog.lookup(mn) is not None):
            return f"pull it again with `localrun pull {mn.display}` to repair it"
        return f"remove it with `localrun rm {mn.display}` and create it again"

    def _origin_repair(self, mn: ModelName, origin: str, digest: str) -> str | None:
        """How to repair the file `digest` of `mn` through `origin`, the model `mn` was made from, when that one
        has the file too (stored, or pinned by the catalog); None otherwise."""
        try:
            on = self._find(parse_name(origin))
        except LocalrunError:
            return None
        if on.display == mn.display:
            return None
        try:
            m, _, _ = self.store.read_manifest(on)
        except NotFound:
            src = _catalog.lookup(on)
            if src is not None and src.sha256 == digest:
                return f"it is the file of {on.display}: pull that again with `localrun pull {on.display}` to repair it"
            return None
        except LocalrunError:
            return None
        if digest not in {l.get("digest") for l in m["layers"]}:
            return None
        return f"it shares that file with {on.display}: {self._repair(on, self._config(m))}"

    def list(self) -> list[ModelSummary]:
        out = []
        for mn, _ in self.store.iter_manifests():
            try:
                m, digest, mtime = self.store.read_manifest(mn)
            except LocalrunError:
                continue
            cfg = self._config(m)
            caps = self._list_capabilities(m)
            out.append(ModelSummary(name=mn.display, digest=digest, size=sum(int(l["size"]) for l in m["layers"]),
                                    modified_at=datetime.fromtimestamp(mtime, tz=timezone.utc),
                                    details=dict(cfg.get("details") or {}), capabilities=caps))
        return sorted(out, key=lambda s: s.name)

    def _list_capabilities(self, m: dict) -> list[str]:
        """model_capabilities() from a manifest's layers, without resolve()'s side effects (a safetensors
        model's view directory); [] when a part is missing or damaged (show and run say what is wrong)."""
        info = projector = template = weights = None
        files: dict[str, Path] = {}
        try:
            for l in m["layers"]:
                mt = l["mediaType"]
                if mt == MT_MODEL:
                    weights = self.store.blob_path(l["digest"])
                    info = _gguf_info(weights)
                elif mt == MT_FILE:
                    files[validate_filename(l["filename"])] = self.store.blob_path(l["digest"])
                elif mt == MT_PROJECTOR:
                    projector = self.store.blob_path(l["digest"])
                elif mt == MT_TEMPLATE:
                    template = self.store.read_small(l["digest"]).decode("utf-8", errors="replace")
            if template is None:
                template = info.chat_template if info is not None else (template_from_files(files) if files else None)
        except (LocalrunError, OSError, ValueError, KeyError, TypeError):
            return []
        return model_capabilities(SimpleNamespace(info=info, projector=projector, template=template,
                                                  format="gguf" if info is not None else "safetensors",
                                                  weights=weights))

    def show(self, name: str) -> dict:
        """/api/show's answer. For a model whose files (weights, projector, adapter) are damaged, what its
        manifest and small layers say (the Modelfile, parameters, template, license...) with `damaged`: the
        error its use would be (no model_info from the GGUF, no capabilities); a damaged small layer or
        manifest is that ModelDamaged."""
        damage: list[ModelDamaged] = []
        try:
            r = self.resolve(name)
        except ModelDamaged:
            r = self._resolve(self._find(parse_name(name)), damage)
        m, _, _ = self.store.read_manifest(self._find(parse_name(name)))
        cfg = self._config(m)
        model_info = r.info.model_info() if r.info else dict(cfg.get("model_info") or {})
        model_info.pop("tokenizer.chat_template", None)
        header = (f'Modelfile generated by "localrun show"\nTo build a new Modelfile based on this, replace FROM with:\n'
                  f"FROM {r.name}")
        modelfile = Modelfile(str(r.weights), r.parameters, r.template, r.system, r.messages, r.license,
                              r.adapter, str(r.projector) if r.projector else None).to_text(header=header)
        caps = [] if damage else model_capabilities(r)
        model_info = with_ide_keys(r, model_info)
        out = {
            "modelfile": modelfile,
            "parameters": "\n".join(f"{k:<30} {v}" for k, v in parameter_lines(r.parameters)),
            "template": r.template or "",
            "system": r.system or "",
            "license": r.license or "",
            "messages": r.messages,
            "details": r.details,
            "model_info": model_info,
            "capabilities": caps,
            "tool_format": tool_format(r),  # how tools reach the model: its template, or the generic format
            "modified_at": r.modified_at.isoformat(),
            "weights_path": str(r.weights),
            "digest": r.digest,
            "format": r.format,
            "size": r.size,
            "source": cfg.get("source") or {},
        }
        if damage:
            out["damaged"] = damage[0].message
        if r.projector is not None:  # Ollama's projector_info: the projector GGUF's metadata
            try:
                out["projector_info"] = _gguf_info(r.projector).model_info()
            except (InvalidRequest, OSError):  # (damaged: `damaged` says so)
                out["projector_info"] = {}
            out["projector_path"] = str(r.projector)
        return out

    # ------------------------------------------------------------------ copy / remove
    def copy(self, src: str, dst: str) -> None:
        s = self._find(parse_name(src))
        d = parse_name(dst)
        if d.is_hf:
            raise InvalidRequest("cannot copy to a hf.co/... name: that namespace belongs to the Hugging Face hub")
        m, _, _ = self.store.read_manifest(s)
        self.store.write_manifest(d, m)

    def clean_temp(self) -> int:
        """Remove the temp files a killed process left in the store (the daemon calls this
        at startup); live writers' temps and partial downloads stay. Returns the count."""
        return self.store.clean_temp()

    def prune(self) -> int:
        """Blobs no model uses, left by a create that never came (an upload before a restart) or
        by a process killed mid-create: removed when the daemon starts, as Ollama does, unless
        written in the last hour (UPLOAD_KEEP_S). Returns the bytes freed."""
        from localrun.library.store import UPLOAD_KEEP_S

        return self.store.gc(keep_newer_than=UPLOAD_KEEP_S)

    def remove(self, name: str) -> None:
        mn = parse_name(name)
        found = self._find(mn)
        self.store.delete_manifest(found)
        self.store.gc()


class _NotAProjector(Exception):
    """An mmproj-named GGUF whose architecture is not clip (carries the architecture)."""


def _check_st(path: Path, name: str) -> None:
    from localrun.library.st_header import safetensors_header_params

    safetensors_header_params(path, name)


def _safe_name(name: str, default: str = "model.gguf") -> str:
    try:
        return validate_filename(name)
    except InvalidRequest:
        return default


__all__ = ["Library"]
