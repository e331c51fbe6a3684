"""HostKVPool: the prefix cache's host-memory tier and the copies between it and the device.

As SGLang's HiCache: a bounded pool of KV pages
in host RAM (pageable; the copies stage through pinned buffers on CUDA), and the batched copies between it and the
device pool.

The radix cache decides what moves (this module only moves bytes): `store` queues a copy
of device pages into host slots (a page evicted from the device pool), `load` a copy of
host slots into freshly allocated device pages (a prefix match that reached host-resident
nodes). Copies are queued while a step is scheduled and run by `flush()` just before the
step is launched, in the order they were queued, merged into runs of the same direction:
one gather and one scatter per page tensor (`KVPool.page_tensors()`) per run, not one
copy per page. Order matters: a device page freed by a store can be handed to a load in
the same step, and a host slot freed by a load can take a store.

On CUDA a load gathers its slots into a pinned staging buffer on the host, copies it up and
scatters it into the device pool on a side stream, and the compute stream waits only on
that copy's event; a store gathers on the compute stream (so it reads the pages before any
later step writes them) and copies down into pinned staging without a host sync; the
host-side scatter of a store waits for its event at the next flush (or at once before a
load in the same flush reads host slots).
"""

from __future__ import annotations

import os

import torch

from localrun.engine.kv.pool import KVPool

AUTO_FRACTION = 0.10  # default budget: this share of the RAM available at load...
AUTO_CAP_BYTES = 16 << 30  # ...but at most this much


def available_ram() -> int:
    """Bytes of RAM available to new allocations (MemAvailable; free pages where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_host_cache_bytes() -> int:
    return int(min(AUTO_CAP_BYTES, AUTO_FRACTION * available_ram()))


def _page_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


def _buffer_bytes(tensors: list[torch.Tensor], num_pages: int) -> int:
    return sum(_aligned(num_pages * _page_bytes(t)) for t in tensors)


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the host KV pool needs at least one page")
        self.num_pages = num_pages
        dev = device_pool.page_tensors()
        self.device = dev[0].device
        self.cuda = self.device.type == "cuda"
        # one buffer, carved into a tensor per device page tensor. Pageable, not pinned: only the
        # staging buffers of the copies (below) cross the bus, and this one is read and written by
        # host copies alone. So the OS commits its pages as they are first written, and a load
        # does not wait for the whole budget to be pinned (on an H200 box with 125 GiB of RAM, a 12.5 GiB
        # tier: the load's kv_alloc_s went from 3.2-4.4 s pinned to 0.03 s)
        buf = torch.empty(_buffer_bytes(dev, num_pages), dtype=torch.uint8)
        self.tensors, offset = [], 0
        for t in dev:
            n = num_pages * _page_bytes(t)
            self.tensors.append(buf[offset:offset + n].view(t.dtype).view(num_pages, *t.shape[1:]))
            offset += _aligned(n)
        self._device_tensors = dev
        self._free = list(range(num_pages - 1, -1, -1))
        self._runs: list[tuple[str, list[int], list[int]]] = []  # ("store"|"load", sources, destinations)
        self._stores_in_flight: list[tuple[torch.cuda.Event, list[torch.Tensor], torch.Tensor]] = []
        self._loads_in_flight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # keep staging alive
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self.stored_pages = self.loaded_pages = 0  # totals copied down / up

    def rebind(self, device_pool: KVPool) -> None:
        """Copy to and from `device_pool`'s tensors from now on (the device pool was resized:
        same page shapes, new tensors)."""
        self._device_tensors = device_pool.page_tensors()

    @staticmethod
    def pages_for_budget(device_pool: KVPool, budget_bytes: int) -> int:
        """Host pages that fit in budget_bytes."""
        dev = device_pool.page_tensors()
        if budget_bytes <= 0:
            return 0
        pages = int(budget_bytes // sum(_page_bytes(t) for t in dev))
        while pages > 0 and _buffer_bytes(dev, pages) > budget_bytes:
            pages -= 1
        return pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"need {n} host KV pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    # -- queued copies -----------------------------------------------------------------------
    def _queue(self, kind: str, src: list[int], dst: list[int]) -> None:
        last = self._runs[-1] if self._runs else None
        # a destination written twice in one run would make its scatter ambiguous: start a new run
        if last is not None and last[0] == kind and not set(dst) & set(last[2]):
            last[1].extend(src)
            last[2].extend(dst)
        else:
            self._runs.append((kind, list(src), list(dst)))

    def store(self, pages: list[int], slots: list[int]) -> None:
        """Queue a copy of device pages into host slots (the pages may be freed at once: the
        copy reads them before any later step can write them)."""
        self._queue("store", pages, slots)
        self.stored_pages += len(pages)

    def load(self, slots: list[int], pages: list[int]) -> None:
        """Queue a copy of host slots into device pages (the slots may be freed at once)."""
        self._queue("load", slots, pages)
        self.loaded_pages += len(pages)

    @property
    def pending(self) -> int:
        return sum(len(src) for _, src, _ in self._runs)

    @torch.inference_mode()
    def flush(self) -> None:
        """Run the queued copies, in order; call before launching the step that may read them."""
        self._finish_stores()
        if self.cuda:
            self._loads_in_flight = [x for x in self._loads_in_flight if not x[0].query()]
        runs, self._runs = self._runs, []
        for kind, src, dst in runs:
            if kind == "store":
                self._store(src, dst)
            else:
                self._finish_stores()  # host slots must hold what earlier stores put there
                self._load(src, dst)

    def _store(self, pages: list[int], slots: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long).to(self.device, non_blocking=True)
        slot_idx = torch.tensor(slots, dtype=torch.long)
        if not self.cuda:
            for d, h in zip(self._device_tensors, self.tensors):
                h.index_copy_(0, slot_idx, d.index_select(0, idx))
            return
        staged = []
        for d in self._device_tensors:  # on the compute stream: ordered before any later write of the pages
            s = torch.empty((len(pages), *d.shape[1:]), dtype=d.dtype, pin_memory=True)
            s.copy_(d.index_select(0, idx), non_blocking=True)
            staged.append(s)
        ev = torch.cuda.Event()
        ev.record()
        self._stores_in_flight.append((ev, staged, slot_idx))

    def _finish_stores(self) -> None:
        for ev, staged, slot_idx in self._stores_in_flight:
            ev.synchronize()  # waits for the copy, queued before any step launched since
            for s, h in zip(staged, self.tensors):
                h.index_copy_(0, slot_idx, s)
        self._stores_in_flight.clear()

    def _load(self, slots: list[int], pages: list[int]) -> None:
        slot_idx = torch.tensor(slots, dtype=torch.long)
        if not self.cuda:
            idx = torch.tensor(pages, dtype=torch.long)
            for d, h in zip(self._device_tensors, self.tensors):
                d.index_copy_(0, idx, h.index_select(0, slot_idx))
            return
        staged = []
        for h in self.tensors:
            s = torch.empty((len(slots), *h.shape[1:]), dtype=h.dtype, pin_memory=True)
            torch.index_select(h, 0, slot_idx, out=s)
            staged.append(s)
        main = torch.cuda.current_stream(self.device)
        # the pages may have been freed by a sequence a running step still writes: copy after it
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            idx = torch.tensor(pages, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
            for d, s in zip(self._device_tensors, staged):
                d.index_copy_(0, idx, s.to(self.device, non_blocking=True))
            ev = torch.cuda.Event()
            ev.record(self._side)
        main.wait_event(ev)  # the step waits on the copy, the host does not
        self._loads_in_flight.append((ev, staged))
