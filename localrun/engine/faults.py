"""Injected faults (LOCALRUN_FAULTS): make a named load or engine step fail for real.

Each fallback of the GPU path can so be exercised on any machine, through the real runner process
and daemon.

The value is a comma-separated list of ``KIND`` or ``KIND:ARG`` items, read from the environment of
the process that runs the step (the daemon passes its environment to runner processes):

    kernel:NAME         the Triton kernel NAME fails to compile/launch at warm-up
    graph_capture[:BS]  CUDA graph capture fails (for batch size BS only, or for all)
    kv_alloc[:N]        the first N KV pool allocations are refused as out of memory (default 1)
    step_oom[:N]        the first N forward steps raise out of memory (default 1)
    native_load[:MODEL] the native engine fails to load any model (or only the model named MODEL)

Standard library only (the parsing lives in localrun/config.py): the engine and the benchmarks import
it without the server's dependencies.
"""

from __future__ import annotations

import os
import threading

from localrun.config import parse_faults

ENV = "LOCALRUN_FAULTS"


class InjectedFault(RuntimeError):
    """Raised where LOCALRUN_FAULTS asks a step to fail."""


_lock = threading.Lock()
_counts: dict[str, int] = {}  # kind -> calls of take() that failed so far


def active(kind: str, env: dict[str, str] | None = None) -> list[str | None]:
    """The arguments of every ``kind`` fault set (``[None]`` for a bare ``kind``; ``[]`` when unset)."""
    return [arg for k, arg in parse_faults((env if env is not None else os.environ).get(ENV)) if k == kind]


def take(kind: str, default_count: int = 1, env: dict[str, str] | None = None) -> bool:
    """For counted faults (kv_alloc[:N], step_oom[:N]): True for the first N calls in this process, then False."""
    args = active(kind, env)
    if not args:
        return False
    limit = sum(int(a) if a and a.isdigit() else default_count for a in args)
    with _lock:
        n = _counts.get(kind, 0)
        if n >= limit:
            return False
        _counts[kind] = n + 1
        return True


def reset() -> None:
    """Forget the counts (tests that run several loads in one process)."""
    with _lock:
        _counts.clear()
