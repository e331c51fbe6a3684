"""Blobs: the store's files, each named by the sha256 of its bytes — paths, checks, intake, uploads and pins.

Blob paths are built only from digests that passed validate_digest. Nothing reaches blobs/ but
through a temp file (scratch.py) whose hash was checked first, moved in with one rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Callable

from localrun.errors import InvalidRequest, LocalrunError, ModelDamaged
from localrun.library.disk_errors import storage_errors
from localrun.library.names import validate_digest
from localrun.library.paths import open_regular, reason
from localrun.library.scratch import Scratch, fsync_dir

CHUNK = 1 << 20
MAX_SMALL_LAYER = 4 * 1024 * 1024  # template/system/params/... layers are read into memory

# Blobs that a pull or create in this process is about to reference: GC leaves them alone.
_pins: Counter = Counter()
_pins_lock = threading.Lock()
# Blobs uploaded here (POST /api/blobs) for a create still to come: digest -> when. GC leaves them
# alone for UPLOAD_KEEP_S (an Ollama client uploads every file, then sends one /api/create)
_uploads: dict[str, float] = {}
UPLOAD_KEEP_S = 3600.0


class DamagedBlob(ModelDamaged):
    """A stored blob that is missing or does not hold what its name says. The library turns it into a
    ModelDamaged naming the model (this message names only the blob)."""

    def __init__(self, digest: str, problem: str):
        super().__init__(f"a file of this model (blob {short_blob(digest)}) {problem}; pull or create the model again")
        self.digest, self.problem = digest, problem


def short_blob(digest: str) -> str:
    """A blob as messages name it: its file name, cut (sha256-b179c9523d0e)."""
    return "sha256-" + str(digest).removeprefix("sha256:")[:12]


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



def held_blobs() -> set[str]:
    """Blobs GC must leave alone: those pinned in this process, and uploads younger than UPLOAD_KEEP_S
    (older ones are forgotten here)."""
    with _pins_lock:
        pinned = set(_pins)
        now = time.monotonic()
        for d, t in list(_uploads.items()):
            if now - t > UPLOAD_KEEP_S:
                del _uploads[d]
        pinned |= set(_uploads)
    return pinned


class Blobs:
    """blobs/ of a store: `scratch` holds the temp files blobs come in through."""

    def __init__(self, blobs: Path, scratch: Scratch):
        self.blobs, self.scratch = blobs, scratch

    def pin(self, digest: str) -> None:
        with _pins_lock:
            _pins[digest] += 1

    def unpin(self, digest: str) -> None:
        with _pins_lock:
            _pins[digest] -= 1
            if _pins[digest] <= 0:
                del _pins[digest]

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
                    fsync_dir(self.blobs)
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
            with self.scratch.temp_file() as (tmp, f):
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
        with self.scratch.temp_file() as (tmp, f):
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


class BlobUpload:
    """One upload into the store (:meth:`Blobs.upload`): ``write`` each piece as it comes, then
    ``finish`` (hash checked, then moved into blobs/) or ``close`` (the temp file goes). Nothing
    reaches blobs/ unless its sha256 is the one the client named."""

    def __init__(self, blobs: Blobs, expected: str) -> None:
        self.blobs, self.expected = blobs, expected
        self._ctx = blobs.scratch.temp_file()
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
        digest, size = self.blobs.adopt(self.tmp, got, what="uploaded file", hashed=(got, self.size))
        with _pins_lock:
            _uploads[digest] = time.monotonic()
        return digest, size

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

