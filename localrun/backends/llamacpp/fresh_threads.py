"""An executor that runs each task on a thread of its own, which exits when the task is done.

llama.cpp computes with OpenMP (libgomp) on Linux builds. libgomp keeps a team of worker threads for
every thread that ever ran a parallel computation, for as long as that thread lives, and while the
threads it manages outnumber the CPUs it spins only ~100 times at a barrier before sleeping, so the
batched loop's every step then waits on futex wake-ups. A persistent helper thread that computed once
(an embeddings context, the vision encoder) left its team behind for good: on 2 CPUs one embeddings
request took SmolLM2's generation from ~160 to ~90 tok/s until the runner exited. A thread that exits
takes its team with it; thread creation costs microseconds against a computation's milliseconds.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable


class FreshThreadExecutor(Executor):
    """One task at a time, in order of submission, each on a new thread (named ``name``) that exits
    after it. ``submit`` / ``shutdown`` as concurrent.futures' executors (asyncio's run_in_executor takes it)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._tasks: collections.deque[tuple[Future, Callable[..., Any], tuple, dict]] = collections.deque()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot run a task after shutdown")
            self._tasks.append((fut, fn, args, kwargs))
            if self._idle.is_set():
                self._idle.clear()
                self._start_next()
        return fut

    def _start_next(self) -> None:  # under self._lock, with a task queued
        threading.Thread(target=self._run, args=self._tasks.popleft(), name=self._name, daemon=True).start()

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the future carries it
                fut.set_exception(exc)
        with self._lock:  # the next task gets a thread of its own; this one ends here
            if self._tasks:
                self._start_next()
            else:
                self._idle.set()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            if cancel_futures:
                while self._tasks:
                    self._tasks.popleft()[0].cancel()
        if wait:
            self._idle.wait()


__all__ = ["FreshThreadExecutor"]
