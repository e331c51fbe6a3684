"""How many threads llama.cpp computes with while other processes want the CPUs too.

llama.cpp's CPU threads (OpenMP in the builds pip makes) meet at a barrier after every operation of
the graph, a few hundred times a token. When another process takes one of their CPUs, the kernel
preempts one thread for a time slice and every other thread waits for it at the next barrier. With
every core computing for llama.cpp, any other load then stalls each token for milliseconds, not for
the share of CPU it takes. Measured on 2 AMD EPYC vCPUs, SmolLM2-135M, one stream:

    idle box:                 2 threads 118-127 tok/s, 1 thread 105-112 tok/s
    one busy process beside:  2 threads  38 tok/s,     1 thread  85 tok/s
    two busy processes:       2 threads 0.7 tok/s,     1 thread  44 tok/s

(a user compiling or running a test suite while they chat). :class:`ThreadGovernor` watches how much
CPU the rest of the machine takes (psutil's per-CPU times less this process's own) and gives llama.cpp
the cores nobody else is using, all of them again once the others are quiet. It costs one clock read
a step and one small file read every ``interval`` seconds. It only runs where the thread count was
chosen automatically: a model whose Modelfile sets ``num_thread`` keeps it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable

# the other processes may take this much CPU (in CPUs, beyond the cores llama.cpp does not use)
# before a thread is given up: the daemon and its HTTP clients take a few percent while streaming
SLACK = 0.3


def usable_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset); None if unknown."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def busy_seconds(cpus: set[int] | None = None) -> tuple[float, float] | None:
    """(busy, total) CPU seconds since boot of `cpus` (all CPUs when None), by psutil; None off Linux
    (where llama.cpp's threads are not the OpenMP ones this is measured for)."""
    if not sys.platform.startswith("linux"):
        return None
    import psutil

    busy = total = 0.0
    for i, t in enumerate(psutil.cpu_times(percpu=True)):
        if cpus is not None and i not in cpus:
            continue
        spent = t.user + t.nice + t.system + t.idle + t.iowait + t.irq + t.softirq + t.steal
        total += spent
        busy += spent - t.idle - t.iowait
    return (busy, total) if total else None


def own_seconds() -> float:
    """CPU seconds this process (every thread) has used."""
    t = os.times()
    return t.user + t.system


def threads_for(others: float, n_max: int, logical: int) -> int:
    """Threads for llama.cpp when other processes use `others` CPUs of `logical`: all `n_max` while
    they fit in the CPUs llama.cpp leaves (hyperthreads beside physical cores) plus SLACK, else one
    fewer for each CPU they take beyond that, never fewer than one."""
    over = others - max(0, logical - n_max) - SLACK
    if over <= 0:
        return n_max
    return max(1, n_max - math.ceil(over))


class ThreadGovernor:
    """``poll()`` once a step, on the thread that calls llama_decode: the thread count to set now
    (llama_set_n_threads) when it should change, else None; ``idle()`` when the loop has nothing
    to compute. Fewer threads as soon as one window shows the others' load; more again only after
    two windows in a row say so (no flapping on a short burst).

    A window is ``interval`` seconds of steps, not of the clock: the spells between ``idle()`` and
    the next poll are left out of it, however short. Another program computing while this model had
    nothing to do (an agent's tool running its tests between two requests, the other side of a
    benchmark) is no reason to give up threads; a window counted across such a gap once halved the
    next prompt's prefill (TTFT 51 -> 87 ms, SmolLM2 on 2 vCPUs, short requests 0.1 s apart). A
    window may gather several short requests' steps."""

    def __init__(self, n_max: int, *, logical: int | None = None, interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], tuple[float, float] | None] | None = None,
                 own: Callable[[], float] = own_seconds) -> None:
        self.n_max = self.current = max(1, n_max)
        if sample is None:  # the CPUs we may run on: a cpuset's, not the whole host's
            cpus = usable_cpus()
            sample = lambda: busy_seconds(cpus)  # noqa: E731
            logical = logical or (len(cpus) if cpus else None)
        self.logical = logical or os.cpu_count() or n_max
        self.interval, self._clock, self._sample, self._own = interval, clock, sample, own
        # (clock, busy, total, own) when the current spell of steps began; None while idle
        self._start: tuple[float, float, float, float] | None = None
        # (wall, busy, total, own) of the window's earlier spells
        self._acc = (0.0, 0.0, 0.0, 0.0)
        self._ups = 0
        self.others = 0.0  # CPUs the other processes used in the last window
        self.changes = 0
        self.enabled = sample() is not None

    def _read(self) -> tuple[float, float, float, float] | None:
        cur = self._sample()
        return None if cur is None else (self._clock(), cur[0], cur[1], self._own())

    def idle(self) -> None:
        """The loop has nothing to compute: the spell of steps so far joins the window; the time
        until the next poll is no part of it. Cheap when already idle."""
        if self._start is None:
            return
        end = self._read()
        if end is not None:
            self._acc = tuple(a + e - s for a, e, s in zip(self._acc, end, self._start))  # type: ignore[assignment]
        self._start = None

    def poll(self) -> int | None:
        if not self.enabled:
            return None
        if self._start is None:  # a spell of steps begins
            self._start = self._read()
            return None
        if self._acc[0] + self._clock() - self._start[0] < self.interval:
            return None
        end = self._read()
        if end is None:
            return None
        _, busy, spent, own = (a + e - s for a, e, s in zip(self._acc, end, self._start))
        self._start, self._acc = end, (0.0, 0.0, 0.0, 0.0)
        if spent <= 0:  # CPU-seconds the window had: its wall time times the CPUs
            return None
        # the CPUs the others kept busy: the busy CPU-seconds less ours, over the window's wall time
        self.others = max(0.0, busy - own) * self.logical / spent
        want = threads_for(self.others, self.n_max, self.logical)
        if want < self.current:
            self._ups = 0
            return self._set(want)
        if want > self.current:
            self._ups += 1
            if self._ups >= 2:
                self._ups = 0
                return self._set(want)
            return None
        self._ups = 0
        return None

    def _set(self, n: int) -> int:
        self.current = n
        self.changes += 1
        return n


__all__ = ["ThreadGovernor", "threads_for", "busy_seconds", "usable_cpus", "own_seconds", "SLACK"]
