"""The prompt cache on disk: a long prompt's computed state (llama.cpp: its sequence's KV cells), kept across
daemon restarts and evictions.

One folder (``$LOCALRUN_HOME/prompt-cache``) holds the entries of every model; an entry is one file,
``<key id>-<tokens id>.lrpc``, where the key id is a hash of what makes a state loadable (the model's digest,
the backend, its build, the KV cache type, an adapter) and the tokens id a hash of the token prefix. A file is

    MAGIC (8) | version u32 | key length u32 | key (JSON) | token count u32 | tokens (int32 each)
    | payload length u64 | payload | blake2b-32 of everything before it

It is written to a unique temporary name and renamed into place (atomic: a reader sees a whole file or
none), so two daemons on one home never see each other's half-written files. Reading checks the magic, the
version, the key, the length and the checksum: a truncated, corrupt or foreign file is removed (one warning
a file) and never loaded. The folder is bounded by ``LOCALRUN_PROMPT_CACHE_DISK`` bytes, least recently used
first (a hit touches its file's mtime); files that vanish under another daemon's eviction are skipped.

:class:`PromptDisk` is one model's view of the folder: an index of its entries' token prefixes (read from
the headers at load), ``best`` (the entry sharing the longest prefix with a prompt), ``read`` and ``save``
(queued to a writer thread of its own: the caller never waits for the disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("localrun.prompt_cache")

MAGIC = b"LRPCACHE"
VERSION = 1
SUFFIX = ".lrpc"
SUM_BYTES = 32
MAX_KEY_BYTES = 1 << 16
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old is a killed writer's: removed
MAX_PENDING_BYTES = 2 << 30  # states queued for the writer at most (more are dropped, not queued)


def key_id(key: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()


def tokens_id(tokens: np.ndarray) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=10).hexdigest()


class BadEntry(Exception):
    """A file that is not a whole entry of this key (truncated, corrupt, another version or model)."""


def encode(key: dict[str, Any], tokens: np.ndarray, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """An entry's bytes, as the pieces written one after another."""
    kb = json.dumps(key, sort_keys=True).encode()
    toks = np.asarray(tokens, dtype="<i4").tobytes()
    head = (MAGIC + struct.pack("<II", VERSION, len(kb)) + kb + struct.pack("<I", len(tokens)) + toks
            + struct.pack("<Q", len(payload)))
    h = hashlib.blake2b(digest_size=SUM_BYTES)
    h.update(head)
    h.update(payload)
    return [head, payload, h.digest()]


def read_header(f, key: dict[str, Any], size: int) -> tuple[np.ndarray, int, int]:
    """(tokens, payload offset, payload length) of an open entry file of `size` bytes; BadEntry unless its
    header is this key's and its length is the header's."""
    fixed = f.read(16)
    if len(fixed) < 16 or fixed[:8] != MAGIC:
        raise BadEntry("not a prompt cache file")
    version, klen = struct.unpack("<II", fixed[8:])
    if version != VERSION:
        raise BadEntry(f"version {version}, not {VERSION}")
    if klen > MAX_KEY_BYTES:
        raise BadEntry("a key too long")
    kb = f.read(klen)
    try:
        theirs = json.loads(kb)
    except ValueError:
        raise BadEntry("an unreadable key") from None
    if theirs != json.loads(json.dumps(key, sort_keys=True)):
        raise BadEntry("another model's or build's")
    raw = f.read(4)
    if len(raw) < 4:
        raise BadEntry("truncated")
    (n,) = struct.unpack("<I", raw)
    if 16 + klen + 4 + 4 * n + 8 > size:
        raise BadEntry("truncated")
    toks = np.frombuffer(f.read(4 * n), dtype="<i4").astype(np.int32)
    (plen,) = struct.unpack("<Q", f.read(8))
    offset = 16 + klen + 4 + 4 * n + 8
    if offset + plen + SUM_BYTES != size:
        raise BadEntry(f"{size} bytes, not the {offset + plen + SUM_BYTES} its header says (truncated)")
    return toks, offset, plen


