"""The content-addressed store: blobs named by sha256, JSON manifests per name:tag.

Layout under the library root (settings().models_dir by default)::

    blobs/sha256-<hex>                          every file, named by its digest
    manifests/<host>/<namespace>/<model>/<tag>  one JSON manifest per model (Ollama's shape)
    views/<manifest hex>/<file name>            safetensors models: hard links to blobs under
                                                their original names (what resolve() returns)
    downloads/<40 hex>.partial                  partial downloads (resumable), never listed
    tmp/                                        temp files and directories on their way into
                                                blobs/, manifests/ and views/
    locks/                                      cross-process file locks

Every write goes to a temp file under tmp/ first and lands with os.replace, so a SIGKILL
leaves either the old state or the new one, plus a temp file that clean_temp() removes:
each temp is flock'ed by its writer for as long as it exists, and the kernel drops a
dead process's locks (a reused pid cannot fool this). Imported files are copied, never
linked: editing the user's file later cannot change a blob. Blob paths are built only
from digests that passed validate_digest; manifest paths only from validated ModelNames.

The store is made of parts, each in its own module: blobs.py (blobs/), manifests.py
(manifests/), scratch.py (tmp/ and locks/); this one holds the layout, the media types, the
views and garbage collection, and the one Store object the library uses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from localrun.errors import LocalrunError
from localrun.library.blobs import BlobUpload, Blobs, held_blobs
from localrun.library.disk_errors import storage_errors
from localrun.library.manifests import Manifests
from localrun.library.names import ModelName, validate_digest, validate_filename
from localrun.library.scratch import Scratch

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MT_MODEL = "application/vnd.ollama.image.model"  # a GGUF file
MT_FILE = "application/vnd.localrun.image.file"  # one file of a safetensors model
MT_TEMPLATE = "application/vnd.ollama.image.template"
MT_SYSTEM = "application/vnd.ollama.image.system"
MT_PARAMS = "application/vnd.ollama.image.params"
MT_MESSAGES = "application/vnd.ollama.image.messages"
MT_LICENSE = "application/vnd.ollama.image.license"
MT_ADAPTER = "application/vnd.ollama.image.adapter"
MT_PROJECTOR = "application/vnd.ollama.image.projector"  # a vision projector GGUF (architecture clip)


class Store:
    """The store under `root`: its directories, and its parts (blobs, manifests, scratch space) behind
    one object."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.views = self.root / "views"
        self.downloads = self.root / "downloads"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        self.scratch = Scratch(self.tmp, self.locks, self.ensure)
        self.blob_store = Blobs(self.blobs, self.scratch)
        self.manifest_store = Manifests(self.manifests, self.blob_store, self.scratch)

    def ensure(self) -> None:
        with storage_errors("create the model library"):
            for d in (self.blobs, self.manifests, self.views, self.downloads, self.tmp, self.locks):
                d.mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------- locks and temp files (scratch.py)
    def lock(self, key: str, cancel: threading.Event | None = None, on_wait: Callable[[], None] | None = None):
        return self.scratch.lock(key, cancel, on_wait)

    def temp_file(self) -> contextlib.AbstractContextManager[tuple[Path, BinaryIO]]:
        return self.scratch.temp_file()

    def temp_dir(self) -> contextlib.AbstractContextManager[Path]:
        return self.scratch.temp_dir()

    def clean_temp(self) -> int:
        return self.scratch.clean_temp()

    # ----------------------------------------------------------------- blobs (blobs.py)
    def pin(self, digest: str) -> None:
        self.blob_store.pin(digest)

    def unpin(self, digest: str) -> None:
        self.blob_store.unpin(digest)

    def blob_path(self, digest: str) -> Path:
        return self.blob_store.blob_path(digest)

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        return self.blob_store.has_blob(digest, size)

    def blob_problem(self, digest: str, size: int | None = None, filename: str | None = None) -> str | None:
        return self.blob_store.blob_problem(digest, size, filename)

    def adopt(self, tmp: Path, expected: str | None = None, *, what: str = "file",
              hashed: tuple[str, int] | None = None, check: Callable[[Path], None] | None = None,
              replace: bool = False) -> tuple[str, int]:
        return self.blob_store.adopt(tmp, expected, what=what, hashed=hashed, check=check, replace=replace)

    def upload(self, expected: str) -> BlobUpload:
        return self.blob_store.upload(expected)

    @staticmethod
    def claimed(digests) -> None:
        Blobs.claimed(digests)

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        return self.blob_store.put_bytes(data)

    def import_file(self, src: Path, *, shown: str, expected: str | None = None, what: str = "file",
                    progress: Callable[[int], None] | None = None,
                    check: Callable[[Path], None] | None = None, replace: bool = False) -> tuple[str, int]:
        return self.blob_store.import_file(src, shown=shown, expected=expected, what=what, progress=progress,
                                           check=check, replace=replace)

    def read_small(self, digest: str) -> bytes:
        return self.blob_store.read_small(digest)

    # ----------------------------------------------------------------- manifests (manifests.py)
    def manifest_path(self, name: ModelName) -> Path:
        return self.manifest_store.manifest_path(name)

    def read_manifest(self, name: ModelName) -> tuple[dict, str, float]:
        return self.manifest_store.read_manifest(name)

    def write_manifest(self, name: ModelName, manifest: dict) -> str:
        return self.manifest_store.write_manifest(name, manifest)

    def delete_manifest(self, name: ModelName) -> None:
        self.manifest_store.delete_manifest(name)

    def iter_manifests(self) -> Iterator[tuple[ModelName, Path]]:
        return self.manifest_store.iter_manifests()

    # ----------------------------------------------------------------- views
    def view_dir(self, manifest_digest: str, files: list[tuple[str, str]]) -> Path:
        """A directory of hard links (else symlinks) to blobs under their original names."""
        d = validate_digest(manifest_digest)
        target = self.views / d[len("sha256:"):]
        if target.is_dir():
            if all(_same_file(target / fn, self.blob_path(digest)) for fn, digest in files):
                return target
            # a blob was replaced (a pull repaired it): the old links still name the damaged files
            self.ensure()
            with self.temp_dir() as old, contextlib.suppress(OSError):
                os.rename(target, old / "view")  # the view goes whole; a reader holding a file keeps it
        self.ensure()
        with self.temp_dir() as tmp, storage_errors("prepare the model directory"):
            for fn, digest in files:
                src = self.blob_path(digest)
                dst = tmp / validate_filename(fn)
                try:
                    os.link(src, dst)
                except OSError:
                    os.symlink(src, dst)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise  # else another thread made it first; temp_dir removes ours
        return target

    # ----------------------------------------------------------------- gc
    def referenced(self) -> tuple[set[str], set[str]]:
        """(blob digests, manifest digests) referenced by some manifest."""
        blobs: set[str] = set()
        mdigests: set[str] = set()
        for name, _ in self.iter_manifests():
            try:
                m, mdigest, _ = self.read_manifest(name)
            except LocalrunError:
                continue
            mdigests.add(mdigest)
            for layer in m["layers"] + ([m["config"]] if m.get("config") else []):
                blobs.add(layer["digest"])
        return blobs, mdigests

    def gc(self, keep_newer_than: float | None = None) -> int:
        """Remove blobs and views no manifest references (and stale temp files); with
        `keep_newer_than` (seconds), an unreferenced blob written that recently stays (an upload a
        create may still name, from before a restart). Returns the number of bytes freed."""
        freed = 0
        with self.lock("gc"):
            refs, mdigests = self.referenced()
            pinned = held_blobs()
            if self.blobs.is_dir():
                for p in self.blobs.iterdir():
                    if not p.name.startswith("sha256-"):
                        continue
                    digest = "sha256:" + p.name[len("sha256-"):]
                    if digest in refs or digest in pinned:
                        continue
                    with contextlib.suppress(OSError):
                        st = p.stat()
                        if keep_newer_than is not None and time.time() - st.st_mtime < keep_newer_than:
                            continue
                        size = st.st_size
                        p.unlink()
                        freed += size
            if self.views.is_dir():
                for v in self.views.iterdir():
                    if v.name.startswith(".tmp-"):
                        if time.time() - _mtime(v) > 3600:
                            shutil.rmtree(v, ignore_errors=True)
                        continue
                    if "sha256:" + v.name not in mdigests:
                        shutil.rmtree(v, ignore_errors=True)
            self.clean_temp()
            if self.downloads.is_dir():  # partial downloads nobody resumed for a week
                for t in self.downloads.glob("*.partial"):
                    if time.time() - _mtime(t) > 7 * 86400:
                        with contextlib.suppress(OSError):
                            t.unlink()
        return freed


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _mtime(p: Path) -> float:
    try:
        st = p.lstat()
        return max(st.st_mtime, st.st_ctime)  # ctime: a fresh hard link keeps its source's old mtime
    except OSError:
        return time.time()
