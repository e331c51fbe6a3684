"""The model manager: what is loaded where, for how long, and who waits for it.

- Load on first use; a memory plan before every load (``localrun.server.memory``).
- keep_alive per request (seconds; None = forever; 0 = unload as soon as idle), the
  default from LOCALRUN_KEEP_ALIVE; an idle reaper unloads expired models.
- Several models loaded at once; beyond LOCALRUN_MAX_LOADED_MODELS, or when the memory
  plan says the new model does not fit, the least recently used idle model is evicted.
- Per model at most ``info.slots`` generations run at once; up to LOCALRUN_MAX_QUEUE
  more wait; beyond that ``Busy`` (503 + Retry-After) at once.
- A request asking for a larger num_ctx than the loaded one reloads the model when it
  is idle; a smaller one runs in the loaded context with the smaller limit enforced. So does one
  whose load options (``LOAD_OPTIONS``: Ollama's per-request num_thread, num_gpu) differ from the
  loaded model's, as Ollama reloads for them.
- Each loaded model lives in a runner process of its own (``localrun.backends.runner.process``),
  started by the ``loader`` (a parameter, so tests can hand in an in-process fake). A
  runner that dies is forgotten at once: its requests got their errors from the runner's
  proxy, and the next request loads the model again. A runner that dies while loading is
  tried once more; a second death is an error naming the likely cause.
- When ``auto`` chose the native engine for a GGUF model and its load fails, the model is
  loaded with llama.cpp instead, the reason in ps's "fallbacks".

Which backend, what ``LoadSpec`` and what memory a load needs: :mod:`localrun.server.placement`.
The handle on each loaded model (``LoadedModel``) and a request's ``Lease`` on it:
:mod:`localrun.server.loaded`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from localrun.backends.base import Backend, LoadSpec
from localrun.backends.runner.process import RunnerDied, describe_exit, likely_cause
from localrun.backends.select import BackendChoice, fallback_reason, local_cuda_gpu
from localrun.config import Settings
from localrun.errors import Busy, InsufficientMemory, InvalidRequest, LocalrunError, BackendError
from localrun.server.loaded import Lease, LoadedModel
from localrun.server.memory import free_ram, plan_load
from localrun.server.placement import Placement, load_options

log = logging.getLogger("localrun.manager")

DEFAULT = object()  # "keep_alive not given": use LOCALRUN_KEEP_ALIVE

Loader = Callable[[LoadSpec, str], Awaitable[Backend]]  # (spec, backend name) -> a loaded Backend


def runner_loader(settings: Settings) -> Loader:
    """The daemon's loader: each model in a runner process of its own."""
    from localrun.backends.runner.process import start_runner

    async def load(spec: LoadSpec, backend: str) -> Backend:
        return await start_runner(spec, backend, timeout=settings.load_timeout, log_level=settings.log_level)

    return load


