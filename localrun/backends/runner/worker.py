"""A runner process: one loaded model behind the Backend protocol, driven by the daemon.

``python -m localrun.backends.runner.worker FD`` is started by the daemon
(``localrun.backends.runner.process``), never by hand; FD is its end of a Unix socket pair. The
first line on stdin is the load order (JSON: backend name and LoadSpec); stdin then stays
open, and its EOF means the daemon is gone, so the runner exits (on Linux the kernel also
sends SIGKILL when the daemon dies: PR_SET_PDEATHSIG). The runner loads the model, says
``ready`` with its BackendInfo, then serves generate / abort / tokenize / detokenize /
embed / rerank / close messages (:mod:`localrun.backends.runner.wire`) until told to close.

A native crash here (llama.cpp, CUDA) kills only this process: the daemon turns it into
an error on the requests this runner held, and loads the model again on the next one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any

from localrun.backends.runner import wire
from localrun.backends.base import fit_window
from localrun.errors import BackendError, LocalrunError

log = logging.getLogger("localrun.runner")

FIRST_CHUNK_WAIT = 0.05  # seconds the backend may pause after the first token until the daemon has it (TTFT)
EXIT_LOAD_FAILED = 3
EXIT_FATAL = 70  # the backend reported an unrecoverable state (e.g. a CUDA error)


def _die_with_parent() -> None:
    """No runner outlives the daemon: SIGKILL when the parent dies (Linux), checked once
    after arming so a parent that died before this line is noticed too."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:  # pragma: no cover - the stdin watch below still covers it
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(0)


def _read_line(fd: int) -> bytes:
    """One line from a raw fd, byte by byte (the rest of stdin is left for _watch_stdin)."""
    out = bytearray()
    while True:
        b = os.read(fd, 1)
        if not b or b == b"\n":
            return bytes(out)
        out += b


def _watch_stdin() -> None:
    """EOF on stdin: the daemon closed its end or died. Exit without ceremony."""
    try:
        while os.read(0, 65536):  # raw reads: no buffered-reader lock to trip over at exit
            pass
    except OSError:
        pass
    os._exit(0)


