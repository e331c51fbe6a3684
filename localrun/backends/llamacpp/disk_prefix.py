"""The batched loop's prompt cache on disk (``localrun.backends.prompt_disk``): long prompts' sequence states
written out, and read back into a slot when a later prompt starts with one of them and the KV cache in memory
holds less of it (after a daemon restart, an unload, or the slot's eviction).

- Saving: once a prompt of at least ``min_tokens`` tokens is prefilled and the disk holds no entry that shares
  all but ``min_tokens`` of it, its sequence's state (llama.cpp's ``llama_state_seq_get_data``: the cells in
  use, not the whole stream) is copied out on the loop's thread after the step's first tokens went out, and
  written by the store's own thread.
- Restoring: a waiting request whose prompt shares at least ``RESTORE_MIN_TOKENS`` more tokens with a saved
  entry than with any slot waits while a thread reads and checks the file (the loop goes on with the others);
  then the state is loaded into a free slot (``llama_state_seq_set_data``), cut back to the shared tokens'
  last whole prefill chunk (the rest is computed as a cold prefill computes it: the same greedy answer, given
  the same thread count), and admission finds it as the longest cached prefix. A file that fails its checks, or a state llama.cpp
  refuses, is a miss: the prompt is prefilled as it would be without the cache.

Everything but the file reads and writes runs on the loop's thread.
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from localrun.backends.llamacpp.slots import Request, Slot
from localrun.backends.prompt_disk import Entry, PromptDisk

log = logging.getLogger("localrun.llamacpp")

RESTORE_MIN_TOKENS = 256  # a saved state is read back when it spares at least this many prompt tokens


class DiskRead:
    """A request's pending or finished read of a saved state."""

    def __init__(self, entry: Entry, shared: int, future: Future) -> None:
        self.entry, self.shared, self.future = entry, shared, future
        self.t0 = time.perf_counter()


class DiskPrefixes:
    def __init__(self, lib, ctx, mem, disk: PromptDisk, slots: list[Slot], *, n_cells: int, step: int,
                 name: str) -> None:
        self.lib, self.ctx, self.mem, self.disk, self.slots = lib, ctx, mem, disk, slots
        self.step = step  # a prefill's chunk: a restored prefix ends on a multiple of it (see wait)
        self.n_cells, self.name = n_cells, name  # cells of one slot's stream
        self.counters = disk.counters
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prompt-disk-read-{name}")

    def _eligible(self, r: Request) -> bool:
        return not r.images and r.prompt_lps is None and len(r.prompt) > RESTORE_MIN_TOKENS

    # -- restoring --------------------------------------------------------------------------------------
    def wait(self, r: Request, usable: list[int], in_memory: int) -> bool:
        """True while r waits for a read of a saved state (started here when one spares enough tokens)."""
        d = r.disk
        if d is None:
            r.disk = False  # looked: nothing to read unless found below
            if not self._eligible(r) or len(usable) - in_memory < RESTORE_MIN_TOKENS:
                return False
            entry, k = self.disk.best(usable, len(usable), max_len=self.n_cells - 1)
            # cut back to a whole number of prefill chunks: the tokens computed after it are then the batch a cold
            # prefill computed last (llama.cpp's CPU kernels differ by batch size: a 2-token tail after a restore
            # answered otherwise than the cold prefill's last chunk of 64 on SmolLM2), so greedy answers stay the same
            k = k // self.step * self.step
            if entry is None or k - in_memory < RESTORE_MIN_TOKENS:
                self.counters["disk_misses"] += 1
                return False
            r.disk = d = DiskRead(entry, k, self._reader.submit(self.disk.read, entry))
        return isinstance(d, DiskRead) and not d.future.done()

    def restore(self, r: Request, usable_in_memory: int, owned: set[int]) -> None:
        """Load r's finished read into a free slot when it holds more of r's prompt than memory does (`usable_in_memory`
        tokens); the slot then looks like an idle cached prefix of exactly the shared tokens."""
        d, r.disk = r.disk, False
        if not isinstance(d, DiskRead):
            return
        payload = d.future.result() if d.future.exception() is None else None
        if payload is None or d.shared - usable_in_memory < RESTORE_MIN_TOKENS:
            self.counters["disk_misses"] += 1
            return
        free = [sl for sl in self.slots if sl.request is None]
        if not free:
            return
        dst = min(free, key=lambda sl: (sl.id in owned, bool(sl.tokens), sl.last_used))
        lib = self.lib
        lib.llama_memory_seq_rm(self.mem, dst.id, 0, -1)
        dst.tokens, dst.lps = [], []
        buf = np.frombuffer(payload, dtype=np.uint8)
        t0 = time.perf_counter()
        got = lib.llama_state_seq_set_data_ext(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                               len(buf), dst.id, 0)
        if not got:
            lib.llama_memory_seq_rm(self.mem, dst.id, 0, -1)
            log.warning("%s: llama.cpp refused the saved state %s; the prompt is computed", self.name,
                        d.entry.path.name)
            self.counters["disk_misses"] += 1
            return
        # an idle cached prefix of exactly the shared tokens (whole prefill chunks: see wait), which admission takes over
        lib.llama_memory_seq_rm(self.mem, dst.id, d.shared, -1)
        dst.tokens = [int(t) for t in d.entry.tokens[:d.shared]]
        dst.prompt_len, dst.last_used = d.shared, time.monotonic()
        self.counters["disk_hits"] += 1
        self.counters["disk_restored_tokens"] += d.shared
        log.info("%s: restored %d of %d prompt tokens from the prompt cache on disk (%s: read and checked in %.0f ms, "
                 "loaded in %.0f ms)", self.name, d.shared, len(r.prompt), d.entry.path.name, 1000 * (t0 - d.t0),
                 1000 * (time.perf_counter() - t0))

    # -- saving -----------------------------------------------------------------------------------------
    def prefilled(self, r: Request) -> None:
        """r's prompt is in its slot's cells: save its state when the disk holds too little of it."""
        if not self._eligible(r) or len(r.prompt) < self.disk.min_tokens or self.disk.limit <= 0:
            return
        slot = self.slots[r.sid]
        if slot.tokens[:len(r.prompt)] != r.prompt:
            return
        _, k = self.disk.best(r.prompt, len(r.prompt))
        if len(r.prompt) - k < self.disk.min_tokens:
            return
        lib = self.lib
        size = lib.llama_state_seq_get_size_ext(self.ctx, slot.id, 0)
        buf = np.empty(max(size, 1), dtype=np.uint8)
        written = lib.llama_state_seq_get_data_ext(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                   size, slot.id, 0)
        if written and len(slot.tokens) == len(r.prompt):
            self.disk.save(list(r.prompt), buf[:written])

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.disk.close()
