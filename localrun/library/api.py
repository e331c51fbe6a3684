"""Library: pull, create, list, show, resolve, copy, remove (the daemon's one entry point).

A thin front over the library's parts: resolver.py (names to stored models), puller.py (pulls),
creator.py (creates), describe.py (show and list), and the store (store.py) they share.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest
from localrun.library import describe
from localrun.library.blobs import UPLOAD_KEEP_S, BlobUpload
from localrun.library.creator import Creator
from localrun.library.layers import check_files
from localrun.library.model import ModelSummary, ProgressFn, ResolvedModel
from localrun.library.modelfile import Modelfile
from localrun.library.names import parse_name, validate_digest
from localrun.library.puller import Puller
from localrun.library.resolver import Resolver
from localrun.library.store import Store


class Library:
    """The model library under `root` (settings().models_dir when none is given)."""

    def __init__(self, root: Path | None = None):
        if root is None:
            from localrun.config import settings

            root = settings().models_dir
        self.root = Path(root)
        self.store = Store(self.root)
        self.resolver = Resolver(self.store)
        self.puller = Puller(self.store, self.resolver)
        self.creator = Creator(self.store, self.resolver, self.puller)

    # ------------------------------------------------------------------ pull / create
    def pull(self, name: str, progress: ProgressFn = None, cancel: threading.Event | None = None) -> ResolvedModel:
        """The model `name` (a catalog name, or hf.co/ORG/REPO[:QUANT]) pulled into the store (puller.py)."""
        return self.puller.pull(name, progress, cancel)

    def create(self, name: str, modelfile: str | Modelfile, base_dir: Path | None = None,
               progress: ProgressFn = None, cancel: threading.Event | None = None,
               files: dict[str, str] | None = None, adapters: dict[str, str] | None = None,
               quantize: str | None = None) -> ResolvedModel:
        """A model from a Modelfile, a GGUF, a safetensors directory or uploaded blobs (creator.py has the
        whole contract)."""
        return self.creator.create(name, modelfile, base_dir, progress, cancel, files, adapters, quantize)

    def check_files(self, files: Any, field: str = "files") -> dict[str, tuple[str, Path]]:
        """Ollama's create `files` (or `adapters`) checked: {file name: (digest, blob path)}, each name a plain
        file name, each digest one the store holds (uploaded first); InvalidRequest saying what is wrong
        otherwise. The daemon calls it before it answers 200, and create again before it uses them."""
        return check_files(self.store, files, field)

    # ------------------------------------------------------------------ read side
    def exists(self, name: str) -> bool:
        return self.resolver.exists(name)

    def stored_name(self, name: str) -> str:
        """The stored model's full name for `name` (what delete unloads and removes): its manifest
        only, not its layers, so a model whose weights went missing can still be removed."""
        return self.resolver.stored_name(name)

    def resolve(self, name: str) -> ResolvedModel:
        """The stored model `name` names, kept while its files are unchanged; ModelDamaged or NotFound
        (resolver.py has the whole contract)."""
        return self.resolver.resolve(name)

    def list(self) -> list[ModelSummary]:
        return describe.list_models(self.store)

    def show(self, name: str) -> dict:
        """/api/show's answer. For a model whose files (weights, projector, adapter) are damaged, what its
        manifest and small layers say (the Modelfile, parameters, template, license...) with `damaged`: the
        error its use would be (no model_info from the GGUF, no capabilities); a damaged small layer or
        manifest is that ModelDamaged."""
        return describe.show(self.store, self.resolver, name)

    # ------------------------------------------------------------------ blobs (Ollama's /api/blobs)
    def has_blob(self, digest: str) -> bool:
        return self.store.has_blob(validate_digest(digest))

    def upload(self, digest: str) -> BlobUpload:
        """A blob to receive (Store.upload): for a create whose `files` will name it."""
        self.store.ensure()
        return self.store.upload(digest)

    # ------------------------------------------------------------------ copy / remove
    def copy(self, src: str, dst: str) -> None:
        s = self.resolver.find(parse_name(src))
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
        return self.store.gc(keep_newer_than=UPLOAD_KEEP_S)

    def remove(self, name: str) -> None:
        mn = parse_name(name)
        found = self.resolver.find(mn)
        self.store.delete_manifest(found)
        self.store.gc()


__all__ = ["Library"]