class _Outbox:
    """What the llama.cpp loop's thread sends itself (:meth:`LlamaCppBackend.generate_direct`): a
    step's chunks for every stream go out in one write, without waking the event loop; the streams
    that ended are resolved on the event loop after the write, so nothing for them follows."""

    def __init__(self, chan: wire.Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.chan, self.loop = chan, loop
        self.parts: list[bytes] = []
        self.ended: list[asyncio.Future] = []

    def add(self, data: bytes, end: asyncio.Future | None = None) -> None:
        """One framed message (wire.frame); `end`: that stream's future, resolved after the write."""
        self.parts.append(data)
        if end is not None:
            self.ended.append(end)

    def flush(self) -> None:
        if self.parts:
            data, self.parts = b"".join(self.parts), []
            self.chan.write(data)
        if self.ended:
            ended, self.ended = self.ended, []
            try:
                self.loop.call_soon_threadsafe(_resolve, ended)
            except RuntimeError:  # the runner is shutting down: nobody waits for these
                pass


def _first_chunk(chunk: Any, n_prompt: int, prompt_ids: list[int] | None) -> None:
    """The first chunk of a prompt the runner tokenized carries its length (and, asked for, its ids)."""
    chunk.prompt_tokens = n_prompt
    if prompt_ids is not None:
        chunk.prompt_token_ids = prompt_ids


def _resolve(futures: list[asyncio.Future]) -> None:
    for f in futures:
        if not f.done():
            f.set_result(None)


class _DirectSink:
    """One stream's end of the loop-to-pipe path: its chunks (then its error, if it fails) as wire
    messages into the outbox. ``put`` runs on the loop's thread; ``closed`` (set when the daemon
    aborts the stream, or when it ended) drops whatever still comes."""

    def __init__(self, outbox: _Outbox, rid: int, n_prompt: int | None, prompt_ids: list[int] | None) -> None:
        self.outbox, self.rid = outbox, rid
        self.n_prompt, self.prompt_ids = n_prompt, prompt_ids
        self.delivered = threading.Event()  # the daemon has the first chunk (its 'delivered')
        self.done: asyncio.Future = outbox.loop.create_future()
        self.closed = False

    def put(self, item: Any) -> None:
        if self.closed:
            return
        if isinstance(item, BaseException):
            self._error(item)
            return
        if self.n_prompt is not None:
            _first_chunk(item, self.n_prompt, self.prompt_ids)
            self.n_prompt = self.prompt_ids = None
        end = item.finish_reason is not None
        try:
            data = wire.frame({"t": "chunk", "id": self.rid, **wire.chunk_to_wire(item)})
        except Exception as exc:  # noqa: BLE001 - a chunk that cannot be sent ends its stream, not the loop
            log.exception("a chunk of request %s could not be sent", self.rid)
            self._error(exc)
            return
        self.closed = end
        self.outbox.add(data, self.done if end else None)

    def _error(self, exc: BaseException) -> None:
        self.closed = True
        self.outbox.add(wire.frame({"t": "error", "id": self.rid, "error": wire.error_to_wire(exc)}), self.done)


class Runner:
    def __init__(self, chan: wire.Channel, backend: Any) -> None:
        self.chan, self.backend = chan, backend
        self.tasks: dict[int, asyncio.Task] = {}
        self.delivered: dict[int, asyncio.Event | threading.Event] = {}
        self.outbox = _Outbox(chan, asyncio.get_running_loop())
        # requests the daemon aborted: checked between chunks as well as cancelling the task,
        # since Python 3.11's wait_for swallows a cancel that lands with the event it awaits
        # (the daemon's 'delivered' and 'abort' often arrive in one read)
        self.aborted: set[int] = set()
        if hasattr(backend, "on_info"):  # a backend whose info changes after loading (a fallback)
            loop = asyncio.get_running_loop()
            backend.on_info = lambda: loop.call_soon_threadsafe(self.send_info)

    def send(self, obj: dict) -> None:
        self.chan.send(obj)

    def send_info(self) -> None:
        """The backend's BackendInfo again (``info``): the daemon's ps shows it from now on."""
        self.send({"t": "info", "info": wire.info_to_wire(self.backend.info)})

    async def serve(self) -> None:
        while True:
            try:
                msg = await self.chan.recv()
            except EOFError:  # the daemon is gone
                return
            op, rid = msg.get("op"), msg.get("id")
            if op == "generate":
                self.delivered[rid] = asyncio.Event()
                self.tasks[rid] = asyncio.get_running_loop().create_task(self.generate(rid, msg["request"]))
            elif op == "abort":
                task = self.tasks.get(rid)
                log.debug("abort %s (%s)", rid, "running" if task is not None else "already done")
                if task is not None:
                    self.aborted.add(rid)
                    task.cancel()
            elif op == "delivered":
                ev = self.delivered.get(rid)
                if ev is not None:
                    ev.set()
            elif op in ("tokenize", "detokenize", "embed", "rerank", "stats"):
                self.tasks[rid] = asyncio.get_running_loop().create_task(self.call(rid, op, msg))
            elif op == "close":
                return
            else:
                log.warning("unknown message %r", op)

    async def generate(self, rid: int, request: dict) -> None:
        gen = None
        first = True
        try:
            req = wire.request_from_wire(request)
            n_prompt = None
            if req.prompt_token_ids is None and req.window is not None and not req.images and req.infill is None:
                # the daemon left tokenizing to us (one round trip, not two): so is the window check (a
                # prompt with images, or a fill-in-the-middle one, is laid out by the backend, which makes
                # the same check)
                req.prompt_token_ids = await self.backend.tokenize(req.prompt, req.add_special)
                req.options.max_tokens = fit_window(len(req.prompt_token_ids), req.window, req.options.max_tokens)
                n_prompt = len(req.prompt_token_ids)
            # the prompt's token ids on the first chunk, when we tokenized it and the daemon asked for them
            prompt_ids = list(req.prompt_token_ids or []) if n_prompt is not None and req.return_prompt_ids else None
            direct = getattr(self.backend, "generate_direct", None)
            if direct is not None:  # the loop's thread writes the chunks to the pipe itself
                sink = _DirectSink(self.outbox, rid, n_prompt, prompt_ids)
                self.delivered[rid] = sink.delivered
                await direct(req, sink)
            else:
                gen = self.backend.generate(req)
                async for chunk in gen:
                    if rid in self.aborted:
                        break
                    if n_prompt is not None:
                        _first_chunk(chunk, n_prompt, prompt_ids)
                        n_prompt = None
                    self.send({"t": "chunk", "id": rid, **wire.chunk_to_wire(chunk)})
                    if chunk.finish_reason is not None:
                        break
                    if first:  # let the daemon hand the first token on before decoding takes the CPU
                        first = False
                        try:
                            await asyncio.wait_for(self.delivered[rid].wait(), FIRST_CHUNK_WAIT)
                        except asyncio.TimeoutError:
                            pass
                        if rid in self.aborted:
                            break
        except asyncio.CancelledError:
            pass  # aborted by the daemon: closing the generator below frees the backend's slot
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the daemon, typed
            if not isinstance(exc, LocalrunError):
                log.exception("generation failed")
            self.send({"t": "error", "id": rid, "error": wire.error_to_wire(exc)})
        finally:
            if gen is not None:
                await gen.aclose()
            self.tasks.pop(rid, None)
            self.delivered.pop(rid, None)
            self.aborted.discard(rid)
        await self.check_fatal()

    async def call(self, rid: int, op: str, msg: dict) -> None:
        try:
            if op == "tokenize":
                result: Any = await self.backend.tokenize(msg["text"], msg.get("add_special", False))
            elif op == "detokenize":
                result = await self.backend.detokenize(msg["ids"])
            elif op == "embed":
                result = await self.backend.embed(msg["texts"], truncate=bool(msg.get("truncate")))
            elif op == "rerank":
                result = list(await self.backend.rerank(msg["query"], msg["documents"],
                                                        truncate=bool(msg.get("truncate"))))
            else:
                stats = getattr(self.backend, "stats", None)
                result = await stats() if stats is not None else {}
            self.send({"t": "result", "id": rid, "result": result})
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, LocalrunError):
                log.exception("%s failed", op)
            self.send({"t": "error", "id": rid, "error": wire.error_to_wire(exc)})
        finally:
            self.tasks.pop(rid, None)
        await self.check_fatal()

    async def check_fatal(self) -> None:
        """A backend that says it cannot go on (a CUDA error poisons the context) ends the runner;
        the daemon loads the model afresh on the next request."""
        fatal = getattr(self.backend, "fatal", None)
        if fatal:
            log.error("unrecoverable backend error, exiting: %s", fatal)
            self.send({"t": "fatal", "message": str(fatal)})
            try:
                await asyncio.wait_for(self.chan.drain(), 2.0)
            except Exception:  # the daemon is gone, or slow: exit all the same
                pass
            os._exit(EXIT_FATAL)


