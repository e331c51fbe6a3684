"""The HTTP client's going, as a cancel: a request whose client closed the connection stops its work.

:func:`until_disconnected` (a non-streamed answer, or a stream's start) and
:func:`disconnect_cancels` (a streamed response's body) await the ASGI ``http.disconnect``
message and cancel the work; the route ends with :class:`ClientGone` (499), which nobody reads.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

from localrun.errors import LocalrunError


class ClientGone(LocalrunError):
    """The HTTP client closed the connection before its (non-streamed) answer was ready."""

    status = 499
    code = "client_closed_request"


async def until_disconnected(request: Any, coro) -> Any:
    """Run `coro`, cancelling it when the HTTP client goes away: a non-streamed request, or a
    streamed one's start (queue, load, prefill: an IDE gives a stale completion up at the next
    keystroke); the work stops (the backend aborts the request) and the route ends with
    ClientGone, which nobody is left to read, instead of an exception escaping to the server.

    The client's going is the ASGI server's ``http.disconnect`` message, awaited (the route has
    read the body by then, so that is the next message): no polling. Starlette's
    ``is_disconnected()`` polled every 50 ms per waiting stream, each poll a cancel scope whose
    message formats the task's repr: 40% of the daemon's CPU with 8 streams on 2 cores, taken from
    llama.cpp's threads.

    On Python 3.11+ `coro` runs in the caller's own task, which the watcher cancels (and the
    cancel is taken back here): no task started for it, no turn of the event loop to hand its
    result back, on the path of every streamed request's first token."""
    if CANCEL_IN_TASK:
        async with disconnect_cancels(request.receive):
            return await coro
    task = asyncio.ensure_future(coro)
    gone = False

    async def watch():
        nonlocal gone
        while not task.done():
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:
            raise ClientGone("the client closed the connection") from None
        raise
    finally:
        watcher.cancel()


CANCEL_IN_TASK = hasattr(asyncio.Task, "uncancel")  # Python 3.11+


@asynccontextmanager
async def disconnect_cancels(receive: Callable[[], Awaitable[dict]]):
    """Inside the block, the client's going (the ASGI ``http.disconnect`` message, awaited by a watcher
    task) cancels this very task; leaving the block because of it raises ClientGone, the cancel taken
    back (``Task.uncancel``; Python 3.11+: CANCEL_IN_TASK). A cancel from elsewhere too (the server
    stopping) stays a cancel. The watcher runs only while this task waits inside the block, so its cancel
    lands there; once the block is left (``done``) it cancels nothing. Used by until_disconnected and by
    a streamed response's body (state.ClosingStreamingResponse): no task for the work itself, and no turn
    of the event loop to hand its result back."""
    task = asyncio.current_task()
    gone = done = False

    async def watch():
        nonlocal gone
        while not done:
            message = await receive()
            if message.get("type") == "http.disconnect":
                if not done:
                    gone = True
                    task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if gone and not task.uncancel():
            raise ClientGone("the client closed the connection") from None
        raise
    finally:
        done = True
        watcher.cancel()



__all__ = ["ClientGone", "until_disconnected", "disconnect_cancels", "CANCEL_IN_TASK"]
