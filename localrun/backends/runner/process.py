"""Runner processes, seen from the daemon: each loaded model lives in a process of its own.

:func:`start_runner` starts ``python -m localrun.backends.runner.worker`` (a new session, so a
terminal's Ctrl+C reaches only the daemon), hands it the load order on stdin, and waits
until it says ``ready`` (or fails, or dies). The :class:`RemoteBackend` it returns
implements the Backend protocol over one end of a Unix socket pair (no path on disk, no
port: nothing else can connect; :class:`localrun.backends.runner.wire.Channel`): tokens stream
back per request, closing a stream sends ``abort`` (the runner frees the slot / KV pages),
errors come back typed. The pipe adds no thread: both ends are read by their event loops.

A runner that dies (a signal, the OOM killer, a native crash, a CUDA error) fails every
request it held with :class:`RunnerDied` naming the model and the signal, and resolves
``exited``; the model manager then forgets it, so the next request loads it again. The
daemon never waits on a dead runner.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import localrun
from localrun.backends.runner import wire
from localrun.backends.base import BackendInfo, Chunk, GenerationRequest, LoadSpec, merge_chunks
from localrun.errors import BackendError

log = logging.getLogger("localrun.process")

RUNNER_MODULE = "localrun.backends.runner.worker"  # what a runner process runs
CLOSE_GRACE = 10.0  # seconds a runner gets to close its backend before SIGTERM, then SIGKILL
NATIVE_CRASH_SIGNALS = {"SIGSEGV", "SIGILL", "SIGBUS", "SIGABRT", "SIGFPE"}


class RunnerDied(BackendError):
    """The runner process holding a model exited while the daemon still needed it."""

    code = "runner_died"

    def __init__(self, message: str, *, returncode: int | None = None, during_load: bool = False):
        super().__init__(message)
        self.returncode = returncode
        self.during_load = during_load


def describe_exit(returncode: int | None) -> str:
    """'killed by signal SIGKILL', 'exited with status 3'."""
    if returncode is None:
        return "stopped"
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return str(-returncode)


def likely_cause(returncode: int | None, backend: str, extra_buffers: str | None = None) -> str:
    """A sentence on why a runner died and which setting to try."""
    sig = signal_name(returncode)
    if sig == "SIGKILL":
        return ("SIGKILL usually means the out-of-memory killer: free memory (`localrun stop` other models), "
                "or use a smaller num_ctx or quantization")
    if sig in NATIVE_CRASH_SIGNALS:
        if backend == "llamacpp":
            hint = "a native crash inside llama.cpp"
            if extra_buffers != "off":
                hint += ("; on Intel CPUs with AMX, llama.cpp's extra buffer types are known to crash: "
                         "set LOCALRUN_LLAMACPP_EXTRA_BUFFERS=off")
            return hint + "; or try LOCALRUN_BACKEND=native"
        return "a native crash inside the native engine (torch/CUDA); or try LOCALRUN_BACKEND=llamacpp"
    if returncode == 70:
        return "the backend hit an unrecoverable error (e.g. a CUDA error) and restarted"
    return "see the daemon's log for the runner's last lines"


class RemoteBackend:
    """The Backend protocol, served by a runner process."""

    # generate() takes a request whose prompt is not tokenized yet (GenerationRequest.window): the
    # runner tokenizes it where the tokenizer lives, so a request costs one round trip, not two
    tokenizes_in_generate = True

    def __init__(self, name: str, backend: str, proc: asyncio.subprocess.Process, chan: wire.Channel,
                 extra_buffers: str | None = None) -> None:
        self.name, self.backend_name, self.proc, self.chan = name, backend, proc, chan
        self.pid = proc.pid
        self.info: BackendInfo | None = None
        self.extra_buffers = extra_buffers
        self.returncode: int | None = None
        self.fatal_message: str | None = None
        self.unreadable: str | None = None  # what made a message from the runner unreadable (it was stopped)
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = False
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    # -- the pipe ------------------------------------------------------------------------------
    def _send(self, obj: dict, now: bool = False) -> None:
        if self.returncode is None:
            self.chan.send(obj, now)

    async def _read(self) -> None:
        while True:
            try:
                msg = await self.chan.recv()
            except EOFError:  # the runner is gone (or closing): _watch reports why
                return
            except Exception as exc:  # noqa: BLE001 - not JSON
                self._stop_unreadable(exc)
                return
            try:
                self._dispatch(msg)
            except Exception as exc:  # noqa: BLE001 - a message this daemon cannot read
                self._stop_unreadable(exc)
                return

    def _stop_unreadable(self, exc: BaseException) -> None:
        """The runner sent what this daemon cannot read (a runner of another localrun version: the
        package was upgraded or edited while the daemon ran; or a bug): nothing that waits on this
        runner would ever hear from it again, so it is stopped and _watch tells them why."""
        log.error("runner pid %d for %s sent a message the daemon cannot read (%s: %s); stopping it", self.pid,
                  self.name, type(exc).__name__, exc, exc_info=exc)
        self.unreadable = f"{type(exc).__name__}: {exc}"[:300]
        self._signal(signal.SIGKILL)

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            raise TypeError(f"expected a JSON object, got {type(msg).__name__}")
        t, rid = msg.get("t"), msg.get("id")
        if t == "chunk":
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(wire.chunk_from_wire(msg))
        elif t == "error":
            err = wire.error_from_wire(msg["error"])
            if (q := self._streams.get(rid)) is not None:
                q.put_nowait(err)
            elif (f := self._calls.pop(rid, None)) is not None and not f.done():
                f.set_exception(err)
        elif t == "result":
            if (f := self._calls.pop(rid, None)) is not None and not f.done():
                f.set_result(msg["result"])
        elif t == "info":  # the backend's info changed after loading (e.g. a fallback)
            self.info = wire.info_from_wire(msg["info"])
        elif t == "ready":
            self.info = wire.info_from_wire(msg["info"])
            if not self._ready.done():
                self._ready.set_result(None)
        elif t == "load_error":
            if not self._ready.done():
                self._ready.set_exception(wire.error_from_wire(msg["error"]))
        elif t == "fatal":
            self.fatal_message = msg.get("message")

    async def _watch(self) -> None:
        rc = await self.proc.wait()
        try:  # let the reader take what the runner sent before it went (it stops at EOF)
            await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
        except asyncio.TimeoutError:
            pass
        except Exception:  # noqa: BLE001 - the reader's own failure; the waiters still hear of the exit below
            log.exception("reading from runner pid %d for %s failed", self.pid, self.name)
        self.returncode = rc
        during_load = not self._ready.done()
        stage = "while loading" if during_load else "while serving"
        if self.unreadable:
            err: BackendError = RunnerDied(
                f"the runner process for {self.name} ({self._label()}) sent a message the daemon could not read "
                f"({self.unreadable}) and was stopped {stage}. If localrun was upgraded or changed while the daemon "
                "ran, restart the daemon; otherwise this is a bug (see the daemon's log).",
                returncode=rc, during_load=during_load)
        elif self._closing:
            err = RunnerDied(f"{self.name} was unloaded", returncode=rc)
        else:
            what = describe_exit(rc)
            if self.fatal_message:
                what += f" after an unrecoverable error: {self.fatal_message}"
            cause = likely_cause(rc, self.backend_name, self.extra_buffers)
            err = RunnerDied(f"the runner process for {self.name} ({self._label()}) {what} {stage}; "
                             f"{cause}. The daemon keeps serving; the next request loads the model again.",
                             returncode=rc, during_load=during_load)
            log.warning("runner pid %d for %s %s %s", self.pid, self.name, what, stage)
        if not self._ready.done():
            self._ready.set_exception(err)
        for q in self._streams.values():
            q.put_nowait(err)
        for f in self._calls.values():
            if not f.done():
                f.set_exception(err)
        self._calls.clear()
        self._reader.cancel()
        self.chan.close()
        if not self.exited.done():
            self.exited.set_result(err)

    def _label(self) -> str:
        return {"llamacpp": "llama.cpp", "native": "native engine"}.get(self.backend_name, self.backend_name)

    async def _call(self, op: str, **kw: Any) -> Any:
        if self.returncode is not None:
            raise self.exited.result()
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[rid] = fut
        self._send({"op": op, "id": rid, **kw})
        try:
            return await fut
        finally:
            if self._calls.pop(rid, None) is not None and self.returncode is None:
                self._send({"op": "abort", "id": rid})

    # -- the Backend protocol -----------------------------------------------------------------
    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return await self._call("tokenize", text=text, add_special=add_special)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._call("detokenize", ids=list(token_ids))

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        return await self._call("embed", texts=texts, truncate=truncate)

    async def rerank(self, query: str, documents: list[str], truncate: bool = False) -> tuple[list[list[float]], list[int]]:
        scores, counts = await self._call("rerank", query=query, documents=documents, truncate=truncate)
        return scores, counts

    async def stats(self) -> dict:
        """The backend's own counters (the native engine: KV pages, prefix hits); {} if none."""
        return await self._call("stats")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        if self.returncode is not None:
            raise self.exited.result()
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        # at once, not at the end of this turn of the event loop: it is on the way to the first token
        self._send({"op": "generate", "id": rid, "request": wire.request_to_wire(request)}, now=True)
        finished, first = False, True
        try:
            while True:
                item = await q.get()
                # a slow consumer gets what piled up as one chunk (fewer events, same tokens)
                while not q.empty() and isinstance(item, Chunk) and item.finish_reason is None:
                    nxt = q.get_nowait()
                    if not isinstance(nxt, Chunk):
                        item = nxt
                        break
                    item = merge_chunks(item, nxt)
                if not isinstance(item, Chunk):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
                if first:
                    first = False
                    self._send({"op": "delivered", "id": rid})
        finally:
            self._streams.pop(rid, None)
            if not finished:
                log.debug("%s: aborting request %d in the runner", self.name, rid)
                self._send({"op": "abort", "id": rid})

    def interrupt_all(self, exc: BaseException) -> None:
        """End every stream in flight with `exc` (each is then aborted in the runner)."""
        for q in self._streams.values():
            q.put_nowait(exc)

    async def close(self) -> None:
        """Ask the runner to close its backend and exit; SIGTERM, then SIGKILL, if it does not."""
        self._closing = True
        if self.returncode is None:
            self._send({"op": "close"})
            if not await self._wait_exit(CLOSE_GRACE):
                log.warning("runner pid %d for %s did not exit in %.0fs; terminating", self.pid, self.name, CLOSE_GRACE)
                self._signal(signal.SIGTERM)
                if not await self._wait_exit(5.0):
                    self._signal(signal.SIGKILL)
                    await self._wait_exit(5.0)
        await asyncio.shield(self.exited)

    def kill(self) -> None:
        """Stop the runner at once (daemon exit paths that cannot wait)."""
        self._closing = True
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def _wait_exit(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def memory(self) -> dict[str, int]:
        """The runner's resident memory (psutil) and the VRAM its backend reported."""
        rss = 0
        try:
            import psutil

            rss = int(psutil.Process(self.pid).memory_info().rss)
        except Exception:  # gone, or no psutil
            pass
        return {"rss": rss, "vram": int(self.info.size_vram_bytes if self.info else 0)}


def _runner_env() -> dict[str, str]:
    """The daemon's environment, with localrun importable from where the daemon imported it (a
    checkout run without an install has its root there; elsewhere that folder is on the path
    already)."""
    env = dict(os.environ)
    root = str(Path(localrun.__file__).resolve().parents[1])
    # an empty entry ("a:" or "::") means the working directory, which the runner keeps off its path
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *theirs])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def runner_command(fd: int) -> list[str]:
    """The runner's command line: its working directory (the daemon's, often a user's project) is
    kept off sys.path, so no file there (a `llama_cpp.py`, a `kernels/` package) is imported in place
    of a package: ``-P`` where Python has it (3.11+), else the same done first thing."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", RUNNER_MODULE, str(fd)]
    return [sys.executable, "-c", "import runpy, sys; del sys.path[0]; "
            f"runpy.run_module({RUNNER_MODULE!r}, run_name='__main__', alter_sys=True)", str(fd)]


async def start_runner(spec: LoadSpec, backend: str, *, timeout: float | None = None,
                       log_level: str = "info") -> RemoteBackend:
    """Start a runner process for `spec` on `backend` ("llamacpp" | "native") and wait until it
    has loaded the model. Raises the runner's typed load error, or RunnerDied when it died
    while loading, or BackendError after `timeout` seconds (the runner is then killed)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await asyncio.create_subprocess_exec(
            *runner_command(theirs.fileno()), stdin=asyncio.subprocess.PIPE,
            env=_runner_env(), start_new_session=True, pass_fds=(theirs.fileno(),))
        chan = await wire.Channel.connect(ours)
    except Exception:
        ours.close()
        raise
    finally:
        theirs.close()  # the runner holds its own copy
    remote = RemoteBackend(spec.name, backend, proc, chan, spec.extra.get("extra_buffers"))
    order = {"backend": backend, "spec": wire.spec_to_wire(spec), "log_level": log_level}
    assert proc.stdin is not None
    try:
        proc.stdin.write(wire.dumps(order) + b"\n")  # stdin stays open: its EOF tells the runner we are gone
    except (RuntimeError, ConnectionError) as exc:
        # the runner died already (killed as it started): uvloop refuses the write to its closed
        # pipe; the watcher reports how it died, as RunnerDied, below
        log.debug("runner pid %d for %s gone before its load order: %s", proc.pid, spec.name, exc)
    log.info("started runner pid %d for %s (%s)", proc.pid, spec.name, backend)
    try:
        await asyncio.wait_for(asyncio.shield(remote._ready), timeout)
    except asyncio.TimeoutError:
        remote.kill()
        await asyncio.shield(remote.exited)
        raise BackendError(f"loading {spec.name} took longer than {timeout:g}s (LOCALRUN_LOAD_TIMEOUT); "
                           "the runner was stopped. Raise the timeout for very large models.") from None
    except BaseException:
        if remote.returncode is None:  # a load error: the runner exits on its own; make sure
            if not await remote._wait_exit(5.0):
                remote.kill()
        raise
    return remote


__all__ = ["RemoteBackend", "RunnerDied", "start_runner", "describe_exit", "likely_cause"]
