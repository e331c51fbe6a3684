"""Downloads from the Hugging Face hub, through huggingface-hub's own HTTP layer.

huggingface-hub 2.x no longer keeps partial files between calls of hf_hub_download,
so the transfer itself is driven here with its building blocks: ``model_info``
(listing a repo's files with sizes and LFS sha256), ``get_hf_file_metadata`` (the HEAD
with X-Repo-Commit / ETag / X-Linked-Size) and ``http_get`` (the GET, with Range
resume and its own retries). What this module adds:

- a partial file per (file, expected digest) under downloads/, kept across failures,
  cancels and SIGKILLs, and resumed with HTTP Range by the next pull;
- a cross-process lock per file, so two pulls of one model do one transfer;
- the sha256 (or, for small non-LFS files, the git blob id) checked BEFORE the file
  moves into blobs/; a mismatch removes the partial file and stores nothing;
- progress events about four times a second, and cancellation via threading.Event.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localrun.errors import InvalidRequest, LocalrunError, NotFound
from localrun.library.model import Cancelled, PullEvent
from localrun.library.names import validate_digest, validate_filename
from localrun.library.disk_errors import disk_full_error
from localrun.library.store import Store

DEFAULT_ENDPOINT = "https://huggingface.co"
METADATA_TIMEOUT = 10.0
PROGRESS_INTERVAL = 0.25
# http_get writes (and reports, and can be cancelled) once per chunk; huggingface-hub's
# default is 10 MiB, which loses up to 10 MiB on a dropped connection. 1 MiB instead.
CHUNK_SIZE = 1 << 20

# Files of a safetensors model repo that localrun keeps (never pickles: no .bin/.pt/.pth).
SAFETENSORS_KEEP = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
}
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)


class HubUnreachable(LocalrunError):
    status = 502
    code = "hub_unreachable"


@dataclass
class RemoteFile:
    filename: str
    size: int | None
    sha256: str | None  # "sha256:<hex>" for LFS files
    git_oid: str | None  # git blob id (sha1) for small files


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def _transport_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod in ("httpx2", "httpx"):
        try:
            m = __import__(mod)
            errs.append(m.TransportError)
        except (ImportError, AttributeError):
            pass
    try:
        import requests

        errs.append(requests.exceptions.RequestException)
    except ImportError:
        pass
    return tuple(errs)


def _hub_error(e: BaseException, repo: str, filename: str | None = None) -> LocalrunError:
    """Map huggingface-hub / transport errors to LocalrunErrors users can act on."""
    from huggingface_hub import errors as hfe

    ep = hub_endpoint()
    what = f"{repo}/{filename}" if filename else repo
    if isinstance(e, hfe.GatedRepoError):
        return LocalrunError(f"{repo} is gated on the Hugging Face hub: accept its license on the hub and set HF_TOKEN",
                             status=403, code="gated_repo")
    if isinstance(e, hfe.RepositoryNotFoundError):
        return NotFound(f"repository {repo} not found on the Hugging Face hub ({ep}); check the name (and HF_TOKEN for private repos)")
    if isinstance(e, (hfe.RemoteEntryNotFoundError, hfe.EntryNotFoundError)):
        return NotFound(f"file {what} not found on the Hugging Face hub")
    if isinstance(e, hfe.RevisionNotFoundError):
        return NotFound(f"revision of {repo} not found on the Hugging Face hub")
    if isinstance(e, hfe.HfHubHTTPError):
        code = getattr(getattr(e, "response", None), "status_code", None)
        if code == 404:
            return NotFound(f"{what} not found on the Hugging Face hub ({ep})")
        return LocalrunError(f"the Hugging Face hub answered HTTP {code} for {what}; try the pull again later",
                             status=502, code="hub_error")
    if isinstance(e, _transport_errors()):
        return HubUnreachable(f"cannot reach the Hugging Face hub at {ep} ({type(e).__name__}); check your network or HF_ENDPOINT "
                              f"and pull again: finished parts are kept and resumed")
    if isinstance(e, OSError):
        return disk_full_error(e, f"download {what}")
    return LocalrunError(f"download of {what} failed: {e}", status=502, code="hub_error")


class Progress:
    """Turns byte counts into throttled PullEvents and checks for cancellation."""

    def __init__(self, callback: Callable[[PullEvent], None] | None, cancel: threading.Event | None):
        self.callback = callback
        self.cancel = cancel

    def emit(self, status: str, digest: str | None = None, total: int | None = None, completed: int | None = None,
             *, check: bool = True) -> None:
        if check:
            self.check()
        if self.callback is not None:
            self.callback(PullEvent(status, digest, total, completed))

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("pull cancelled; nothing was installed (a later pull resumes the download)")

    def counter(self, status: str, digest: str | None, total: int | None) -> Callable[[int], None]:
        """A callback taking a running byte count (hashing, copying), throttled to ~4 events/s."""
        last = [0.0]

        def update(done: int) -> None:
            self.check()
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL or (total and done >= total):
                last[0] = now
                if self.callback is not None:
                    self.callback(PullEvent(status, digest, total, done))

        return update

    def bar_class(self, status: str, digest: str | None, total: int | None):
        """A tqdm stand-in for huggingface-hub's http_get: reports progress, raises on cancel."""
        outer = self

        class Bar:
            def __init__(self, *args, total=None, initial=0, **kwargs):
                self.total = total if total is not None else outer_total
                self.n = initial or 0
                self.last = 0.0
                outer.emit(status, digest, self.total, self.n)

            def update(self, n=1):
                self.n += n
                outer.check()
                now = time.monotonic()
                if now - self.last >= PROGRESS_INTERVAL or (self.total and self.n >= self.total):
                    self.last = now
                    if outer.callback is not None:
                        outer.callback(PullEvent(status, digest, self.total, self.n))

            def close(self):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        outer_total = total
        return Bar


