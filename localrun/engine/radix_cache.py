"""Radix prefix cache over KV pages, as SGLang's RadixAttention.

A token-keyed radix tree whose edges hold whole pages (keys are page-aligned token runs,
children keyed by their first page of tokens). The tree holds one reference on each of
its pages. A running request locks the node its cached prefix ends at (and so the whole
path to the root); only unlocked leaves are evicted, least recently used first, when
the pool runs short of free pages.
"""

from __future__ import annotations

import heapq
import itertools

from localrun.engine.kv_pool import KVPool

_tick = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: "Node | None" = None, key: tuple = (), pages: list[int] | None = None):
        self.children: dict[tuple, Node] = {}
        self.parent = parent
        self.key = key
        self.pages = pages or []
        self.lock_ref = 0
        self.last_access = next(_tick)


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool, self.page = pool, pool.page_size
        self.root = Node()
        self.root.lock_ref = 1
        self.num_pages = 0  # pages the tree holds
        self.evictable_pages = 0  # of those, pages in unlocked nodes
        self.evicted_pages = 0

    # -- lookup / insert ---------------------------------------------------------------------
    def _common_pages(self, key: tuple, tokens, start: int) -> int:
        P, n = self.page, 0
        while n * P < len(key) and start + (n + 1) * P <= len(tokens) \
                and key[n * P:(n + 1) * P] == tuple(tokens[start + n * P:start + (n + 1) * P]):
            n += 1
        return n

    def _split(self, child: Node, n_pages: int) -> Node:
        """Cut child's edge after n_pages: a new middle node takes the first part."""
        P = self.page
        mid = Node(child.parent, child.key[: n_pages * P], child.pages[:n_pages])
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[:P]] = mid
        child.key, child.pages, child.parent = child.key[n_pages * P:], child.pages[n_pages:], mid
        mid.children[child.key[:P]] = child
        return mid

    def match_prefix(self, tokens) -> tuple[list[int], Node]:
        """Pages of the longest cached page-aligned prefix of `tokens`, and its last node."""
        P, node, pages, i = self.page, self.root, [], 0
        now = next(_tick)
        while i + P <= len(tokens):
            child = node.children.get(tuple(tokens[i:i + P]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * P < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages += child.pages
            node, i = child, i + len(child.key)
        return pages, node

    def insert(self, tokens, pages: list[int]) -> tuple[list[int], Node]:
        """Cache len(pages) full pages holding `tokens`. Returns the tree's pages for this prefix
        (where the tree already had a page for a run, the caller should use the tree's one) and
        the last node."""
        P = self.page
        assert len(tokens) >= len(pages) * P
        tree_pages, node = self.match_prefix(tokens[: len(pages) * P])
        k = len(tree_pages)
        if k < len(pages):
            new = Node(node, tuple(tokens[k * P: len(pages) * P]), list(pages[k:]))
            node.children[new.key[:P]] = new
            self.pool.incref(new.pages)
            self.num_pages += len(new.pages)
            if new.lock_ref == 0:
                self.evictable_pages += len(new.pages)
            tree_pages, node = tree_pages + new.pages, new
        return tree_pages, node

    # -- locking -----------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------
    def _leaves(self):
        stack, out = [self.root], []
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages from unlocked leaves, LRU first. Returns pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, n = heapq.heappop(heap)
            before = self.pool.num_free
            self.pool.decref(n.pages)
            freed += self.pool.num_free - before
            self.num_pages -= len(n.pages)
            self.evictable_pages -= len(n.pages)
            self.evicted_pages += len(n.pages)
            parent = n.parent
            del parent.children[n.key[: self.page]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked page (e.g. on shutdown)."""
        self.evict(self.num_pages)

    def stats(self) -> dict:
        return {"cached_pages": self.num_pages, "evictable_pages": self.evictable_pages,
                "evicted_pages": self.evicted_pages}
