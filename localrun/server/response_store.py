"""Stored responses of the OpenAI Responses API (`store: true`, the default): one JSON file
per response under LOCALRUN_HOME/responses/, so `GET /v1/responses/{id}` and
`previous_response_id` work across daemon restarts.

A record holds the response object as it was answered and its context: every input item
the model saw before its output (the items of the response it continued, then this
request's input; the `instructions` are not kept in it, as OpenAI does not carry them
over). A record stands alone, so evicting an older response never breaks a newer one.

Bounds (here and only here): at most MAX_RESPONSES records and MAX_BYTES in all; the
oldest are removed first when a new one would exceed either. Writes are atomic (temp file,
fsync, rename); ids are checked before they become a path; a file that cannot be read or
parsed is a clear 500 naming the response, never a traceback, and DELETE still removes it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path

from localrun.errors import InvalidRequest, LocalrunError, NotFound
from localrun.library.disk_errors import storage_errors

MAX_RESPONSES = 1000
MAX_BYTES = 256 * 2**20

_ID_RE = re.compile(r"^resp_[0-9a-f]{32}$")
_last_ns = 0
_id_lock = threading.Lock()


def new_response_id() -> str:
    """"resp_" + 16 hex digits of creation time (ns, strictly increasing in this process) +
    16 random ones: ids sort by age, which is the eviction order."""
    global _last_ns
    with _id_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        ns = _last_ns
    return f"resp_{ns:016x}{secrets.token_hex(8)}"


def check_id(response_id: str, what: str = "response id") -> str:
    if not isinstance(response_id, str) or not _ID_RE.match(response_id):
        shown = json.dumps(response_id)[:60] if isinstance(response_id, str) else type(response_id).__name__
        raise InvalidRequest(f"{shown} is not a valid {what}: localrun's look like resp_ followed by 32 hex digits")
    return response_id


class ResponseStore:
    """`<root>/<id>.json`; every method is blocking (call it off the event loop)."""

    def __init__(self, root: Path, max_count: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_count, self.max_bytes = max_count, max_bytes
        self._lock = threading.Lock()
        self._cleaned = False

    def _path(self, response_id: str) -> Path:
        return self.root / f"{check_id(response_id)}.json"

    def save(self, record: dict) -> None:
        """Write `record` (its "response" has the id) atomically, then evict the oldest
        records until the bounds hold again."""
        rid = record["response"]["id"]
        path = self._path(rid)
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            raise InvalidRequest(f"this response and its conversation take {len(data) >> 20} MiB, more than the "
                                 f"{self.max_bytes >> 20} MiB the response store holds; send 'store': false")
        with self._lock, storage_errors("store the response"):
            self.root.mkdir(parents=True, exist_ok=True)
            if not self._cleaned:  # temp files a killed daemon left behind
                self._cleaned = True
                for leftover in self.root.glob(".*.tmp"):
                    leftover.unlink(missing_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{rid}.", suffix=".tmp", dir=self.root)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._evict(keep=path.name)

    def _evict(self, keep: str) -> None:
        files = []
        for p in self.root.glob("resp_*.json"):
            try:
                files.append((p.name, p.stat().st_size))
            except FileNotFoundError:
                continue
        files.sort()  # ids sort by creation time: oldest first
        count, total = len(files), sum(size for _, size in files)
        for name, size in files:
            if count <= self.max_count and total <= self.max_bytes:
                break
            if name == keep:
                continue
            (self.root / name).unlink(missing_ok=True)
            count, total = count - 1, total - size

    def load(self, response_id: str, what: str = "response") -> dict:
        """The stored record; 404 when there is none, 500 when its file is damaged."""
        path = self._path(response_id)
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                raise ValueError("too large")
            raw = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no stored {what} with id '{response_id}' (it was created with 'store': false, deleted, "
                           "or evicted as the store filled up)", code="response_not_found") from None
        except (OSError, ValueError):
            raise self._damaged(response_id) from None
        try:
            record = json.loads(raw)
            resp, context = record["response"], record["context"]
            if (not isinstance(resp, dict) or resp.get("id") != response_id or not isinstance(context, list)
                    or not isinstance(resp.get("output"), list)
                    or not all(isinstance(i, dict) for i in context + resp["output"])):
                raise ValueError("bad record")
        except (ValueError, KeyError, TypeError, RecursionError):
            raise self._damaged(response_id) from None
        return record

    @staticmethod
    def _damaged(response_id: str) -> LocalrunError:
        return LocalrunError(f"the stored response '{response_id}' is damaged and cannot be read; remove it with "
                             f"DELETE /v1/responses/{response_id}", status=500, code="storage_error")

    def delete(self, response_id: str) -> None:
        path = self._path(response_id)
        with self._lock, storage_errors("delete the response"):
            try:
                path.unlink()
            except FileNotFoundError:
                raise NotFound(f"no stored response with id '{response_id}'", code="response_not_found") from None


__all__ = ["ResponseStore", "new_response_id", "check_id", "MAX_RESPONSES", "MAX_BYTES"]
