"""The soak's settings and the daemon it talks to: one of its own on a free loopback port, or a loopback URL.

Also the daemon's and its runner's memory (RSS), for the soak's steadiness check. See localrun/bench/soak.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from localrun.library.catalog import DEFAULT_MODEL


class SoakError(Exception):
    """The soak could not run (no daemon, no model, the reference pass failed)."""


@dataclass
class SoakConfig:
    backend: str = "llamacpp"  # llamacpp | native (for the daemon it starts)
    clients: int = 64
    seconds: float = 600.0
    num_parallel: int = 4
    max_tokens: int = 32
    model: str = DEFAULT_MODEL
    url: str | None = None  # an existing daemon on a loopback address instead of our own
    api_key: str | None = None
    max_queue: int | None = None  # LOCALRUN_MAX_QUEUE of the daemon we start (None: its default)
    sample_interval: float = 1.0
    warmup_fraction: float = 0.1
    rss_tolerance: float = 10.0  # percent
    request_timeout: float = 300.0
    drain_timeout: float = 180.0
    startup_timeout: float = 300.0
    seed: int = 0


# -- the daemon ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(url: str) -> str:
    """The base URL (no trailing /), or SoakError when it does not point at this machine."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = parts.hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if parts.scheme != "http" or not ok:
        raise SoakError(f"--url must be http:// on a loopback address (127.0.0.1, ::1, localhost), got {url!r}: "
                        "the soak sends traffic to this machine only")
    base = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    return base.removesuffix("/v1")


class OwnDaemon:
    """A daemon of our own: temporary home, free port, the chosen backend, no network."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = Path(tempfile.mkdtemp(prefix="localrun-soak-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
        # LOCALRUN_* names are settings' business: they go to the child's environment only
        env.update(LOCALRUN_HOME=str(self.home), LOCALRUN_HOST=f"127.0.0.1:{self.port}",
                   LOCALRUN_BACKEND=cfg.backend, LOCALRUN_NUM_PARALLEL=str(cfg.num_parallel),
                   LOCALRUN_KEEP_ALIVE="-1", LOCALRUN_LOG_LEVEL="info", HF_HUB_OFFLINE="1",
                   HF_HUB_DISABLE_TELEMETRY="1")
        if cfg.max_queue is not None:
            env["LOCALRUN_MAX_QUEUE"] = str(cfg.max_queue)
        self.log_path = self.home / "daemon.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "localrun.server"], env=env, cwd=str(self.home),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self.exit_code: int | None = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, as a service manager would; the exit code (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                self.exit_code = None
                return None
        self.exit_code = self.proc.returncode
        self._log.close()
        return self.exit_code

    def cleanup(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def daemon_pid_by_port(url: str) -> int | None:
    """The pid listening on --url's port, when this user may see it (for its RSS)."""
    import psutil

    port = urlsplit(url).port or 80
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.Error, OSError):
        pass
    return None


def process_rss(pid: int | None) -> int | None:
    import psutil

    if not pid:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None



async def wait_ready(url: str, daemon: OwnDaemon | None, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as h:
        while True:
            try:
                if (await h.get(url + "/api/version")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if daemon is not None and not daemon.alive():
                raise SoakError(f"the daemon exited with code {daemon.proc.returncode}:\n{daemon.log_tail()}")
            if time.monotonic() > deadline:
                raise SoakError(f"no daemon answered at {url} within {timeout:.0f} s")
            await asyncio.sleep(0.2)
