"""The KV layer's two interfaces, with their contracts: a page pool and a prefix cache.

The scheduler sees only these; kv/pool.py (KVPool) and kv/radix.py (RadixCache, with the host
tier of kv/host.py behind it) implement them, and tests/test_scheduler_seams.py drives the
scheduler over them with no model at all.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class PagePool(Protocol):
    """Fixed-size pages of KV memory with reference counts.

    Contract: `alloc(n)` returns n distinct free page ids, each with refcount 1, or raises
    kv.pool.OutOfPages when fewer than n are free (never a partial allocation); `incref` adds
    one reference to each page; `decref` drops one and a page whose count reaches 0 is free
    again (decref of a free page is a bug and raises). `num_free` is the free page count after
    every call; `num_pages` and `page_size` never change."""

    page_size: int
    num_pages: int

    @property
    def num_free(self) -> int: ...

    def alloc(self, n: int) -> list[int]: ...

    def incref(self, pages: Sequence[int]) -> None: ...

    def decref(self, pages: Sequence[int]) -> None: ...


@runtime_checkable
class PrefixCache(Protocol):
    """Page-aligned token prefixes -> the pool pages holding their KV, shared across sequences.

    Contract: the cache holds one pool reference on every device page it caches. Only whole
    pages are cached (a key is `tokens[:k * page_size]`). `insert(tokens, pages)` caches the
    full pages and returns the cache's own pages for that prefix (where it already had one the
    caller should switch to it) and a node; `lock(node)` pins the node and its ancestors (not
    evictable) until the matching `unlock(node)`. `cached_pages(tokens)` counts the pages of a
    prefix cached in any tier and moves nothing; `load_prefix(tokens)` returns (device pages,
    last node, pages brought back from a slower tier) for the longest cached prefix, the pages
    not yet referenced for the caller (incref them to keep them). `evict(n)` frees at least n
    pool pages from unlocked nodes when it can (fewer when everything left is locked) and
    returns the count; `evictable_pages` is how many it could free now; `reset()` drops every
    unlocked entry."""

    evictable_pages: int

    def cached_pages(self, tokens: Sequence[int]) -> int: ...

    def load_prefix(self, tokens: Sequence[int]) -> tuple[list[int], Any, int]: ...

    def insert(self, tokens: Sequence[int], pages: list[int]) -> tuple[list[int], Any]: ...

    def lock(self, node: Any) -> None: ...

    def unlock(self, node: Any) -> None: ...

    def evict(self, num_pages: int) -> int: ...

    def reset(self) -> None: ...