class ModelManager:
    def __init__(self, settings: Settings, library: Any, loader: Loader | None = None):
        self.settings = settings
        self.library = library
        self._loader = loader or runner_loader(settings)
        self.runners: dict[str, LoadedModel] = {}
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task | None = None
        self._queued: dict[str, int] = {}
        self.placement = Placement(settings)  # which backend, what spec, what memory: for each load
        self._forgotten: dict[str, int] = {}  # model name -> how many times it was deleted (see forget)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())

    async def shutdown(self, grace: float = 5.0) -> None:
        """Unload everything; in-flight requests get `grace` seconds, then their backends
        are closed anyway (a backend's close() waits for its worker threads to stop)."""
        if self._reaper:
            self._reaper.cancel()
            self._reaper = None
        for name in list(self.runners):
            await self.unload(name, wait=grace)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for r in list(self.runners.values()):
                if r.active == 0 and r.waiting == 0 and r.expires_at is not None and now >= r.expires_at:
                    log.info("unloading %s: keep_alive expired", r.name)
                    await self.unload(r.name)

    # -- keep_alive ----------------------------------------------------------------------
    def keep_alive_seconds(self, keep_alive: Any) -> float | None:
        if keep_alive is DEFAULT or keep_alive is None:
            return self.settings.keep_alive
        from localrun.config import parse_duration

        try:
            return parse_duration(keep_alive)
        except ValueError as exc:
            raise InvalidRequest(f"keep_alive: {exc}") from None

    def _set_expiry(self, r: LoadedModel, keep_alive: float | None) -> None:
        r.keep_alive = keep_alive
        r.last_used = time.monotonic()
        if r.active or r.waiting:
            r.expires_at = None
        elif keep_alive is None:
            r.expires_at = None
        else:
            r.expires_at = time.time() + keep_alive

    # -- using a model -------------------------------------------------------------------
    def default_num_ctx(self, resolved: Any, quiet: bool = False) -> int:
        return self.placement.default_num_ctx(resolved, quiet)

    def window(self, resolved: Any) -> int:
        """The context a request that names no num_ctx gets: the loaded model's, else the one a load
        would make (what /v1/models reports as max_model_len)."""
        r = self.runners.get(resolved.name)
        if r is not None and not r.closing and r.digest == resolved.digest:
            return r.num_ctx
        return self.placement.default_num_ctx(resolved, quiet=True)

    async def fitting_context(self, resolved: Any, ceiling: int) -> tuple[int, str]:
        """The largest num_ctx up to `ceiling` (the ceiling, or a multiple of 1,024) that a load of
        `resolved` fits in the memory free with every model unloaded (Placement.fitting_context). (num_ctx, why)."""
        return await self.placement.fitting_context(resolved, ceiling, self.runners, free_ram)

    @asynccontextmanager
    async def use(self, resolved: Any, *, num_ctx: int | None = None, keep_alive: Any = DEFAULT,
                  slot: bool = True) -> AsyncIterator["Lease"]:
        """Hold one generation slot of `resolved`'s model (loading it first if needed). `slot` False:
        the loaded model without a slot, for work that generates nothing (tokenize, detokenize, count
        tokens): it must not wait behind running generations (an agent counts its context while a
        stream runs); the model is still kept loaded while it is in use."""
        ka = self.keep_alive_seconds(keep_alive)
        key = resolved.name
        queued = self._queued.get(key, 0)
        if queued >= self.settings.max_queue:
            raise Busy(f"{key}: {queued} requests are already waiting (LOCALRUN_MAX_QUEUE={self.settings.max_queue}); "
                       "retry shortly", retry_after=2)
        self._queued[key] = queued + 1
        t0 = time.perf_counter()
        loaded_now = False
        runner: LoadedModel | None = None
        try:
            while True:
                runner, did_load = await self._ensure(resolved, num_ctx)
                loaded_now = loaded_now or did_load
                if not slot:  # (_ensure gives a runner that is not closing, and nothing awaited since)
                    break
                runner.waiting += 1
                runner.expires_at = None
                try:
                    await runner.sem.acquire()
                finally:
                    runner.waiting -= 1
                if runner.closing:  # reloaded under us (bigger num_ctx): try again
                    runner.sem.release()
                    continue
                break
        finally:
            self._queued[key] -= 1
            if not self._queued[key]:
                del self._queued[key]
        runner.active += 1
        runner.expires_at = None
        lease = Lease(runner, num_ctx=min(num_ctx or runner.num_ctx, runner.num_ctx),
                      load_seconds=runner.load_seconds if loaded_now else 0.0, waited_seconds=time.perf_counter() - t0)
        try:
            yield lease
        finally:
            runner.active -= 1
            if slot:
                runner.sem.release()
            if runner.orphan:
                ka = 0
            self._set_expiry(runner, ka)
            self._notify()
            if ka == 0 and runner.active == 0 and runner.waiting == 0:
                asyncio.get_running_loop().create_task(self._unload_if_idle(runner))

    async def load(self, resolved: Any, *, num_ctx: int | None = None,
                   keep_alive: Any = DEFAULT) -> tuple[LoadedModel, float]:
        """Load (or keep) a model without generating: Ollama's empty-prompt request."""
        ka = self.keep_alive_seconds(keep_alive)
        t0 = time.perf_counter()
        runner, did = await self._ensure(resolved, num_ctx)
        self._set_expiry(runner, ka)
        if ka == 0:
            await self._unload_if_idle(runner)
        return runner, (time.perf_counter() - t0 if did else 0.0)

    def forget(self, name: str) -> None:
        """`name` was deleted from the library. Its runner (or one that is loading it now) serves the
        requests it already has, then unloads; nothing waits here (Ollama's delete answers at once). New
        requests cannot resolve the name, so none loads it again."""
        self._forgotten[name] = self._forgotten.get(name, 0) + 1
        r = self.runners.get(name)
        if r is not None:
            self._orphan(r)

    def _orphan(self, r: LoadedModel) -> None:
        r.orphan = True
        self._set_expiry(r, 0)
        if not r.active and not r.waiting:
            asyncio.get_running_loop().create_task(self._unload_if_idle(r))
        self._notify()

    async def _unload_if_idle(self, runner: LoadedModel) -> None:
        if runner.active == 0 and runner.waiting == 0 and self.runners.get(runner.name) is runner:
            await self.unload(runner.name)

    async def unload(self, name: str, wait: float | None = None) -> bool:
        """Unload once the model's in-flight requests end (or after `wait` seconds)."""
        r = self.runners.pop(name, None)
        if r is None:
            return False
        r.closing = True
        deadline = None if wait is None else time.monotonic() + wait
        while r.active and (deadline is None or time.monotonic() < deadline):
            await self._wait_change(0.5)
        try:
            await r.backend.close()
        except Exception:  # pragma: no cover
            log.exception("closing %s failed", name)
        log.info("unloaded %s", name)
        self._notify()
        return True

    async def _wait_change(self, timeout: float) -> None:
        # asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancel (the client went
        # away) that lands together with the event, and the request would go on waiting
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            waiter.cancel()

    async def _ensure(self, resolved: Any, num_ctx: int | None) -> tuple[LoadedModel, bool]:
        key = resolved.name
        want = self.placement.cap_ctx(resolved, num_ctx) if num_ctx else None

        def fits(r: LoadedModel | None) -> bool:
            return (r is not None and not r.closing and r.digest == resolved.digest and (want is None or want <= r.num_ctx)
                    and load_options(r.resolved) == load_options(resolved))

        r = self.runners.get(key)
        if fits(r):
            return r, False
        async with self._load_lock:
            r = self.runners.get(key)
            if fits(r):
                return r, False
            if r is not None:  # changed model, a bigger context or other load options: reload once idle
                log.info("reloading %s (num_ctx %s -> %s, load options %s -> %s)", key, r.num_ctx, want,
                         load_options(r.resolved) or "none", load_options(resolved) or "none")
                await self.unload(key)
            return await self._load(resolved, want or self.placement.default_num_ctx(resolved)), True

    def _evictable(self, exclude: str) -> list[LoadedModel]:
        idle = [r for r in self.runners.values() if r.name != exclude and r.active == 0 and r.waiting == 0]
        return sorted(idle, key=lambda r: r.last_used)

    async def _make_room(self, key: str) -> None:
        while len(self.runners) >= self.settings.max_loaded_models:
            idle = self._evictable(key)
            if idle:
                log.info("evicting %s (least recently used; LOCALRUN_MAX_LOADED_MODELS=%d)",
                         idle[0].name, self.settings.max_loaded_models)
                await self.unload(idle[0].name)
            else:
                await self._wait_change(1.0)
    async def _load(self, resolved: Any, num_ctx: int) -> LoadedModel:
        """Load with the backend `choose` picks; when auto picked the native engine for a GGUF and
        that load fails (for any reason: an architecture or quantization it cannot run, a CUDA
        error, no memory), load it with llama.cpp instead. The failure is logged once and kept
        (per model digest, until the daemon restarts: later loads go to llama.cpp directly) and
        shown in ps's "fallbacks". LOCALRUN_BACKEND=native reports the error instead."""
        key = resolved.name
        gpu = await asyncio.to_thread(local_cuda_gpu)
        choice = self.placement.choose(resolved, gpu)
        if not self.placement.may_fall_back(resolved, choice):
            return await self._load_with(resolved, num_ctx, gpu, choice)
        error = self.placement.native_failed.get(resolved.digest)
        if error is None:
            try:
                return await self._load_with(resolved, num_ctx, gpu, choice)
            except Exception as exc:  # noqa: BLE001 - any failure of the native load: llama.cpp runs it
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                error = error.removeprefix(f"failed to load {key}: ")  # the runner's wrapping says it twice
                self.placement.native_failed[resolved.digest] = error
                log.warning("%s: %s", key, fallback_reason(error))
            gpu = await asyncio.to_thread(local_cuda_gpu)
        why = fallback_reason(error)
        return await self._load_with(resolved, num_ctx, gpu, BackendChoice("llamacpp", f"llama.cpp: {why}"), [why])

    async def _load_with(self, resolved: Any, num_ctx: int, gpu: Any, choice: BackendChoice,
                         fallbacks: list[str] | None = None) -> LoadedModel:
        key = resolved.name
        deleted = self._forgotten.get(key, 0)  # (deleted while loading: see forget)
        sized = await self.placement.sized(resolved, num_ctx, gpu, choice, free_ram)
        est, layers, where = sized.estimate, sized.layers, sized.where

        # admission before eviction: refuse a model that cannot fit even with every other model
        # unloaded, without touching the loaded ones
        others = [r for r in self.runners.values() if r.name != key]
        gpu_kind, gpu_free = where(gpu)
        try:
            plan_load(est, layers, ram_free=free_ram() + sum(r.plan.size - r.plan.size_vram for r in others),
                      gpu_free=None if gpu_free is None else gpu_free + sum(r.plan.size_vram for r in others),
                      gpu_kind=gpu_kind)
        except InsufficientMemory as exc:
            raise InsufficientMemory(f"{key} cannot fit even with every other model unloaded: {exc.message}") from None
        await self._make_room(key)
        while True:
            gpu_kind, gpu_free = where(gpu)
            try:
                plan = plan_load(est, layers, ram_free=free_ram(), gpu_free=gpu_free, gpu_kind=gpu_kind)
                break
            except InsufficientMemory:
                idle = self._evictable(key)
                if not idle:
                    raise
                log.info("evicting %s to make room for %s", idle[0].name, key)
                await self.unload(idle[0].name)
                gpu = await asyncio.to_thread(local_cuda_gpu)
        spec = self.placement.placed(sized, choice, plan)
        log.info("loading %s with %s: %s; %s (num_ctx %d, %d slots)", key, choice.backend, choice.reason,
                 plan.summary, num_ctx, spec.num_parallel)
        t0 = time.perf_counter()
        backend = await self._start(spec, choice.backend)
        dt = time.perf_counter() - t0
        log.info("loaded %s in %.2fs", key, dt)
        runner = LoadedModel(name=key, digest=resolved.digest, resolved=resolved, backend=backend, choice=choice,
                             plan=plan, num_ctx=num_ctx, load_seconds=dt, sem=asyncio.Semaphore(backend.info.slots),
                             keep_alive=self.settings.keep_alive, fallbacks=list(fallbacks or ()))
        self.runners[key] = runner
        exited = getattr(backend, "exited", None)
        if exited is not None:
            exited.add_done_callback(lambda _f: self._runner_exited(runner))
        if self._forgotten.get(key, 0) != deleted:  # deleted while it loaded: serve who waits, then unload
            self._orphan(runner)
        self._notify()
        return runner

    async def _start(self, spec: LoadSpec, backend: str) -> Backend:
        """Load through the loader; a runner that dies while loading gets one more try."""
        for attempt in (1, 2):
            try:
                return await self._loader(spec, backend)
            except RunnerDied as exc:
                if attempt == 1:
                    log.warning("%s; trying once more", exc.message)
                    continue
                cause = likely_cause(exc.returncode, backend, spec.extra.get("extra_buffers"))
                raise BackendError(f"the runner for {spec.name} died twice while loading it "
                                   f"({describe_exit(exc.returncode)}); likely cause: {cause}") from None
            except LocalrunError:
                raise
            except Exception as exc:
                log.exception("loading %s failed", spec.name)
                raise BackendError(f"failed to load {spec.name}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def _runner_exited(self, runner: LoadedModel) -> None:
        """A runner process ended: forget it (unless it was being unloaded anyway)."""
        if self.runners.get(runner.name) is runner:
            del self.runners[runner.name]
            runner.closing = True
            log.warning("%s is no longer loaded: its runner process ended; the next request loads it again",
                        runner.name)
            self._notify()

    def ps(self) -> list[dict[str, Any]]:
        return [r.ps() for r in sorted(self.runners.values(), key=lambda r: -r.last_used)]

