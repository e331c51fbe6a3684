"""The daemon's HTTP client, shared by the CLI and the TUI.

Every request the client can make is described once, in :class:`_Requests`, as a
:class:`_Call` (method, path, JSON body, whether the answer is an NDJSON stream and
how to pick the result out of the body).  :class:`DaemonClient` sends those calls
with a blocking ``httpx.Client``; :class:`AsyncDaemonClient` sends the very same
calls with ``httpx.AsyncClient`` (same method names; streams become async
iterators).  Neither imports anything from the server: the daemon is reached over
HTTP only, like any other client (curl, the OpenAI SDK).

    c = DaemonClient()
    c.ensure_running()                 # starts `localrun serve` in the background if needed
    for chunk in c.chat("smollm2:135m", [{"role": "user", "content": "hi"}]):
        print(chunk["message"]["content"], end="")
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator
from urllib.parse import quote, urlsplit

import httpx

from localrun.config import parse_hostport, settings

__all__ = ["DaemonClient", "AsyncDaemonClient", "APIError", "DaemonUnavailable", "base_url_for"]

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}


class APIError(Exception):
    """The daemon answered with an error (4xx/5xx, or an error event inside a stream)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


class DaemonUnavailable(Exception):
    """No daemon answers at the base URL (and none could be started)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def base_url_for(host: str | None) -> str:
    """'127.0.0.1:9000', ':9000', 'http://host:9000' -> 'http://host:9000'; None -> settings."""
    if not host:
        return settings().base_url
    h, port = parse_hostport(host)
    if h in ("0.0.0.0", "::"):
        h = "127.0.0.1"
    if ":" in h:
        h = f"[{h}]"
    return f"http://{h}:{port}"


# --------------------------------------------------------------------------------------
# Request descriptions (shared by the sync and the async client)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: dict | None = None
    stream: bool = False  # the answer is an NDJSON stream of events
    pick: Callable[[Any], Any] | None = None  # turns the decoded body into the result


THINK_LEVELS = ("low", "medium", "high")


def parse_think(text: str) -> bool | str:
    """A think setting as a user writes it (CLI --think, /set think): true/false (on/off, yes/no,
    1/0; empty = true) or an effort level, as Ollama's `think` takes it. ValueError otherwise."""
    t = text.strip().lower()
    if t in ("", "true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    if t in THINK_LEVELS:
        return t
    raise ValueError(f"wants true, false, low, medium or high, got {text!r}")


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _error_message(body: Any, fallback: str) -> str:
    """Ollama ({"error": "..."}), OpenAI ({"error": {"message": ...}}) or FastAPI
    ({"detail": ...}) error bodies -> one line."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            err = err.get("message") or err.get("msg") or json.dumps(err)
        if isinstance(err, list):  # FastAPI validation errors
            err = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}" if isinstance(e, dict) else str(e)
                for e in err
            )
        if err:
            return str(err)
    if isinstance(body, str) and body.strip():
        return body.strip().splitlines()[0][:300]
    return fallback


def _check_event(event: Any) -> dict:
    """An error event inside an NDJSON stream (the HTTP status was already 200) raises."""
    if isinstance(event, dict) and event.get("error"):
        code = event.get("status")
        raise APIError(code if isinstance(code, int) else 500, _error_message(event, "error"))
    return event


class _Requests:
    """The daemon's API as request descriptions. Subclasses send them."""

    def version(self) -> _Call:
        return _Call("GET", "/api/version")

    def tags(self) -> _Call:
        return _Call("GET", "/api/tags", pick=lambda b: b.get("models") or [])

    def ps(self) -> _Call:
        return _Call("GET", "/api/ps", pick=lambda b: b.get("models") or [])

    def show(self, name: str, verbose: bool = False, fit_context: bool = False) -> _Call:
        return _Call("POST", "/api/show", _drop_none({"model": name, "verbose": verbose or None,
                                                      "fit_context": fit_context or None}))

    def pull(self, name: str, insecure: bool = False) -> _Call:
        return _Call("POST", "/api/pull", _drop_none({"model": name, "insecure": insecure or None, "stream": True}), stream=True)

    def create(self, name: str, modelfile: str, base_dir: str | None = None,
               files: dict[str, str] | None = None, quantize: str | None = None) -> _Call:
        """files: {file name: digest} of blobs uploaded first (upload_blob), for a Modelfile with no FROM;
        quantize: the type the GGUF model is stored in (e.g. q4_K_M)."""
        body = _drop_none({"model": name, "modelfile": modelfile, "base_dir": base_dir, "files": files,
                           "quantize": quantize, "stream": True})
        return _Call("POST", "/api/create", body, stream=True)

    def save_session(self, name: str, model: str, *, system: str | None = None, parameters: dict | None = None,
                     messages: list[dict] | None = None) -> _Call:
        """A new model from `model` with a chat session's system message, parameters and messages (Ollama's
        REPL /save: /api/create with `from`)."""
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages or []
                if m.get("role") in ("system", "user", "assistant")]
        body = _drop_none({"model": name, "from": model, "system": system or None,
                           "parameters": {k: v for k, v in (parameters or {}).items() if v is not None} or None,
                           "messages": msgs or None, "stream": True})
        return _Call("POST", "/api/create", body, stream=True)

    def copy(self, src: str, dst: str) -> _Call:
        return _Call("POST", "/api/copy", {"source": src, "destination": dst}, pick=lambda b: None)

    def delete(self, name: str) -> _Call:
        return _Call("DELETE", "/api/delete", {"model": name}, pick=lambda b: None)

    def chat(self, model: str, messages: list[dict], *, options: dict | None = None, stream: bool = True,
             keep_alive: str | int | float | None = None, format: str | dict | None = None,
             tools: list[dict] | None = None, think: bool | str | None = None) -> _Call:
        body = _drop_none({"model": model, "messages": messages, "options": options or None, "stream": stream,
                           "keep_alive": keep_alive, "format": format, "tools": tools, "think": think})
        return _Call("POST", "/api/chat", body, stream=True)

    def generate(self, model: str, prompt: str, *, system: str | None = None, options: dict | None = None,
                 stream: bool = True, keep_alive: str | int | float | None = None,
                 format: str | dict | None = None, raw: bool = False) -> _Call:
        body = _drop_none({"model": model, "prompt": prompt, "system": system, "options": options or None,
                           "stream": stream, "keep_alive": keep_alive, "format": format, "raw": raw or None})
        return _Call("POST", "/api/generate", body, stream=True)

    def embed(self, model: str, input: str | list[str], *, keep_alive: str | int | float | None = None,
              truncate: bool | None = None, dimensions: int | None = None) -> _Call:
        """Ollama's /api/embed: one vector per input."""
        body = _drop_none({"model": model, "input": input, "keep_alive": keep_alive, "truncate": truncate,
                           "dimensions": dimensions})
        return _Call("POST", "/api/embed", body, pick=lambda b: b.get("embeddings") or [])

    def stop(self, model: str) -> _Call:
        """Unload a model now (Ollama's way: a generate with no prompt and keep_alive 0). The daemon
        resolves the name (aliases, case) and answers with it: {"model": NAME, "done_reason": "unload", ...};
        404 when no such model is in the library."""
        return _Call("POST", "/api/generate", {"model": model, "keep_alive": 0, "stream": False},
                     pick=lambda b: b if isinstance(b, dict) else {})

    def resolve_name(self, model: str) -> _Call:
        """The library name the daemon resolves `model` to ('smollm2' -> 'smollm2:135m' through its catalog
        alias, case folded, ...), without loading it: GET /v1/models/NAME's id. 404 when there is none."""
        return _Call("GET", f"/v1/models/{quote(model, safe='/:@')}",
                     pick=lambda b: b.get("id") if isinstance(b, dict) and isinstance(b.get("id"), str) else model)


