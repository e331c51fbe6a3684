"""FreshThreadExecutor: one task at a time, in order, each on a thread of its own that is gone afterwards
(what lets llama.cpp's OpenMP team of a helper thread go: tests/test_llamacpp_batch.py and
tests/test_llamacpp_images.py check that on the real backend)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from localrun.backends.llamacpp.fresh_threads import FreshThreadExecutor


def test_tasks_run_in_order_each_on_a_thread_that_then_exits():
    ex = FreshThreadExecutor("t")
    seen: list[tuple[int, threading.Thread]] = []
    gate = threading.Event()

    def task(i: int) -> int:
        if i == 0:
            gate.wait(5)  # the others queue behind it
        seen.append((i, threading.current_thread()))
        return i * 10

    futs = [ex.submit(task, i) for i in range(5)]
    assert not any(f.done() for f in futs)
    gate.set()
    assert [f.result(5) for f in futs] == [0, 10, 20, 30, 40]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    threads = [t for _, t in seen]
    assert len({id(t) for t in threads}) == 5 and all(t.name == "t" for t in threads)
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    ex.shutdown()


def test_errors_cancels_and_shutdown():
    ex = FreshThreadExecutor("t")
    gate = threading.Event()
    first = ex.submit(gate.wait, 5)
    boom = ex.submit(lambda: 1 / 0)
    later = ex.submit(lambda: "never")
    assert later.cancel()  # still queued: cancelled, never run
    gate.set()
    assert first.result(5) is True
    with pytest.raises(ZeroDivisionError):
        boom.result(5)
    ex.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print)

    ex = FreshThreadExecutor("t")
    gate.clear()
    running = ex.submit(gate.wait, 5)
    queued = ex.submit(lambda: "never")
    t = threading.Timer(0.2, gate.set)
    t.start()
    t0 = time.monotonic()
    ex.shutdown(wait=True, cancel_futures=True)  # waits for the running task, drops the queued one
    assert running.result(0) is True and queued.cancelled() and time.monotonic() - t0 >= 0.15


def test_asyncio_runs_blocking_work_on_it():
    ex = FreshThreadExecutor("t")

    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(ex, threading.get_ident) for _ in range(3)))

    idents = asyncio.run(main())
    assert len(set(idents)) <= 3 and threading.get_ident() not in idents
    ex.shutdown()
