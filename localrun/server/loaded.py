"""The daemon's handle on a loaded model (LoadedModel), the Lease a request holds on it, and its /api/ps row.

The model manager (:mod:`localrun.server.manager`) keeps one :class:`LoadedModel` per loaded
model; the process that runs it is the runner (``localrun.backends.runner.process``), whose own loop is
``localrun.backends.runner.worker``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from localrun.backends.base import Backend
from localrun.backends.select import BackendChoice
from localrun.server.memory import Plan


@dataclass
class LoadedModel:
    """A loaded model, as the daemon holds it: its backend (the proxy of its runner process), how it was
    placed, its slots and keep-alive."""

    name: str
    digest: str
    resolved: Any  # library ResolvedModel
    backend: Backend
    choice: BackendChoice
    plan: Plan
    num_ctx: int
    load_seconds: float
    sem: asyncio.Semaphore
    active: int = 0
    waiting: int = 0
    keep_alive: float | None = 300.0
    expires_at: float | None = None  # wall clock; None while busy or forever
    last_used: float = field(default_factory=time.monotonic)
    closing: bool = False
    orphan: bool = False  # its model was deleted from the library: it finishes its requests, then unloads
    fallbacks: list[str] = field(default_factory=list)  # the daemon's own (auto's native -> llama.cpp)

    @property
    def info(self):
        return self.backend.info

    def ps(self) -> dict[str, Any]:
        r = self.resolved
        details = _details(r)
        info = self.info
        expires = self.expires_at
        if expires is None:  # busy, or forever: Ollama shows a far-future time for forever
            expires = time.time() + (self.keep_alive if self.keep_alive is not None else 10 * 365 * 86400)
        return {
            "name": self.name,
            "model": self.name,
            "size": int(info.size_bytes or self.plan.size),
            "digest": self.digest.removeprefix("sha256:"),
            "details": details,
            "expires_at": _iso(expires),
            "size_vram": int(info.size_vram_bytes or self.plan.size_vram),
            "context_length": self.num_ctx,
            "backend": info.name,
            "processor": info.processor if info.name != "llama.cpp" else self.plan.processor,
            "device": info.device,
            "placement": info.placement or info.device,
            "reason": info.reason or f"{self.choice.reason}; {self.plan.detail}",
            "fallbacks": [*self.fallbacks, *info.fallbacks],
            "kv_cache_type": info.kv_cache_type or None,
            "slots": info.slots,
            "active": self.active,
            "waiting": self.waiting,
            **self._runner_ps(),
        }

    def _runner_ps(self) -> dict[str, Any]:
        """The runner process: its pid and memory (resident set, and VRAM its backend holds)."""
        pid = getattr(self.backend, "pid", None)
        if pid is None:
            return {}
        mem = self.backend.memory() if hasattr(self.backend, "memory") else {}
        return {"runner": {"pid": pid, "rss_bytes": mem.get("rss", 0), "vram_bytes": mem.get("vram", 0)}}


def _iso(ts: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc).astimezone().isoformat()


def _details(resolved: Any) -> dict[str, Any]:
    info = getattr(resolved, "info", None)
    arch = getattr(info, "architecture", None) or ""
    params = getattr(info, "parameter_count", None)
    return {
        "parent_model": "",
        "format": getattr(resolved, "format", "gguf"),
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": _param_size(params),
        "quantization_level": getattr(info, "quantization", None) or getattr(info, "file_type", None) or "",
    }


def _param_size(n: int | None) -> str:
    if not n:
        return ""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}".replace(".0", "")
    return str(n)


@dataclass
class Lease:
    """One request's hold on a loaded model (ModelManager.use): a generation slot, or none (slot=False)."""

    runner: LoadedModel
    num_ctx: int  # the window this request may use (<= the loaded one)
    load_seconds: float
    waited_seconds: float

    @property
    def backend(self) -> Backend:
        return self.runner.backend


__all__ = ["LoadedModel", "Lease"]
