"""When a step fails: out of memory (shrink and go on), a dead tensor-parallel rank, any other error; the requests ended.

`StepFailures` is a mixin of `LLMEngine`: failing requests touches the same request table,
inbox, in-flight step and locks as the loop, so it stays methods on the engine. The loop
calls `_out_of_memory` or `_fail_all(self._step_failed(exc))` when `step()` raises; rank 0's
watcher calls `_peer_died` when a follower rank is gone.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from localrun.engine import fallbacks as fb
from localrun.engine.groups import RequestGroups
from localrun.engine.parallel.group import TPGroup
from localrun.engine.requests import EngineRequest, StreamDelta
from localrun.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from localrun.engine.runner import StepHandle


class StepFailures:
    """Ending requests with an error, and what the engine does after a failed step."""

    # the engine's state this reads and writes (set in LLMEngine.__init__)
    device: torch.device
    tp: TPGroup
    fatal: str | None
    scheduler: Scheduler
    groups: RequestGroups
    _requests: dict[str, EngineRequest]
    _inflight: StepHandle | None
    _lock: threading.RLock

    def _out_of_memory(self, exc: Exception) -> None:
        """A step ran out of memory: its requests (those holding KV pages) end with the cause, the
        step budget, the batch and the KV pool are halved, and the engine goes on serving."""
        with self._lock:
            self._inflight = None
            victims = [r for r in self._requests.values() if r.seq.status != "waiting"]
            for req in victims:
                self.scheduler.abort(req.seq.id)
            where = "GPU memory" if self.device.type == "cuda" else "memory"
            try:
                what = fb.shrink_after_oom(self)
            except Exception as err:  # noqa: BLE001 - e.g. not even one full-length sequence fits: reload
                self.fatal = f"out of {where} in a step ({fb.short(exc)}), and shrinking failed: {fb.short(err)}"
                self._fail_all(self.fatal)
                return
            self._fallback(f"out of memory in a step ({fb.short(exc)}): {what}")
            self._fail_all(f"out of {where} while running this request ({fb.short(exc)}); the engine {what} and "
                           "goes on serving: retry, or use a smaller num_ctx or prompt", victims, "out_of_memory")

    def _fail_all(self, message: str, reqs: list[EngineRequest] | None = None, kind: str | None = None) -> None:
        """End every request (or only `reqs`) with the error `message`."""
        with self._lock:
            self._inflight = None  # its tokens belong to the requests failed below
            if reqs is None:
                self._drain_inbox()
                self.groups.clear()
            for req in list(self._requests.values()) if reqs is None else reqs:
                self.scheduler.abort(req.seq.id)
                self._requests.pop(req.seq.id, None)
                if req.stream is not None:
                    req.finish_time = time.perf_counter()
                    d = StreamDelta([], "", "abort", None, self._usage(req), error=message, error_kind=kind)
                    try:
                        req.stream._push(d)
                    except RuntimeError:
                        pass

    def _peer_died(self, message: str) -> None:
        """Rank 0's watcher: a follower is gone, so no step can complete; end every request with
        the reason. The loop thread may be stuck in a collective (NCCL waits for its timeout):
        then the streams are ended without it."""
        self.fatal = message
        if self._lock.acquire(timeout=2.0):
            try:
                self._fail_all(message)
            finally:
                self._lock.release()
            return
        for req in list(self._requests.values()):
            if req.stream is not None:
                req.finish_time = time.perf_counter()
                try:
                    req.stream._push(StreamDelta([], "", "abort", None, self._usage(req), error=message))
                except RuntimeError:
                    pass

    def _step_failed(self, exc: Exception) -> str:
        """Why a step failed. With tensor parallelism every failure is fatal: the ranks are no
        longer in step."""
        msg = f"engine step failed: {type(exc).__name__}: {exc}"
        if self.tp.world > 1:
            dead = self.tp.wait_dead(1.0)
            self.fatal = self.fatal or (dead or f"tensor-parallel {msg}")
            return self.fatal
        return msg