async def _watch_fatal(runner: Runner, every: float = 1.0) -> None:
    """A backend can become unusable with no request in flight (a tensor-parallel rank that dies
    while the model is idle): the runner exits then, not on the next request, so the daemon sees
    a dead runner and that request loads the model afresh."""
    while True:
        await asyncio.sleep(every)
        await runner.check_fatal()


async def _main(fd: int, order: dict) -> int:
    import socket

    from localrun.backends.select import backend_module

    chan = await wire.Channel.connect(socket.socket(fileno=fd), direct=True)
    spec = wire.spec_from_wire(order["spec"])
    try:
        module = backend_module(order["backend"])
        backend = await asyncio.to_thread(module.load, spec)
    except Exception as exc:  # noqa: BLE001 - the daemon shows this to the user
        if not isinstance(exc, LocalrunError):
            log.exception("loading %s failed", spec.name)
            exc = BackendError(f"failed to load {spec.name}: {type(exc).__name__}: {exc}")
        chan.send({"t": "load_error", "error": wire.error_to_wire(exc)})
        await chan.drain()
        chan.close()
        return EXIT_LOAD_FAILED
    chan.send({"t": "ready", "pid": os.getpid(), "info": wire.info_to_wire(backend.info)})
    runner = Runner(chan, backend)
    watch = asyncio.create_task(_watch_fatal(runner))
    try:
        await runner.serve()
    finally:
        watch.cancel()
        for task in list(runner.tasks.values()):
            task.cancel()
        await asyncio.gather(*runner.tasks.values(), return_exceptions=True)
        await backend.close()
        try:
            await chan.drain()
        except ConnectionError:
            pass
        chan.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m localrun.backends.runner.worker FD  (started by the localrun daemon)", file=sys.stderr)
        return 2
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when a runner stops
    order = wire.loads(_read_line(0) or b"{}")
    if "spec" not in order:
        return 2
    threading.Thread(target=_watch_stdin, name="stdin-watch", daemon=True).start()
    level = order.get("log_level", "info").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s runner[{os.getpid()} "
                                           f"{order['spec']['name']}] %(name)s: %(message)s"))
    root = logging.getLogger("localrun")
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
    try:  # uvloop where it is installed (not on Windows): cheaper wakeups per token than asyncio's loop
        import uvloop
    except ImportError:
        return asyncio.run(_main(int(args[0]), order))
    return uvloop.run(_main(int(args[0]), order))


if __name__ == "__main__":
    sys.exit(main())
