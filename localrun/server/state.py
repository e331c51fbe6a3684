"""The daemon's shared state (settings, library, model manager) and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from localrun.config import Settings
from localrun.errors import InvalidRequest
from localrun.server.manager import DEFAULT, Lease, ModelManager


class State:
    def __init__(self, settings: Settings, library: Any):
        self.settings = settings
        self.library = library
        self.manager = ModelManager(settings, library)
        self.write_lock = asyncio.Lock()  # library writes go through one path, one at a time

    async def resolve(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("'model' must be a non-empty string")
        return await asyncio.to_thread(self.library.resolve, name)

    async def list_models(self):
        return await asyncio.to_thread(self.library.list)

    @staticmethod
    def keep_alive(body: dict) -> Any:
        return body["keep_alive"] if body.get("keep_alive") is not None else DEFAULT

    async def lease(self, resolved: Any, **kw: Any) -> tuple[Lease, Callable[[], Awaitable[None]]]:
        """Enter manager.use() and hand back an idempotent release (for streaming responses,
        whose body may never start when the client leaves early)."""
        cm = self.manager.use(resolved, **kw)
        lease = await cm.__aenter__()
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                await cm.__aexit__(None, None, None)

        return lease, release


MAX_JSON_DEPTH = 64


async def json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def sse_response(events: AsyncIterator[bytes], release: Callable[[], Awaitable[None]]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(release))


def ndjson_response(events: AsyncIterator[bytes], release: Callable[[], Awaitable[None]] | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type="application/x-ndjson",
                             background=BackgroundTask(release) if release else None)


def ndjson(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
