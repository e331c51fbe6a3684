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
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from localrun.errors import InvalidRequest, LocalrunError, ModelDamaged, NotFound
from localrun.library.names import ModelName, parse_name, validate_digest, validate_filename
from localrun.library.paths import open_regular, reason

try:
    import fcntl
except ImportError:  # Windows: a file another process holds open cannot be deleted there
    fcntl = None  # type: ignore[assignment]

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

CHUNK = 1 << 20
MAX_SMALL_LAYER = 4 * 1024 * 1024  # template/system/params/... layers are read into memory

# Blobs that a pull or create in this process is about to reference: GC leaves them alone.
_pins: Counter = Counter()
_pins_lock = threading.Lock()
# Blobs uploaded here (POST /api/blobs) for a create still to come: digest -> when. GC leaves them
# alone for UPLOAD_KEEP_S (an Ollama client uploads every file, then sends one /api/create)
_uploads: dict[str, float] = {}
UPLOAD_KEEP_S = 3600.0


class DiskFull(LocalrunError):
    status = 507
    code = "disk_full"


class DamagedBlob(ModelDamaged):
    """A stored blob that is missing or does not hold what its name says. The library turns it into a
    ModelDamaged naming the model (this message names only the blob)."""

    def __init__(self, digest: str, problem: str):
        super().__init__(f"a file of this model (blob {short_blob(digest)}) {problem}; pull or create the model again")
        self.digest, self.problem = digest, problem


def short_blob(digest: str) -> str:
    """A blob as messages name it: its file name, cut (sha256-b179c9523d0e)."""
    return "sha256-" + str(digest).removeprefix("sha256:")[:12]


