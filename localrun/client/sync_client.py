"""The blocking client (the CLI's): each request sent with ``httpx.Client``; streams are iterators."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from localrun.client.base import ClientBase
from localrun.client.calls import Call, bind_requests
from localrun.client.errors import APIError, check_event


@bind_requests("_send")
class DaemonClient(ClientBase):
    """Blocking client. Stream methods return iterators of dicts; closing one early
    closes the HTTP response, which makes the daemon abort the request."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 600):
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.Client(**self._client_kwargs())
        self.started_pid: int | None = None  # set when ensure_running started the daemon that answers
        self.started_elsewhere = False  # ensure_running spawned one, but another command's daemon answered

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_up(self) -> bool:
        try:
            r = self._http.get("/api/version", timeout=2.0)
        except httpx.HTTPError:
            return False
        return r.status_code in (200, 401)

    def sees_my_files(self) -> bool:
        """Whether the daemon reads this machine's files at the paths this process sees: it listens on
        this machine's loopback and reports the same view of the file system (/api/version's
        files_view). A daemon in a container behind a published 127.0.0.1 port has its own."""
        if not self._is_local():
            return False
        from localrun.library.paths import files_view

        try:
            r = self._http.get("/api/version", timeout=10.0)
            theirs = r.json().get("files_view") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            theirs = None
        return theirs is None or theirs == files_view()  # None: a daemon too old to say (as before)

    def ensure_running(self, autostart: bool = True, wait_s: float = 30) -> None:
        if self.is_up():
            return
        err = self._not_started(autostart)
        if err:
            raise err
        proc = self._spawn()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            exited = proc.poll() is not None  # (before asking: a child gone by then did not answer)
            if self.is_up():
                self._adopt(proc, not exited and self._serves(proc))
                return
            if exited:
                # it may have lost the port to a daemon another command started: give that one a moment
                grace = time.monotonic() + self.RACE_GRACE_S
                while time.monotonic() < grace:
                    time.sleep(0.1)
                    if self.is_up():
                        self._adopt(proc, False)
                        return
                raise self._start_failed(proc)
            time.sleep(0.1)
        raise self._timed_out(proc, wait_s)

    def _serves(self, proc: subprocess.Popen) -> bool:
        """Whether our child is the daemon that answers (see _child_listens; where the platform does not
        say: whether it is still running a moment later, as one that lost the port exits at once)."""
        ours = self._child_listens(proc)
        if ours is None:
            try:
                proc.wait(timeout=self.RACE_GRACE_S)
            except subprocess.TimeoutExpired:
                return True
            return False
        return ours

    def has_blob(self, digest: str) -> bool:
        try:
            r = self._http.head(f"/api/blobs/{digest}")
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        if r.status_code not in (200, 404):
            raise APIError(r.status_code, f"HTTP {r.status_code} from HEAD /api/blobs/{digest}")
        return r.status_code == 200

    def upload_blob(self, digest: str, path: Path, on_bytes: Callable[[int], None] | None = None) -> None:
        """Send a file to POST /api/blobs/<digest> (its sha256), streamed; on_bytes(n) after each piece."""
        size = path.stat().st_size

        def body() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(1 << 20):
                    yield piece
                    if on_bytes:
                        on_bytes(len(piece))

        try:
            r = self._http.post(f"/api/blobs/{digest}", content=body(), headers={"Content-Length": str(size)},
                                timeout=httpx.Timeout(self.timeout, connect=5.0, write=None))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        self._result(Call("POST", f"/api/blobs/{digest}", None), r)

    def _send(self, call: Call) -> Any:
        if call.stream:
            return self._stream(call)
        try:
            r = self._http.request(call.method, call.path, json=call.body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        return self._result(call, r)

    def _stream(self, call: Call) -> Iterator[dict]:
        try:
            with self._http.stream(call.method, call.path, json=call.body) as r:
                if r.status_code >= 400:
                    raise self._stream_error(r, r.read())
                for line in r.iter_lines():
                    if line.strip():
                        yield check_event(json.loads(line))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