class Hub:
    """One repo on the hub (or on HF_ENDPOINT)."""

    def __init__(self, repo_id: str):
        if hub_offline():
            raise HubUnreachable(f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded; unset it or pull a model you already have")
        self.repo_id = repo_id
        self.endpoint = hub_endpoint()
        self.commit: str | None = None

    def list_files(self) -> list[RemoteFile]:
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint).model_info(self.repo_id, files_metadata=True, timeout=METADATA_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - mapped to a user-facing error
            raise _hub_error(e, self.repo_id) from None
        self.commit = info.sha
        out = []
        for s in info.siblings or []:
            sha = None
            if s.lfs is not None and isinstance(s.lfs.get("sha256") if isinstance(s.lfs, dict) else getattr(s.lfs, "sha256", None), str):
                raw = s.lfs["sha256"] if isinstance(s.lfs, dict) else s.lfs.sha256
                with contextlib.suppress(InvalidRequest):
                    sha = validate_digest("sha256:" + raw)
            out.append(RemoteFile(s.rfilename, s.size, sha, s.blob_id if sha is None else None))
        return out

    def download(self, store: Store, rf: RemoteFile, progress: Progress,
                 check: Callable[[Path], None] | None = None) -> tuple[str, int]:
        """Fetch one file into blobs/ (resuming a partial one); returns (digest, size)."""
        from huggingface_hub import constants as hf_constants
        from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url, http_get
        from huggingface_hub.utils import build_hf_headers

        if getattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 0) > CHUNK_SIZE:
            hf_constants.DOWNLOAD_CHUNK_SIZE = CHUNK_SIZE
        validate_filename(rf.filename)
        key = f"{self.repo_id}/{rf.filename}@{rf.sha256 or rf.git_oid or self.commit}"
        short = (rf.sha256 or "")[7:19]
        status = f"pulling {short}" if short else f"pulling {rf.filename}"
        with store.lock("download:" + key, progress.cancel,
                        on_wait=lambda: progress.emit(f"waiting for another pull of {rf.filename}", rf.sha256)):
            damaged = None
            if rf.sha256:
                # a stored copy is taken only whole (its size, its header): a truncated or damaged one (a disk
                # error, a crash of another tool) is downloaded again and replaced, never kept
                damaged = store.blob_problem(rf.sha256, rf.size, rf.filename)
                if damaged is None:
                    progress.emit(status, rf.sha256, rf.size, rf.size)
                    return rf.sha256, store.blob_path(rf.sha256).stat().st_size
                if store.blob_path(rf.sha256).exists():
                    progress.emit(f"the stored copy of {rf.filename} {damaged}: downloading it again", rf.sha256)
                else:
                    damaged = None
            store.ensure()
            partial = store.downloads / (hashlib.sha256(key.encode()).hexdigest()[:40] + ".partial")
            url = hf_hub_url(self.repo_id, rf.filename, revision=self.commit, endpoint=self.endpoint)
            headers = build_hf_headers()
            try:
                meta = get_hf_file_metadata(url, timeout=METADATA_TIMEOUT, headers=headers, endpoint=self.endpoint)
            except Exception as e:  # noqa: BLE001
                raise _hub_error(e, self.repo_id, rf.filename) from None
            size = meta.size if meta.size is not None else rf.size
            expected = rf.sha256
            if expected is None and meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag):
                expected = "sha256:" + meta.etag
            location = meta.location or url
            if location != url and headers.get("authorization"):
                from urllib.parse import urlsplit

                if urlsplit(location).hostname != urlsplit(url).hostname:
                    headers.pop("authorization", None)
            try:
                fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
                with os.fdopen(fd, "r+b") as f:
                    resume = f.seek(0, os.SEEK_END)
                    if size is not None and resume > size:
                        f.truncate(0)
                        f.seek(0)
                        resume = 0
                    if size is None or resume < size:
                        bar = progress.bar_class(status, expected, size)
                        http_get(location, f, resume_size=resume, headers=headers, expected_size=size, tqdm_class=bar,
                                 displayed_filename=rf.filename)
                    else:
                        progress.emit(status, expected, size, size)
                    f.flush()
                    os.fsync(f.fileno())
            except LocalrunError:
                raise
            except Exception as e:  # noqa: BLE001
                if isinstance(e, OSError) and "Consistency check failed" in str(e):
                    with contextlib.suppress(OSError):
                        partial.unlink()
                    raise LocalrunError(f"download of {rf.filename} ended early or ran long ({e}); pull again",
                                        status=502, code="hub_error") from None
                raise _hub_error(e, self.repo_id, rf.filename) from None
            progress.emit("verifying sha256 digest", expected)
            total = partial.stat().st_size
            sha, sha1 = _hash_with_git(partial, progress.counter("verifying sha256 digest", expected, total))
            got = ("sha256:" + sha.hexdigest(), partial.stat().st_size)
            if expected is None and rf.git_oid and sha1 != rf.git_oid:
                with contextlib.suppress(OSError):
                    partial.unlink()
                raise LocalrunError(f"{rf.filename}: the received bytes do not match the hub's git blob id; "
                                    "the download was discarded, pull again", status=502, code="digest_mismatch")
            if check is not None and (expected is None or got[0] == expected):
                try:
                    check(partial)
                except BaseException:
                    with contextlib.suppress(OSError):
                        partial.unlink()
                    raise
            return store.adopt(partial, expected, what=rf.filename, hashed=got, replace=damaged is not None)