@dataclass
class Entry:
    path: Path
    tokens: np.ndarray
    size: int


class PromptDisk:
    """One model's entries in `root` (see the module docstring). `limit` bounds the whole folder in bytes;
    prompts shorter than `min_tokens` are not saved."""

    def __init__(self, root: Path, key: dict[str, Any], *, limit: int, min_tokens: int, name: str = "") -> None:
        self.root, self.key, self.limit, self.min_tokens, self.name = Path(root), key, limit, min_tokens, name
        self.kid = key_id(key)
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        self.counters = dict(disk_hits=0, disk_misses=0, disk_read_bytes=0, disk_written_bytes=0,
                             disk_restored_tokens=0, disk_saved=0, disk_bad_files=0, disk_entries=0)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name=f"prompt-disk-{name}", daemon=True)
        self._writer.start()

    # -- the index ----------------------------------------------------------------------------------
    def _scan(self) -> None:
        now = time.time()
        for p in self.root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):  # a killed writer's (any model's)
                try:
                    if now - p.stat().st_mtime > STALE_TEMP_SECONDS:
                        p.unlink()
                except OSError:
                    pass
                continue
            if not (p.name.startswith(self.kid + "-") and p.name.endswith(SUFFIX)):
                continue
            try:
                with open(p, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    toks, _, _ = read_header(f, self.key, size)
            except FileNotFoundError:
                continue
            except (BadEntry, OSError, struct.error) as exc:
                self._bad(p, str(exc))
                continue
            self.entries.append(Entry(p, toks, size))
        self.counters["disk_entries"] = len(self.entries)
        if self.entries:
            log.info("%s: prompt cache on disk: %d saved prompt(s) of up to %d tokens in %s", self.name,
                     len(self.entries), max(len(e.tokens) for e in self.entries), self.root)

    def _bad(self, path: Path, why: str) -> None:
        self.counters["disk_bad_files"] += 1
        log.warning("%s: prompt cache: ignored and removed %s (%s)", self.name, path.name, why)
        try:
            path.unlink()
        except OSError:
            pass
        with self._lock:
            self.entries = [e for e in self.entries if e.path != path]
            self.counters["disk_entries"] = len(self.entries)

    def best(self, tokens: list[int] | np.ndarray, usable: int, max_len: int | None = None) -> tuple[Entry | None, int]:
        """The entry (of at most max_len tokens) sharing the longest prefix with tokens[:usable], and that
        prefix's length."""
        want = np.asarray(tokens[:usable], dtype=np.int32)
        best, n = None, 0
        with self._lock:
            entries = list(self.entries)
        for e in entries:
            if max_len is not None and len(e.tokens) > max_len:
                continue
            m = min(len(e.tokens), len(want))
            if m <= n:
                continue
            diff = np.flatnonzero(e.tokens[:m] != want[:m])
            k = int(diff[0]) if len(diff) else m
            if k > n:
                best, n = e, k
        return best, n

    def read(self, entry: Entry) -> bytes | None:
        """The entry's payload, checked; None (the file removed if bad) when it cannot be read."""
        try:
            with open(entry.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                toks, offset, plen = read_header(f, self.key, size)
                payload = f.read(plen)
                digest = f.read(SUM_BYTES)
                f.seek(0)
                head = f.read(offset)
        except FileNotFoundError:  # another daemon's eviction
            with self._lock:
                self.entries = [e for e in self.entries if e.path != entry.path]
            return None
        except (BadEntry, OSError, struct.error) as exc:
            self._bad(entry.path, str(exc))
            return None
        h = hashlib.blake2b(digest_size=SUM_BYTES)
        h.update(head)
        h.update(payload)
        if h.digest() != digest or not np.array_equal(toks, entry.tokens):
            self._bad(entry.path, "its checksum does not match (corrupt)")
            return None
        try:
            os.utime(entry.path)  # least recently used goes first
        except OSError:
            pass
        self.counters["disk_read_bytes"] += size
        return payload

    # -- writing ------------------------------------------------------------------------------------
    def save(self, tokens: list[int], payload: bytes | memoryview | np.ndarray) -> bool:
        """Queue `payload` (the state after `tokens`) for the writer; False when too much is queued already."""
        if self.limit <= 0 or len(tokens) < self.min_tokens:
            return False
        size = len(payload) if not isinstance(payload, np.ndarray) else payload.nbytes
        with self._lock:
            if self._pending + size > MAX_PENDING_BYTES or size + 1024 > self.limit:
                return False
            self._pending += size
        self._queue.put((np.asarray(tokens, dtype=np.int32), payload))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            toks, payload = item
            try:
                self._write(toks, memoryview(payload).cast("B"))
            except Exception:  # noqa: BLE001 - a full disk, a read-only home: the cache only misses
                log.exception("%s: prompt cache: could not write a %d-token prompt's state", self.name, len(toks))
            finally:
                with self._lock:
                    self._pending -= len(memoryview(payload).cast("B"))

    def _write(self, toks: np.ndarray, payload: memoryview) -> None:
        path = self.root / f"{self.kid}-{tokens_id(toks)}{SUFFIX}"
        if path.exists():  # (another daemon's, or an earlier run's)
            return
        tmp = self.root / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                for piece in encode(self.key, toks, payload):
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        size = path.stat().st_size
        self.counters["disk_written_bytes"] += size
        self.counters["disk_saved"] += 1
        with self._lock:
            # an older entry whose tokens this one starts with adds nothing: it goes
            covered = [e for e in self.entries if len(e.tokens) <= len(toks)
                       and np.array_equal(e.tokens, toks[:len(e.tokens)])]
            self.entries = [e for e in self.entries if e not in covered] + [Entry(path, toks, size)]
            self.counters["disk_entries"] = len(self.entries)
        for e in covered:
            try:
                e.path.unlink()
            except OSError:
                pass
        self.evict()

    def evict(self) -> None:
        """Oldest files (by mtime, every model's) go until the folder is within the limit."""
        files = []
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files, key=lambda x: x[0]):
            if total <= self.limit:
                break
            try:
                p.unlink()
            except OSError:
                pass
            total -= size
            with self._lock:
                self.entries = [e for e in self.entries if e.path != p]
                self.counters["disk_entries"] = len(self.entries)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until what was queued is written (tests, and close)."""
        deadline = time.monotonic() + timeout
        while (self._pending or not self._queue.empty()) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)


def open_for(spec: Any, key: dict[str, Any]) -> PromptDisk | None:
    """The prompt cache on disk for a loaded model (LoadSpec `spec`; the daemon puts its settings and the
    model's digest in spec.extra, else they are read here), keyed by `key` (the backend's: its build, KV type,
    ...) and the model's digest; None when it is off or its folder cannot be made."""
    extra = spec.extra
    if "prompt_cache_dir" in extra:
        root, limit, min_tokens = Path(extra["prompt_cache_dir"]), int(extra["prompt_cache_disk"]), int(extra["prompt_cache_min"])
    else:
        from localrun.config import settings

        s = settings()
        root, limit, min_tokens = s.prompt_cache_dir, s.prompt_cache_disk, s.prompt_cache_min
    if limit <= 0:
        return None
    digest = extra.get("digest") or ""
    if not digest:  # no library digest (a benchmark's direct load): the file's path, size and time stand in
        try:
            st = Path(spec.weights).stat()
            digest = f"file:{Path(spec.weights).resolve()}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            return None
    try:
        return PromptDisk(root, {**key, "model": digest}, limit=limit, min_tokens=min_tokens, name=spec.name)
    except OSError as exc:
        log.warning("%s: no prompt cache on disk (%s)", spec.name, exc)
        return None
