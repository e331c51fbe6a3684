"""llama.cpp's own llama-server for the tests that check agreement with it: the binary (LOCALRUN_LLAMA_SERVER,
else built once from the llama.cpp that llama-cpp-python vendors and cached: localrun.bench.llama_server_build)
and a running server on a free 127.0.0.1 port, started and stopped with the benchmark's own helpers
(localrun.bench.vs_llama_server)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


def llama_server_binary() -> Path:
    """The binary; a skip (with the reason) only when the build tools are missing."""
    from localrun.bench.llama_server_build import MissingToolError, ensure_llama_server

    try:
        return ensure_llama_server(progress=lambda s: print(s, file=sys.stderr, flush=True))
    except MissingToolError as exc:
        pytest.skip(f"llama-server cannot be built here: {exc}")


@contextmanager
def running_llama_server(binary: Path, gguf: Path, ctx: int, threads: int, parallel: int = 1,
                         args: tuple[str, ...] = ()) -> Iterator[str]:
    """llama-server on ``gguf`` with ``parallel`` slots of ``ctx`` tokens and ``threads`` threads, and ``args``
    (e.g. ``--embedding``); its URL."""
    from localrun.backends.llamacpp.cpu import extra_buffers
    from localrun.bench import vs_llama_server as vs

    cfg = vs.Config(gguf=Path(gguf), llama_server=Path(binary), threads=threads, parallel=parallel, ctx=ctx,
                    extra_buffers=extra_buffers("auto")[0])
    home = Path(tempfile.mkdtemp(prefix="llama-server-test-"))
    server = vs.llama_server(cfg, home)
    server.argv += list(args)
    try:
        asyncio.run(vs.start(server, cfg))
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


@contextmanager
def llama_server_client(binary: Path, gguf: Path, ctx: int, *args: str):
    """llama-server on ``gguf`` (one slot of ``ctx`` tokens, the physical cores as threads, ``args``) and an httpx
    client of it that opens a connection per request: llama-server (cpp-httplib) drops a kept-alive connection
    after 5 s idle, and a request sent as it does so got "Server disconnected without sending a response" (CI,
    once, while the daemon's routes took their turn between two llama-server requests)."""
    import httpx

    from localrun.backends.llamacpp.cpu import physical_cores

    with running_llama_server(binary, gguf, ctx, physical_cores(), args=args) as url:
        with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as h:
            yield h