def _hash_with_git(path: Path, progress: Callable[[int], None] | None = None) -> tuple["hashlib._Hash", str]:
    """sha256 of the file, and its git blob id (sha1 of 'blob <size>\\0' + bytes)."""
    size = path.stat().st_size
    sha = hashlib.sha256()
    sha1 = hashlib.sha1(f"blob {size}\0".encode())
    done = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            sha.update(b)
            sha1.update(b)
            done += len(b)
            if progress is not None:
                progress(done)
    return sha, sha1.hexdigest()


def choose_gguf(files: list[RemoteFile], quant: str | None, repo: str) -> RemoteFile:
    """The GGUF whose name carries the quant tag (Q4_K_M, q8_0, IQ4_XS, ...)."""
    ggufs = [f for f in files if f.filename.lower().endswith(".gguf") and "/" not in f.filename
             and "mmproj" not in f.filename.lower()]
    if not ggufs:
        raise NotFound(f"{repo} has no GGUF files on the hub; pull hf.co/{repo} (no tag) for safetensors")
    if quant is None:
        for pref in ("Q4_K_M", "Q4_0", "Q8_0"):
            with contextlib.suppress(NotFound):
                return choose_gguf(files, pref, repo)
        singles = [f for f in ggufs if not _SPLIT_GGUF.search(f.filename)]
        if singles:
            return sorted(singles, key=lambda f: f.filename)[0]
        raise InvalidRequest(f"{repo} only has split GGUF files, which localrun cannot load yet")
    pat = re.compile(rf"(?<![A-Z0-9]){re.escape(quant.upper())}(?![A-Z0-9])")
    hits = [f for f in ggufs if pat.search(f.filename.upper())]
    singles = [f for f in hits if not _SPLIT_GGUF.search(f.filename)]
    if singles:
        return sorted(singles, key=lambda f: len(f.filename))[0]
    if hits:
        raise InvalidRequest(f"{repo}: the {quant} GGUF is split into parts, which localrun cannot load yet; pick another quant")
    quants = sorted({q for f in ggufs for q in [quant_of(f.filename)] if q})
    raise NotFound(f"{repo} has no {quant} GGUF; available: {', '.join(quants) or ', '.join(f.filename for f in ggufs)}")