def disk_full_error(e: OSError, what: str) -> LocalrunError:
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return DiskFull(f"disk full: not enough space to {what}; free some space (e.g. `localrun rm` unused models) and try again")
    return LocalrunError(f"cannot {what}: {e.strerror or e}", status=500, code="storage_error")


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn OSErrors into LocalrunErrors (507 'disk full: ...' for ENOSPC)."""
    try:
        yield
    except LocalrunError:
        raise
    except OSError as e:
        raise disk_full_error(e, what) from None


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
            if progress:
                progress(n)
    return "sha256:" + h.hexdigest(), n


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _lock_nb(fd: int) -> bool:
    """Take an exclusive flock on fd without waiting; False when another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.views = self.root / "views"
        self.downloads = self.root / "downloads"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"

    def ensure(self) -> None:
        with storage_errors("create the model library"):
            for d in (self.blobs, self.manifests, self.views, self.downloads, self.tmp, self.locks):
                d.mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------- locks
    @contextlib.contextmanager
    def lock(self, key: str, cancel: threading.Event | None = None, on_wait: Callable[[], None] | None = None):
        """A cross-process (and cross-thread) exclusive lock named by key."""
        import filelock

        self.ensure()
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        lk = filelock.FileLock(str(self.locks / f"{name}.lock"))
        waited = False
        while True:
            try:
                lk.acquire(timeout=0.2)
                break
            except filelock.Timeout:
                if cancel is not None and cancel.is_set():
                    from localrun.library.model import Cancelled

                    raise Cancelled("pull cancelled") from None
                if not waited and on_wait:
                    on_wait()
                waited = True
        try:
            yield
        finally:
            lk.release()

    def pin(self, digest: str) -> None:
        with _pins_lock:
            _pins[digest] += 1

    def unpin(self, digest: str) -> None:
        with _pins_lock:
            _pins[digest] -= 1
            if _pins[digest] <= 0:
                del _pins[digest]

    # ----------------------------------------------------------------- blobs
    def blob_path(self, digest: str) -> Path:
        d = validate_digest(digest)
        return self.blobs / ("sha256-" + d[len("sha256:"):])

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        try:
            st = self.blob_path(digest).stat()
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def blob_problem(self, digest: str, size: int | None = None, filename: str | None = None) -> str | None:
        """Why the stored blob `digest` cannot be used as it is ("is missing from the store", "is 60000000
        bytes, not 98362432 (truncated?)", "is not a valid GGUF: ..."), or None when it can. `size`: the size
        it must have; `filename`: a *.gguf or *.safetensors file's header is checked too (bounded reads).
        The bytes are not hashed (gigabytes): a pull that finds a problem fetches the file again, and
        adopting it replaces the damaged one."""
        p = self.blob_path(digest)
        try:
            st = p.stat()
        except FileNotFoundError:
            return "is missing from the store"
        except OSError as e:
            return f"cannot be read ({reason(e)})"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if size is not None and st.st_size != size:
            return f"is {st.st_size} bytes, not {size} (truncated?)" if st.st_size < size else \
                f"is {st.st_size} bytes, not {size}"
        name = (filename or "").lower()
        try:
            if name.endswith(".gguf"):
                from localrun.library.gguf_info import read_gguf_info

                read_gguf_info(p, display_name="it")
            elif name.endswith(".safetensors"):
                from localrun.library.st_header import safetensors_header_params

                safetensors_header_params(p, "it")
        except InvalidRequest as e:  # "it is not a valid GGUF: ...", or "it: <why it cannot be opened>"
            return e.message.removeprefix("it ") if e.message.startswith("it is ") else \
                f"cannot be read ({e.message.removeprefix('it: ')})"
        return None

    # ----------------------------------------------------------------- temp files
    @contextlib.contextmanager
    def _tmp_gate(self, exclusive: bool) -> Iterator[None]:
        """Writers hold locks/tmp.gate shared while they create and lock a temp;
        clean_temp holds it exclusively, so it never sees a temp not yet locked."""
        if fcntl is None:
            yield
            return
        fd = os.open(self.locks / "tmp.gate", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def _owned_temp(self, directory: bool) -> tuple[Path, int]:
        """A new file or directory under tmp/ and an fd holding its flock."""
        self.ensure()
        with storage_errors("create a temp file in the model library"), self._tmp_gate(exclusive=False):
            path = self.tmp / uuid.uuid4().hex
            if directory:
                path.mkdir()
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            _lock_nb(fd)  # a brand-new inode: nobody else can hold it
        return path, fd

    @contextlib.contextmanager
    def temp_file(self) -> Iterator[tuple[Path, BinaryIO]]:
        """A new file under tmp/, open for writing and owned (locked) by this process until
        the block ends; removed then, unless it was moved into the store (adopt)."""
        path, fd = self._owned_temp(directory=False)
        f = os.fdopen(fd, "w+b")
        try:
            yield path, f
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # still holding the lock: clean_temp never races this
            f.close()

    @contextlib.contextmanager
    def temp_dir(self) -> Iterator[Path]:
        """Like temp_file, for a directory (views are built in one, then renamed)."""
        path, fd = self._owned_temp(directory=True)
        try:
            yield path
        finally:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            os.close(fd)

    def clean_temp(self) -> int:
        """Remove what a killed process left under tmp/: every temp file or directory
        whose lock nobody holds. Temps of live writers (this process's included) stay, and
        so do partial downloads (downloads/*.partial, resumed by the next pull). Returns
        how many entries it removed."""
        if not self.tmp.is_dir():
            return 0
        removed = 0
        self.ensure()
        with self._tmp_gate(exclusive=True):
            for p in list(self.tmp.iterdir()):
                removed += self._remove_unowned(p)
        return removed

    @staticmethod
    def _remove_unowned(p: Path) -> bool:
        try:
            st = p.lstat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                p.unlink()  # a link or a FIFO: never ours to keep
                return True
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            if not _lock_nb(fd):
                return False  # a live process is writing it
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p)
            else:
                p.unlink()
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- blobs in
    def adopt(self, tmp: Path, expected: str | None = None, *, what: str = "file",
              hashed: tuple[str, int] | None = None, check: Callable[[Path], None] | None = None,
              replace: bool = False) -> tuple[str, int]:
        """Hash tmp, check it against expected, and move it into blobs/ atomically.

        The hash is checked BEFORE the move; on a mismatch tmp is removed and nothing
        in the store changes. tmp must be on the store's filesystem. A stored blob of that
        digest is kept when it has the right size and passes `check`, unless `replace` (the
        caller found it damaged); else tmp takes its place in one rename, so the name never
        holds a partial file.
        """
        try:
            digest, size = hashed or sha256_file(tmp)
            if expected is not None and digest != validate_digest(expected):
                raise LocalrunError(
                    f"sha256 mismatch for {what}: expected {expected}, got {digest}; the download was discarded, "
                    "pull again (if it keeps failing the source is corrupt)",
                    status=502, code="digest_mismatch",
                )
            if check is not None:
                check(tmp)  # e.g. GGUF validation: nothing invalid reaches blobs/
            dst = self.blob_path(digest)
            keep = not replace and self.has_blob(digest, size)
            if keep and check is not None:
                try:
                    check(dst)  # the stored copy passes what the new one passed, or the new one replaces it
                except Exception:  # noqa: BLE001 - a damaged stored copy, whatever the check raises for it
                    keep = False
            with storage_errors(f"store {what}"):
                if keep:
                    tmp.unlink()
                else:
                    os.replace(tmp, dst)
                    _fsync_dir(self.blobs)
            return digest, size
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def upload(self, expected: str) -> "BlobUpload":
        """A blob a client sends (Ollama's POST /api/blobs/<digest>): written to a temp file and
        hashed as it arrives, moved into blobs/ by finish() only when its sha256 is `expected`."""
        return BlobUpload(self, validate_digest(expected))

    @staticmethod
    def claimed(digests) -> None:
        """Uploads a manifest now names: GC treats them like any other blob from here on."""
        with _pins_lock:
            for d in digests:
                _uploads.pop(d, None)

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        """A small layer (template, parameters, config, ...) stored; one already stored is compared byte for
        byte (a few KiB), and replaced when it differs, so a pull or create repairs a damaged one."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self._holds(digest, data):
            with self.temp_file() as (tmp, f):
                with storage_errors("write a layer"):
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self.adopt(tmp, digest, hashed=(digest, len(data)), replace=True)
        return digest, len(data)

    def _holds(self, digest: str, data: bytes) -> bool:
        if not self.has_blob(digest, len(data)):
            return False
        try:
            return self.blob_path(digest).read_bytes() == data
        except OSError:
            return False

    def import_file(self, src: Path, *, shown: str, expected: str | None = None, what: str = "file",
                    progress: Callable[[int], None] | None = None,
                    check: Callable[[Path], None] | None = None, replace: bool = False) -> tuple[str, int]:
        """Copy a user's file into the store: streamed into a temp file under tmp/ and
        hashed on the way, the copy checked (check, e.g. GGUF validation) and only then
        moved into blobs/. Never a hard link: the user editing or deleting src later
        cannot change a blob, and what was validated is what is stored. At most the size
        src had when opened is copied. `shown` names src in errors (InvalidRequest).
        With `expected`, a stored blob of that digest and src's size is taken as it is (no
        copy); one of another size is damaged (truncated) and is replaced, as it is with
        `replace` (the caller found it damaged otherwise)."""
        fsrc, limit = open_regular(src, shown)
        with fsrc:
            if expected is not None and not replace and self.has_blob(expected, limit):
                return validate_digest(expected), limit
            return self._copy_in(fsrc, limit, shown, expected, what, progress, check, replace)

    def _copy_in(self, fsrc: BinaryIO, limit: int, shown: str, expected: str | None, what: str,
                 progress: Callable[[int], None] | None, check: Callable[[Path], None] | None,
                 replace: bool) -> tuple[str, int]:
        with self.temp_file() as (tmp, f):
            h = hashlib.sha256()
            n = 0
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while n < limit:
                try:
                    got = fsrc.readinto(view[: min(CHUNK, limit - n)])
                except OSError as e:
                    raise InvalidRequest(f"{shown}: {reason(e)}") from None
                if not got:
                    break
                with storage_errors(f"store {what}"):
                    f.write(view[:got])
                h.update(view[:got])
                n += got
                if progress:
                    progress(n)
            with storage_errors(f"store {what}"):
                f.flush()
                os.fsync(f.fileno())
            return self.adopt(tmp, expected, what=what, hashed=("sha256:" + h.hexdigest(), n), check=check,
                              replace=replace)

    def read_small(self, digest: str) -> bytes:
        """A small layer's bytes (template, parameters, config, ...), checked against its digest (a few KiB
        hashed); DamagedBlob when it is missing, too large or not what its name says."""
        p = self.blob_path(digest)
        try:
            st = p.stat()
            if st.st_size > MAX_SMALL_LAYER:
                raise DamagedBlob(digest, f"is too large for a layer ({st.st_size} bytes)")
            data = p.read_bytes()
        except FileNotFoundError:
            raise DamagedBlob(digest, "is missing from the store") from None
        except OSError as e:
            raise DamagedBlob(digest, f"cannot be read ({reason(e)})") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != validate_digest(digest):
            raise DamagedBlob(digest, "does not hold the bytes its digest names (damaged)")
        return data

    # ----------------------------------------------------------------- manifests
    def manifest_path(self, name: ModelName) -> Path:
        return self.manifests.joinpath(*name.parts)

    def read_manifest(self, name: ModelName) -> tuple[dict, str, float]:
        p = self.manifest_path(name)
        try:
            raw = p.read_bytes()
            mtime = p.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"model '{name.display}' not found; pull it with `localrun pull {name.display}`") from None
        try:
            m = json.loads(raw)
            layers = m["layers"]
            for layer in layers + ([m["config"]] if m.get("config") else []):
                validate_digest(layer["digest"])
                if "filename" in layer:
                    validate_filename(layer["filename"])
        except (ValueError, KeyError, TypeError, LocalrunError):
            raise ModelDamaged(f"model '{name.display}' is damaged: its manifest is corrupt; remove it with "
                               f"`localrun rm {name.display}`, then pull or create it again") from None
        return m, "sha256:" + hashlib.sha256(raw).hexdigest(), mtime

    def write_manifest(self, name: ModelName, manifest: dict) -> str:
        data = json.dumps(manifest, indent=2, sort_keys=False).encode()
        for layer in manifest["layers"]:
            if not self.has_blob(layer["digest"]):
                raise LocalrunError(f"cannot write manifest of {name.display}: blob {layer['digest'][:19]} is missing",
                                    status=500, code="storage_error")
        path = self.manifest_path(name)
        with self.temp_file() as (tmp, f), storage_errors(f"write the manifest of {name.display}"):
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def delete_manifest(self, name: ModelName) -> None:
        p = self.manifest_path(name)
        try:
            p.unlink()
        except FileNotFoundError:
            raise NotFound(f"model '{name.display}' not found") from None
        # prune empty parent directories up to manifests/
        parent = p.parent
        while parent != self.manifests and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def iter_manifests(self) -> Iterator[tuple[ModelName, Path]]:
        if not self.manifests.is_dir():
            return
        for host in sorted(self.manifests.iterdir()):
            for ns in sorted(_dirs(host)):
                for model in sorted(_dirs(ns)):
                    for tag in sorted(model.iterdir()):
                        if tag.name.startswith(".") or not tag.is_file():
                            continue
                        text = (f"hf.co/{ns.name}/{model.name}:{tag.name}" if host.name == "hf.co"
                                else f"{ns.name}/{model.name}:{tag.name}")
                        try:
                            name = parse_name(text)
                        except LocalrunError:
                            continue
                        if name.parts != (host.name, ns.name, model.name, tag.name):
                            continue
                        yield name, tag

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
            with _pins_lock:
                pinned = set(_pins)
                now = time.monotonic()
                for d, t in list(_uploads.items()):
                    if now - t > UPLOAD_KEEP_S:
                        del _uploads[d]
                pinned |= set(_uploads)
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


class BlobUpload:
    """One upload into the store (:meth:`Store.upload`): ``write`` each piece as it comes, then
    ``finish`` (hash checked, then moved into blobs/) or ``close`` (the temp file goes). Nothing
    reaches blobs/ unless its sha256 is the one the client named."""

    def __init__(self, store: Store, expected: str) -> None:
        self.store, self.expected = store, expected
        self._ctx = store.temp_file()
        self.tmp, self.f = self._ctx.__enter__()
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        with storage_errors("store the uploaded file"):
            self.f.write(data)
        self.h.update(data)
        self.size += len(data)

    def finish(self) -> tuple[str, int]:
        got = "sha256:" + self.h.hexdigest()
        if got != self.expected:
            raise InvalidRequest(f"the uploaded file's sha256 is {got}, not {self.expected} as the URL says: "
                                 "it was discarded; send the file again (its digest is sha256 of its bytes)")
        with storage_errors("store the uploaded file"):
            self.f.flush()
            os.fsync(self.f.fileno())
        digest, size = self.store.adopt(self.tmp, got, what="uploaded file", hashed=(got, self.size))
        with _pins_lock:
            _uploads[digest] = time.monotonic()
        return digest, size

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _dirs(p: Path) -> list[Path]:
    try:
        return [c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")]
    except OSError:
        return []


def _mtime(p: Path) -> float:
    try:
        st = p.lstat()
        return max(st.st_mtime, st.st_ctime)  # ctime: a fresh hard link keeps its source's old mtime
    except OSError:
        return time.time()