_ENDPOINTS = [n for n, v in vars(_Requests).items() if callable(v) and not n.startswith("_")]


def _bind(sender: str):
    """Class decorator: each _Requests method `m` becomes `self.<sender>(m(...))`."""

    def wrap(builder):
        @functools.wraps(builder)
        def method(self, *args, **kwargs):
            return getattr(self, sender)(builder(self, *args, **kwargs))

        # the builder returns a _Call; the method returns what the sender makes of it
        method.__signature__ = inspect.signature(builder).replace(return_annotation=inspect.Signature.empty)
        return method

    def decorate(cls):
        for name in _ENDPOINTS:
            setattr(cls, name, wrap(getattr(_Requests, name)))
        return cls

    return decorate


class _Base(_Requests):
    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 600):
        s = None
        if base_url is None or api_key is None:
            s = settings()
        self.base_url = (base_url or s.base_url).rstrip("/")
        if "://" not in self.base_url:
            self.base_url = base_url_for(self.base_url)
        self.api_key = api_key if api_key is not None else s.api_key
        self.timeout = timeout

    def _client_kwargs(self) -> dict:
        headers = {"User-Agent": "localrun-cli"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return {"base_url": self.base_url, "headers": headers,
                "timeout": httpx.Timeout(self.timeout, connect=5.0), "trust_env": False}

    def _unavailable(self, exc: Exception) -> DaemonUnavailable:
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            return DaemonUnavailable(
                f"the localrun daemon at {self.base_url} closed the connection; see {_log_path()} for why")
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return DaemonUnavailable(f"the localrun daemon at {self.base_url} did not answer within {self.timeout:g}s")
        return DaemonUnavailable(
            f"cannot reach the localrun daemon at {self.base_url}: start it with `localrun serve` "
            "(other localrun commands start it automatically)")

    @staticmethod
    def _result(call: _Call, response: httpx.Response) -> Any:
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise APIError(response.status_code, _error_message(body, f"HTTP {response.status_code}"))
        return call.pick(body) if call.pick else body

    @staticmethod
    def _stream_error(response: httpx.Response, content: bytes) -> APIError:
        try:
            body = json.loads(content)
        except ValueError:
            body = content.decode("utf-8", "replace")
        return APIError(response.status_code, _error_message(body, f"HTTP {response.status_code}"))

    def _is_local(self) -> bool:
        return (urlsplit(self.base_url).hostname or "") in LOCAL_HOSTS

    def _spawn(self) -> subprocess.Popen:
        """Start `python -m localrun serve` detached, bound to this client's address."""
        parts = urlsplit(self.base_url)
        env = dict(os.environ)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        env["LOCALRUN_HOST"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log = _log_path()
        log.parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict = {}
        if os.name == "nt":
            kwargs["creationflags"] = subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kwargs["start_new_session"] = True
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "localrun", "serve"], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, env=env, close_fds=True, **kwargs)

    def _not_started(self, autostart: bool) -> DaemonUnavailable | None:
        if not autostart:
            return DaemonUnavailable(f"no localrun daemon answers at {self.base_url}: start it with `localrun serve`")
        if not self._is_local():
            return DaemonUnavailable(
                f"no localrun daemon answers at {self.base_url}, and it is not on this machine, so it cannot be "
                "started from here: start `localrun serve` there or point LOCALRUN_HOST at a running daemon")
        return None

    def _start_failed(self, proc: subprocess.Popen) -> DaemonUnavailable | None:
        code = proc.poll()
        if code is None:
            return None
        last = _last_log_line()
        return DaemonUnavailable(f"the localrun daemon exited at start (code {code})"
                                 + (f": {last}" if last else "") + f"; see {_log_path()}")

    # A start can race another command's (`localrun list & localrun ps`): each spawns a daemon, one binds the
    # port, the others exit with "address already in use". Whoever answers serves all of them, but only the
    # command whose own child holds the port started it; the others say a daemon started meanwhile.
    RACE_GRACE_S = 2.0  # a child that exited at start: how long another daemon has to answer instead

    def _child_listens(self, proc: subprocess.Popen) -> bool | None:
        """Whether `proc` (or a process it started) listens on this client's port: True or False; None
        where this platform does not say (psutil lacks the permission)."""
        if proc.poll() is not None:
            return False
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            return None
        port = urlsplit(self.base_url).port or 80
        try:
            root = psutil.Process(proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return None
        unknown = False
        for p in procs:
            try:
                conns = (p.net_connections if hasattr(p, "net_connections") else p.connections)(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            except (psutil.Error, NotImplementedError, OSError):
                unknown = True
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
                return True
        return None if unknown else False

    def _adopt(self, proc: subprocess.Popen, ours: bool) -> None:
        """A daemon answers: ours (started_pid), or another that started meanwhile (started_elsewhere; our
        child, which cannot bind the port, is ended rather than left to fail)."""
        if ours:
            self.started_pid = proc.pid
            return
        self.started_elsewhere = True
        if proc.poll() is None:
            try:
                proc.terminate()
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # pragma: no cover
                    pass
            except OSError:  # pragma: no cover - gone meanwhile
                pass

    def _timed_out(self, proc: subprocess.Popen, wait_s: float) -> DaemonUnavailable:
        return DaemonUnavailable(f"started the localrun daemon (pid {proc.pid}) but it did not answer at "
                                 f"{self.base_url} within {wait_s:g}s; see {_log_path()}")


def _log_path() -> Path:
    try:
        return settings().logs_dir / "server.log"
    except ValueError:
        return Path("server.log")


def _last_log_line() -> str:
    try:
        lines = [ln.strip() for ln in _log_path().read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


# --------------------------------------------------------------------------------------
# The blocking client
# --------------------------------------------------------------------------------------


@_bind("_send")
class DaemonClient(_Base):
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
        self._result(_Call("POST", f"/api/blobs/{digest}", None), r)

    def _send(self, call: _Call) -> Any:
        if call.stream:
            return self._stream(call)
        try:
            r = self._http.request(call.method, call.path, json=call.body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        return self._result(call, r)

    def _stream(self, call: _Call) -> Iterator[dict]:
        try:
            with self._http.stream(call.method, call.path, json=call.body) as r:
                if r.status_code >= 400:
                    raise self._stream_error(r, r.read())
                for line in r.iter_lines():
                    if line.strip():
                        yield _check_event(json.loads(line))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None


# --------------------------------------------------------------------------------------
# The async client (for Textual): same calls, same names
# --------------------------------------------------------------------------------------


@_bind("_send")
class AsyncDaemonClient(_Base):
    """Async twin of DaemonClient: `await c.tags()`, `async for chunk in c.chat(...)`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 600):
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.AsyncClient(**self._client_kwargs())
        self.started_pid: int | None = None
        self.started_elsewhere = False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncDaemonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def is_up(self) -> bool:
        try:
            r = await self._http.get("/api/version", timeout=2.0)
        except httpx.HTTPError:
            return False
        return r.status_code in (200, 401)

    async def ensure_running(self, autostart: bool = True, wait_s: float = 30) -> None:
        if await self.is_up():
            return
        err = self._not_started(autostart)
        if err:
            raise err
        proc = self._spawn()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            exited = proc.poll() is not None  # (before asking: a child gone by then did not answer)
            if await self.is_up():
                ours = not exited and await self._serves(proc)
                await asyncio.to_thread(self._adopt, proc, ours)
                return
            if exited:
                # it may have lost the port to a daemon another command started: give that one a moment
                grace = time.monotonic() + self.RACE_GRACE_S
                while time.monotonic() < grace:
                    await asyncio.sleep(0.1)
                    if await self.is_up():
                        self._adopt(proc, False)
                        return
                raise self._start_failed(proc)
            await asyncio.sleep(0.1)
        raise self._timed_out(proc, wait_s)

    async def _serves(self, proc: subprocess.Popen) -> bool:
        """DaemonClient._serves, without blocking the event loop."""
        ours = self._child_listens(proc)
        if ours is None:
            grace = time.monotonic() + self.RACE_GRACE_S
            while proc.poll() is None:
                if time.monotonic() > grace:
                    return True
                await asyncio.sleep(0.1)
            return False
        return ours

    def _send(self, call: _Call) -> Any:
        return self._stream(call) if call.stream else self._request(call)

    async def _request(self, call: _Call) -> Any:
        try:
            r = await self._http.request(call.method, call.path, json=call.body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        return self._result(call, r)

    async def _stream(self, call: _Call) -> AsyncIterator[dict]:
        try:
            async with self._http.stream(call.method, call.path, json=call.body) as r:
                if r.status_code >= 400:
                    raise self._stream_error(r, await r.aread())
                async for line in r.aiter_lines():
                    if line.strip():
                        yield _check_event(json.loads(line))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
