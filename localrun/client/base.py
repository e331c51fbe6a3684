"""What the blocking and the async client share: the address, answers read, and the daemon started.

Starting it: `localrun serve` spawned detached, the race with another command's start told apart
(which daemon answers), and the errors that say why none does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from localrun.client.calls import Call, Requests
from localrun.client.errors import APIError, DaemonUnavailable, error_message
from localrun.config import parse_hostport, settings


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}


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


class ClientBase(Requests):
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
    def _result(call: Call, response: httpx.Response) -> Any:
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise APIError(response.status_code, error_message(body, f"HTTP {response.status_code}"))
        return call.pick(body) if call.pick else body

    @staticmethod
    def _stream_error(response: httpx.Response, content: bytes) -> APIError:
        try:
            body = json.loads(content)
        except ValueError:
            body = content.decode("utf-8", "replace")
        return APIError(response.status_code, error_message(body, f"HTTP {response.status_code}"))

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
