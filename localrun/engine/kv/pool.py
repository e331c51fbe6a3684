"""KVPool: the preallocated paged KV memory and its page allocator; PageTable: each sequence's pages.

One preallocated paged KV pool, its page allocator (with reference counts) and the
persistent page table of the running sequences.

Default page size 16 tokens (EngineConfig.page_size): small enough that a sequence wastes
at most 15 slots (7.5 on average) and that prefix sharing works at a fine grain (the radix
cache shares whole pages only), large enough that one page of one head (16 x head_dim
elements, 4 KiB for head_dim 128 in bf16) is a contiguous, coalesced load for the
attention kernels and the page tables stay short. vLLM's default is the same.

A quantized pool (int8 or float8_e4m3fn pages, EngineConfig.kv_cache_dtype) also holds one
float32 scale per token per KV head for K and for V ([num_pages, page_size, num_kv_heads] per
layer). Per token, because a token's scale is fixed when it is written: nothing already in a
page (maybe shared by the prefix cache) is ever re-quantized, and the store needs only the
token's own vector. Per head, because heads differ in magnitude by orders. The scales cost
4 bytes per head_dim values (6% for head_dim 64, 3% for 128).
"""

from __future__ import annotations

import numpy as np
import torch

from localrun.engine.config import KV_SCALE_DTYPE, QUANTIZED_KV_DTYPES, ModelConfig


class OutOfPages(RuntimeError):
    pass


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device) -> None:
        self.cfg, self.page_size, self.dtype, self.device = cfg, page_size, dtype, device
        self.quantized = dtype in QUANTIZED_KV_DTYPES
        self._allocate(num_pages)

    def _allocate(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        cfg, page_size, dtype, device = self.cfg, self.page_size, self.dtype, self.device
        self.num_pages = num_pages
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        n = cfg.num_layers
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        scale_shape = (num_pages, page_size, cfg.num_kv_heads)
        self.k_scales: list[torch.Tensor | None] = [None] * n
        self.v_scales: list[torch.Tensor | None] = [None] * n
        if self.quantized:
            self.k_scales = [torch.ones(scale_shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(n)]
            self.v_scales = [torch.ones(scale_shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(n)]
        # what attention reads for layer i: (k_cache, v_cache, k_scale, v_scale), scales None unquantized
        self.layers = list(zip(self.k_caches, self.v_caches, self.k_scales, self.v_scales))
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    def resize(self, num_pages: int) -> None:
        """Reallocate the pool with `num_pages` pages (every page must be free: nothing refers to
        one). The old pages are dropped first, so the new ones can reuse their memory; on a
        failed allocation the pool has no pages until a resize succeeds."""
        if len(self._free) != self.num_pages:
            raise RuntimeError(f"resize of a KV pool with {self.num_pages - len(self._free)} pages in use")
        self.k_caches = self.v_caches = self.layers = []
        self.k_scales = self.v_scales = []
        self.num_pages, self.refcount, self._free = 0, [], []
        self._allocate(num_pages)

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return int(budget_bytes // (cfg.kv_bytes_per_token(dtype) * page_size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page id in dim 0: K and V caches of every layer, then their
        scales when quantized. Copying row p of each moves page p in full."""
        return [*self.k_caches, *self.v_caches, *(s for s in self.k_scales + self.v_scales if s is not None)]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages src[i] -> dst[i] in full (every layer's K and V, and their scales when
        quantized), queued on the device after the work already launched."""
        if not src:
            return
        device = self.k_caches[0].device
        s = torch.tensor(src, dtype=torch.int64)
        d = torch.tensor(dst, dtype=torch.int64)
        if device.type == "cuda":  # pinned: the copies do not wait for the device
            s, d = s.pin_memory().to(device, non_blocking=True), d.pin_memory().to(device, non_blocking=True)
        for t in self.page_tensors():
            t.index_copy_(0, d, t.index_select(0, s))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.page_tensors())

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with refcount 1."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"incref of free page {p}"
            self.refcount[p] += 1

    def decref(self, pages) -> None:
        """Drop one reference; pages reaching zero go back to the free list."""
        for p in pages:
            c = self.refcount[p] - 1
            assert c >= 0, f"decref of free page {p}"
            self.refcount[p] = c
            if c == 0:
                self._free.append(p)


TABLE_ALIGN = 16  # page-table row width multiple


def table_width(max_pages: int) -> int:
    """A page table's row width for sequences of up to max_pages pages: a multiple of TABLE_ALIGN, so a
    slice from any row stays aligned for Triton, and the row stride, an argument of the attention
    kernels, is the same kind of integer (a multiple of 16) at every context length: the kernel trials
    (engine/fallbacks.py) compile the variant the steps launch."""
    return -(-max_pages // TABLE_ALIGN) * TABLE_ALIGN


class PageTable:
    """Page ids of every running sequence, one row per sequence, kept where attention reads them.

    The host copy (numpy) is updated in place as sequences gain or swap pages, and only the
    entries written since the last step travel to the device (one small scatter per step);
    nothing is rebuilt per step. On CPU the device table is the host table itself. The
    last row (``dummy_row``) stays all zeros: padded rows of a CUDA-graph batch point at it.
    """

    def __init__(self, max_rows: int, max_pages: int, device, separate: bool | None = None) -> None:
        max_pages = table_width(max_pages)
        self.max_rows, self.max_pages = max_rows, max_pages
        self.device = torch.device(device)
        self.host = np.zeros((max_rows + 1, max_pages), dtype=np.int32)
        # separate host and device tables (CUDA; on CPU only to test that path)
        self.separate = self.device.type != "cpu" if separate is None else separate
        if self.separate:
            self.table = torch.zeros((max_rows + 1, max_pages), dtype=torch.int32, device=self.device)
        else:
            self.table = torch.from_numpy(self.host)  # shared memory: no copies at all
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._dirty: list[tuple[int, int, int]] = []  # (row, first column, end column)
        self.journal: list | None = None  # tensor parallelism, rank 0: writes to send to the other ranks

    @property
    def dummy_row(self) -> int:
        return self.max_rows

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, pages: list[int]) -> None:
        """Set columns [start, start + len(pages)) of a row."""
        if not pages:
            return
        end = start + len(pages)
        if end > self.max_pages:
            raise OutOfPages(f"a sequence needs {end} pages; the page table holds {self.max_pages} per sequence")
        self.host[row, start:end] = pages
        if self.journal is not None:
            self.journal.append((row, start, list(pages)))
        if self.separate:
            self._dirty.append((row, start, end))

    def flush(self) -> None:
        """Copy the entries written since the last flush to the device table (in stream order)."""
        if not self._dirty:
            return
        flat = np.concatenate([np.arange(r * self.max_pages + a, r * self.max_pages + b) for r, a, b in self._dirty])
        self._dirty.clear()
        values = self.host.reshape(-1)[flat]
        idx, val = torch.from_numpy(flat.astype(np.int64)), torch.from_numpy(values)
        if self.device.type == "cuda":  # pinned: the copies do not wait for the device
            idx, val = idx.pin_memory(), val.pin_memory()
        self.table.view(-1).index_copy_(0, idx.to(self.device, non_blocking=True), val.to(self.device, non_blocking=True))
