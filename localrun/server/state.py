"""The daemon's shared state (settings, library, model manager, generation service, metrics)
and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from localrun.config import Settings
from localrun.errors import InvalidRequest
from localrun.server.disconnect import CANCEL_IN_TASK, ClientGone, disconnect_cancels
from localrun.server.generation_service import GenerationService
from localrun.server.manager import DEFAULT, Loader, ModelManager


class State:
    def __init__(self, settings: Settings, library: Any, loader: Loader | None = None):
        from localrun.server.metrics import Metrics

        self.settings = settings
        self.library = library
        self.manager = ModelManager(settings, library, loader)
        self.metrics = Metrics(self.manager)
        self.generation = GenerationService(self.manager, self.metrics)
        self.pulls: set = set()  # cancel events of the pulls and creates in flight
        self._quick: set[str] = set()  # names whose last resolve was cheap (see resolve)
        self._drain: asyncio.Task | None = None

    def begin_drain(self) -> None:
        """SIGTERM: stop admitting, end pulls (they stay resumable), give running generations
        LOCALRUN_SHUTDOWN_GRACE to finish, then end the rest properly."""
        if self._drain is not None:
            return
        for cancel in list(self.pulls):
            cancel.set()
        self._drain = asyncio.get_running_loop().create_task(self.generation.drain(self.settings.shutdown_grace))

    async def resolve(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("'model' must be a non-empty string")
        if name in self._quick:  # resolved fast before (a few small reads): skip the thread hop
            t0 = time.perf_counter()
            r = self.library.resolve(name)
            if time.perf_counter() - t0 > 0.005:
                self._quick.discard(name)
            return r
        t0 = time.perf_counter()
        r = await asyncio.to_thread(self.library.resolve, name)
        if time.perf_counter() - t0 < 0.005 and len(self._quick) < 1024:
            self._quick.add(name)
        return r

    async def list_models(self):
        return await asyncio.to_thread(self.library.list)

    @staticmethod
    def keep_alive(body: dict) -> Any:
        return body["keep_alive"] if body.get("keep_alive") is not None else DEFAULT


MAX_JSON_DEPTH = 64


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _parse(raw: bytes) -> Any:
    body = json.loads(raw)
    # JSON can escape a lone UTF-16 surrogate ("\ud800") that no UTF-8 text holds: every later
    # encode (a tokenizer, a Modelfile, a log line) would fail. Pairs decode to one code point.
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                                 "without its pair), which is not Unicode text") from None
    return body


async def json_body(request: Request) -> dict:
    from starlette.requests import ClientDisconnect

    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body was whole: nobody to answer, nothing to log as an error
        raise ClientGone("the client closed the connection before the body was sent") from None
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:  # a big body is parsed off the event loop (a 32 MiB JSON takes a noticeable while)
        body = _parse(raw) if len(raw) < 256 * 1024 else await asyncio.to_thread(_parse, raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


class ClosingStreamingResponse(StreamingResponse):
    """Starlette leaves the body iterator suspended when the client goes away while a chunk is
    being sent (the response task is cancelled outside the iterator); closing it here runs the
    route's `finally`, so the backend's work is aborted now, not whenever the GC gets to it.

    The body is sent from the route's own task, which the client's going cancels
    (generation.disconnect_cancels). Starlette's own way (for uvicorn's ASGI 2.3) starts the body in a
    new task of an anyio task group beside a disconnect listener: ~0.35 ms between the first token and
    its response headers after an idle spell, on a daemon whose whole budget over llama.cpp is 5 ms.
    (Python 3.10, without Task.uncancel, keeps Starlette's.)"""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not CANCEL_IN_TASK:
            return await super().__call__(scope, receive, send)
        try:
            async with disconnect_cancels(receive):
                await super().stream_response(send)
        except ClientGone:
            pass
        finally:
            await self._close()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send) -> None:  # (Starlette's __call__, Python 3.10)
        try:
            await super().stream_response(send)
        finally:
            await self._close()

    async def _close(self) -> None:
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            try:
                await close()
            except RuntimeError:  # still being iterated: that frame closes it
                pass


def sse_response(events: AsyncIterator[bytes], release: Callable[[], Awaitable[None]]) -> StreamingResponse:
    return ClosingStreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(release))


def ndjson_response(events: AsyncIterator[bytes], release: Callable[[], Awaitable[None]] | None = None) -> StreamingResponse:
    return ClosingStreamingResponse(events, media_type="application/x-ndjson",
                             background=BackgroundTask(release) if release else None)


def generation_response(gen: Any, produce: Callable[[], AsyncIterator[bytes]],
                        on_error: Callable[[Exception], list[bytes]], *, lines: bool = False) -> StreamingResponse:
    """A streamed generation for any API: `produce()`'s pieces; an error mid-stream (a runner that
    died, the daemon stopping) ends it with `on_error(exc)`'s pieces in the API's own shape (the
    status line is sent by then); the lease goes back however the stream ends."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for data in produce():
                yield data
        except Exception as exc:  # noqa: BLE001 - the answer has begun: the error goes into the stream
            for data in on_error(exc):
                yield data
        finally:
            await gen.release()

    return (ndjson_response if lines else sse_response)(events(), gen.release)


def ndjson(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
