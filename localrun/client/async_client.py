"""The async client (for Textual): the blocking client's calls, same names, sent with ``httpx.AsyncClient``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any, AsyncIterator

import httpx

from localrun.client.base import ClientBase
from localrun.client.calls import Call, bind_requests
from localrun.client.errors import check_event


@bind_requests("_send")
class AsyncDaemonClient(ClientBase):
    """Async twin of DaemonClient: `await c.tags()`, `async for chunk in c.chat(...)`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 600):
        super().__init__(base_url, api_key, timeout)
        self._http = httpx.AsyncClient(**self._client_kwargs())
        self.started_pid: int | None = None
        self.started_elsewhere = False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncDaemonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def is_up(self) -> bool:
        try:
            r = await self._http.get("/api/version", timeout=2.0)
        except httpx.HTTPError:
            return False
        return r.status_code in (200, 401)

    async def ensure_running(self, autostart: bool = True, wait_s: float = 30) -> None:
        if await self.is_up():
            return
        err = self._not_started(autostart)
        if err:
            raise err
        proc = self._spawn()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            exited = proc.poll() is not None  # (before asking: a child gone by then did not answer)
            if await self.is_up():
                ours = not exited and await self._serves(proc)
                await asyncio.to_thread(self._adopt, proc, ours)
                return
            if exited:
                # it may have lost the port to a daemon another command started: give that one a moment
                grace = time.monotonic() + self.RACE_GRACE_S
                while time.monotonic() < grace:
                    await asyncio.sleep(0.1)
                    if await self.is_up():
                        self._adopt(proc, False)
                        return
                raise self._start_failed(proc)
            await asyncio.sleep(0.1)
        raise self._timed_out(proc, wait_s)

    async def _serves(self, proc: subprocess.Popen) -> bool:
        """DaemonClient._serves, without blocking the event loop."""
        ours = self._child_listens(proc)
        if ours is None:
            grace = time.monotonic() + self.RACE_GRACE_S
            while proc.poll() is None:
                if time.monotonic() > grace:
                    return True
                await asyncio.sleep(0.1)
            return False
        return ours

    def _send(self, call: Call) -> Any:
        return self._stream(call) if call.stream else self._request(call)

    async def _request(self, call: Call) -> Any:
        try:
            r = await self._http.request(call.method, call.path, json=call.body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        return self._result(call, r)

    async def _stream(self, call: Call) -> AsyncIterator[dict]:
        try:
            async with self._http.stream(call.method, call.path, json=call.body) as r:
                if r.status_code >= 400:
                    raise self._stream_error(r, await r.aread())
                async for line in r.aiter_lines():
                    if line.strip():
                        yield check_event(json.loads(line))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
