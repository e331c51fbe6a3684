"""One preallocated paged KV pool and its page allocator (with reference counts).

Default page size 16 tokens (EngineConfig.page_size): small enough that a sequence wastes
at most 15 slots (7.5 on average) and that prefix sharing works at a fine grain (the radix
cache shares whole pages only), large enough that one page of one head (16 x head_dim
elements, 4 KiB for head_dim 128 in bf16) is a contiguous, coalesced load for the
attention kernels and the page tables stay short. vLLM's default is the same.
"""

from __future__ import annotations

import torch

from localrun.engine.config import ModelConfig


class OutOfPages(RuntimeError):
    pass


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return int(budget_bytes // (cfg.kv_bytes_per_token(dtype) * page_size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

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
