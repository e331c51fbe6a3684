"""A real daemon (`python -m localrun.server`) on a free 127.0.0.1 port, for the tests that
drive it over HTTP; on stop it checks that no runner process outlives it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import psutil

MODEL = "smollm2:135m"
KEY = "test-secret-key"
REPO = Path(__file__).resolve().parents[1]


def stop_pid(pid: int, grace: float = 20.0) -> None:
    """SIGTERM a process, wait up to ``grace`` seconds for it to go, then SIGKILL it."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, home: Path, *, argv: list[str] | None = None, cwd: str | None = None, **env: str):
        """``argv``: the daemon's command line (default ``python -m localrun.server``); ``cwd``: its
        working directory (default ``home``); ``env``: LOCALRUN_* settings and other variables."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.key = env.get("LOCALRUN_API_KEY")
        self.log = home / "daemon.log"
        home.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
        full_env.update(LOCALRUN_HOME=str(home), LOCALRUN_HOST=f"127.0.0.1:{self.port}",
                        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full_env.update(env)
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "localrun.server"], env=full_env, cwd=cwd or str(home),
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120, headers=self.headers())
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.http.get("/").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("daemon did not start:\n" + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def pull(self, name: str = MODEL) -> list[dict]:
        with self.http.stream("POST", "/api/pull", json={"model": name}) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line) for line in r.iter_lines() if line.strip()]
        assert events[-1] == {"status": "success"}, events[-3:]
        return events

    def ps(self) -> list[dict]:
        r = self.http.get("/api/ps")
        assert r.status_code == 200
        return r.json()["models"]

    def wait_ps(self, pred, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            models = self.ps()
            if pred(models):
                return models
            if time.monotonic() > deadline:
                raise AssertionError(f"/api/ps never matched: {models}")
            time.sleep(0.1)

    def runners(self) -> list[psutil.Process]:
        """The daemon's runner processes (its children running localrun.backends.runner.worker)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in kids:
            try:
                if "localrun.backends.runner.worker" in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def runner_pid(self, name: str = MODEL) -> int:
        m = next(m for m in self.ps() if m["name"] == name)
        return m["runner"]["pid"]

    def stop(self) -> None:
        """SIGTERM, as a service manager would; every runner must be gone afterwards."""
        self.http.close()
        kids = self.runners()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        gone, alive = psutil.wait_procs(kids, timeout=10)
        for p in alive:
            p.kill()
        assert not alive, f"runner processes outlived the daemon: {[p.pid for p in alive]}"


@contextmanager
def pulled_daemon(home: Path, **env: str) -> Iterator[Daemon]:
    """A Daemon with the bundled model pulled, stopped (and checked) at the end: a module fixture's body."""
    d = Daemon(home, **env)
    try:
        d.pull()
        yield d
    finally:
        d.stop()