_QUANT = re.compile(r"(?<![A-Z0-9])(I?Q\d[A-Z0-9_]*|BF16|F16|F32)(?![A-Z0-9])")


def quant_of(filename: str) -> str | None:
    """The quant tag a GGUF's file name carries (Q4_K_M, Q8_0, IQ4_XS, F16, BF16, F32), upper-case."""
    m = _QUANT.search(filename.upper())
    return m.group(1) if m else None


def _precision_family(quant: str | None) -> str | None:
    if quant in ("BF16", "F16", "F32"):
        return quant
    if quant and (quant.startswith("Q") or quant.startswith("IQ")):
        return "Q"
    return None


def choose_projector(files: list[RemoteFile], model_file: str) -> RemoteFile | None:
    """The vision projector (an mmproj-*.gguf beside the model) to pull with ``model_file``: the one of
    the model's own quant, else of its precision family (BF16, F16, F32, or quantized), else F16, else
    the first by name. None when the repo ships no projector."""
    projs = sorted((f for f in files if "/" not in f.filename and f.filename.lower().endswith(".gguf")
                    and "mmproj" in f.filename.lower() and not _SPLIT_GGUF.search(f.filename)),
                   key=lambda f: f.filename)
    if not projs:
        return None
    quant = quant_of(model_file)
    by_quant = [(quant_of(f.filename), f) for f in projs]
    for q, f in by_quant:
        if quant is not None and q == quant:
            return f
    fam = _precision_family(quant)
    for q, f in by_quant:
        if fam is not None and _precision_family(q) == fam:
            return f
    for q, f in by_quant:
        if q == "F16":
            return f
    return projs[0]


def kept_safetensors_file(name: str) -> bool:
    """A file localrun keeps of a safetensors model (the hub's, a directory's, uploaded ones): the
    weights and their index, config.json, the tokenizer's and chat template's files."""
    return name in SAFETENSORS_KEEP or name.endswith((".safetensors", ".safetensors.index.json"))


def is_safetensors_model(names) -> bool:
    """The kept file names make a model: config.json and at least one *.safetensors."""
    names = set(names)
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def choose_safetensors(files: list[RemoteFile], repo: str) -> list[RemoteFile]:
    top = [f for f in files if "/" not in f.filename]
    keep = [f for f in top if kept_safetensors_file(f.filename)]
    if not is_safetensors_model(f.filename for f in keep):
        raise NotFound(f"{repo} has no safetensors model (config.json + *.safetensors) on the hub")
    return sorted(keep, key=lambda f: f.filename)


__all__ = ["Hub", "HubUnreachable", "Progress", "RemoteFile", "choose_gguf", "choose_projector", "choose_safetensors",
           "hub_endpoint", "hub_offline", "is_safetensors_model", "kept_safetensors_file", "quant_of"]
