"""Pulling a model into the store: from the catalog or a Hugging Face hub repo.

Which files a model is made of (a catalog model's from the installed package's copy, the store's
or the hub's), each fetched or reused whole (a damaged stored copy is fetched again and replaced),
then the manifest written. Offline, a model already stored stays in use.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest, LocalrunError, NotFound
from localrun.library import catalog as _catalog
from localrun.library.gguf_info import read_gguf_info
from localrun.library.layers import gguf_layer, layer, pin, read_config, write_model
from localrun.library.model import ProgressFn, ResolvedModel
from localrun.library.names import ModelName, parse_name
from localrun.library.pull import Hub, HubUnreachable, Progress, RemoteFile, choose_gguf, choose_projector, choose_safetensors
from localrun.library.resolver import Resolver
from localrun.library.st_header import safetensors_header_params
from localrun.library.store import MT_ADAPTER, MT_FILE, MT_MODEL, MT_PROJECTOR, Store

FILE_LAYERS = (MT_MODEL, MT_FILE, MT_PROJECTOR, MT_ADAPTER)  # the model's files (not its small text layers)
# where a model's files came from, not what they are: a re-pull that finds the same files keeps the stored record
PROVENANCE = ("local_package", "revision")


class Puller:
    """Pulls into `store`; `resolver` answers what is stored (a pull's result, an offline pull's fallback)."""

    def __init__(self, store: Store, resolver: Resolver):
        self.store, self.resolver = store, resolver

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
                if self.resolver.exists(mn.display):  # offline, but we already have it: keep using it
                    prog.emit("success", check=False)
                    return self.resolver.resolve(mn.display)
                raise
            prog.check()
            prog.emit("writing manifest")
            write_model(self.store, mn, layers, self._kept_source(mn, layers, extra), pins)
            prog.emit("success", check=False)
        finally:
            for d in pins:
                self.store.unpin(d)
        return self.resolver.resolve(mn.display)

    def _kept_source(self, mn: ModelName, layers: list[dict], extra: dict) -> dict:
        """`extra` with the stored model's `source` when a re-pull found the same files from the same place,
        only fetched another way (the installed package's copy vs the store's or the hub's, another hub
        commit): the config, and so the model's ID (its manifest's digest), stays the same, as Ollama's does."""
        try:
            m, _, _ = self.store.read_manifest(mn)
        except LocalrunError:
            return extra

        def files(ls: list[dict]) -> list[tuple]:
            return [(l.get("mediaType"), l.get("digest"), l.get("filename")) for l in ls if l.get("mediaType") in FILE_LAYERS]

        def place(src: dict) -> dict:
            return {k: v for k, v in src.items() if k not in PROVENANCE}

        old, new = read_config(self.store, m).get("source"), extra.get("source") or {}
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
                pin(self.store, pins, src.sha256)
                prog.emit(status, src.sha256, src.size, src.size)
                return [gguf_layer(self.store, src.sha256, src.file)], extra
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
                pin(self.store, pins, digest)
                prog.emit(status, digest, size, size)
                extra["source"]["local_package"] = src.local_package
                return [gguf_layer(self.store, digest, src.file)], extra
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
        pin(self.store, pins, digest)
        extra["source"]["revision"] = hub.commit
        return [gguf_layer(self.store, digest, src.file)], extra


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
        pin(self.store, pins, digest)
        layers = [gguf_layer(self.store, digest, rf.filename)]
        source.update({"file": rf.filename, "revision": hub.commit})
        proj = choose_projector(files, rf.filename)
        if proj is not None:
            proj_layer = self._pull_projector(hub, proj, prog, pins)
            if proj_layer is not None:
                layers.append(proj_layer)
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
        pin(self.store, pins, digest)
        return layer(MT_PROJECTOR, digest, size, rf.filename)

    def _pull_repo_safetensors(self, repo: str, prog: Progress, pins: list[str]):
        hub = Hub(repo)
        layers, more = self._download_safetensors(hub, choose_safetensors(hub.list_files(), repo), prog, pins)
        return layers, more

    def _download_safetensors(self, hub: Hub, files: list[RemoteFile], prog: Progress, pins: list[str]):
        layers = []
        for rf in files:
            check = None
            if rf.filename.endswith(".safetensors"):
                check = (lambda name: (lambda p: safetensors_header_params(p, name)))(rf.filename)
            digest, size = hub.download(self.store, rf, prog, check=check)
            pin(self.store, pins, digest)
            layers.append(layer(MT_FILE, digest, size, rf.filename))
        return layers, {}


class _NotAProjector(Exception):
    """An mmproj-named GGUF whose architecture is not clip (carries the architecture)."""
