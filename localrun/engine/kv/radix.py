"""RadixCache: the prefix cache over KV pages, with an optional host tier.

A radix tree as SGLang's RadixAttention, with an optional host tier
(as SGLang's HiCache).

A token-keyed radix tree whose edges hold whole pages (keys are page-aligned token runs,
children keyed by their first page of tokens). The tree holds one reference on each of
its device pages. A running request locks the node its cached prefix ends at (and so the
whole path to the root); only unlocked nodes are evicted, least recently used first, when
the pool runs short of free pages.

Each node lives in one tier: on the device (`pages`: KV pool page ids) or, with a host
tier, in host memory (`host`: HostKVPool slots, and `pages` empty). A node on the host has
only host nodes below it: eviction moves device nodes with no device child to the host
(spill), and a match that reaches host nodes loads them back, root side first. When the
host pool is full its least recently used leaves are dropped; without a host tier (or for
a node larger than the whole host pool) an evicted node is dropped at once, with whatever
host nodes hang below it. Locked nodes are never spilled or dropped.
"""

from __future__ import annotations

import heapq
import itertools

from localrun.engine.kv.host import HostKVPool
from localrun.engine.kv.pool import KVPool

_tick = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "pages", "host", "lock_ref", "last_access")

    def __init__(self, parent: "Node | None" = None, key: tuple = (), pages: list[int] | None = None,
                 host: list[int] | None = None):
        self.children: dict[tuple, Node] = {}
        self.parent = parent  # None once the node left the tree (and for the root)
        self.key = key
        self.pages = pages or []
        self.host = host  # host slots while the node's KV lives in host memory, else None
        self.lock_ref = 0
        self.last_access = next(_tick)

    @property
    def on_host(self) -> bool:
        return self.host is not None

    @property
    def size(self) -> int:
        """Pages the node holds, in whichever tier."""
        return len(self.host) if self.host is not None else len(self.pages)


class RadixCache:
    def __init__(self, pool: KVPool, host: HostKVPool | None = None) -> None:
        self.pool, self.page, self.host = pool, pool.page_size, host
        self.root = Node()
        self.root.lock_ref = 1
        self.num_pages = 0  # device pages the tree holds
        self.evictable_pages = 0  # of those, pages in unlocked nodes
        self.host_pages = 0  # host slots the tree holds
        self.evicted_pages = 0  # pages dropped from the tree (from either tier)
        self.spilled_pages = 0  # pages moved device -> host
        self.loaded_pages = 0  # pages moved host -> device by a match
        self._host_lru: list | None = None  # heap of host leaves, built when first needed in an eviction

    # -- lookup / insert ---------------------------------------------------------------------
    def _common_pages(self, key: tuple, tokens, start: int) -> int:
        P, n = self.page, 0
        while n * P < len(key) and start + (n + 1) * P <= len(tokens) \
                and key[n * P:(n + 1) * P] == tuple(tokens[start + n * P:start + (n + 1) * P]):
            n += 1
        return n

    def _split(self, child: Node, n_pages: int) -> Node:
        """Cut child's edge after n_pages: a new middle node (in the same tier) takes the first part."""
        P = self.page
        host = None if child.host is None else child.host[:n_pages]
        mid = Node(child.parent, child.key[: n_pages * P], child.pages[:n_pages], host)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[:P]] = mid
        child.key, child.pages, child.parent = child.key[n_pages * P:], child.pages[n_pages:], mid
        if child.host is not None:
            child.host = child.host[n_pages:]
        mid.children[child.key[:P]] = child
        return mid

    def _walk(self, tokens) -> tuple[list[int], Node, list[Node]]:
        """The longest cached page-aligned prefix of `tokens`: its device pages, the last device
        node, and the host nodes that continue it (splitting a node the prefix ends inside)."""
        P, node, pages, on_host, i = self.page, self.root, [], [], 0
        cur = self.root
        now = next(_tick)
        while i + P <= len(tokens):
            child = cur.children.get(tuple(tokens[i:i + P]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * P < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.on_host:
                on_host.append(child)
            else:
                pages += child.pages
                node = child
            cur, i = child, i + len(child.key)
        return pages, node, on_host

    def match_prefix(self, tokens) -> tuple[list[int], Node]:
        """Device pages of the longest cached page-aligned prefix of `tokens` that is on the
        device, and its last node (host-resident pages are not loaded: see load_prefix)."""
        pages, node, _ = self._walk(tokens)
        return pages, node

    def cached_pages(self, tokens) -> int:
        """Pages of `tokens` cached in either tier (nothing is moved)."""
        pages, _, on_host = self._walk(tokens)
        return len(pages) + sum(n.size for n in on_host)

    def load_prefix(self, tokens) -> tuple[list[int], Node, int]:
        """match_prefix, after loading the host-resident part of the match back into fresh device
        pages (as much of it as the device pool has room for, evicting other nodes). Returns the
        device pages, the last node and how many of the pages came from the host tier."""
        pages, node, on_host = self._walk(tokens)
        if not on_host:
            return pages, node, 0
        self.lock(on_host[-1])  # the match's path stays put while room is made for it
        need = sum(n.size for n in on_host)
        if self.pool.num_free < need:
            self.evict(need - self.pool.num_free)
        loaded = 0
        for n in on_host:  # root side first: a host node never has a device node below it
            if n.size > self.pool.num_free:
                break
            dev = self.pool.alloc(n.size)  # refcount 1: the tree's reference
            self.host.load(n.host, dev)
            self.host.free(n.host)
            self.host_pages -= len(dev)
            self.num_pages += len(dev)
            n.pages, n.host = dev, None
            pages, node, loaded = pages + dev, n, loaded + len(dev)
        self.loaded_pages += loaded
        self.unlock(on_host[-1])  # the loaded nodes become evictable now that they hold device pages
        return pages, node, loaded

    def insert(self, tokens, pages: list[int]) -> tuple[list[int], Node]:
        """Cache len(pages) full pages holding `tokens`. Returns the tree's pages for this prefix
        (where the tree already had a page for a run, the caller should use the tree's one) and
        the last node. Host nodes on the way take the caller's pages (their host copy is freed)."""
        P = self.page
        assert len(tokens) >= len(pages) * P
        tree_pages, node, on_host = self._walk(tokens[: len(pages) * P])
        for n in on_host:  # the caller computed these pages again: adopt them
            k = len(tree_pages)
            mine = list(pages[k:k + n.size])
            self.pool.incref(mine)
            self.host.free(n.host)
            self.host_pages -= len(mine)
            n.pages, n.host = mine, None
            self.num_pages += len(mine)
            if n.lock_ref == 0:
                self.evictable_pages += len(mine)
            tree_pages, node = tree_pages + mine, n
        k = len(tree_pages)
        if k < len(pages):
            new = Node(node, tuple(tokens[k * P: len(pages) * P]), list(pages[k:]))
            node.children[new.key[:P]] = new
            self.pool.incref(new.pages)
            self.num_pages += len(new.pages)
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
    @staticmethod
    def _device_leaf(n: Node) -> bool:
        """An unlocked device node with nothing but host nodes below it: the next to evict."""
        return (n.parent is not None and n.lock_ref == 0 and not n.on_host
                and not any(not c.on_host for c in n.children.values()))

    @staticmethod
    def _host_leaf(n: Node) -> bool:
        return n.parent is not None and n.lock_ref == 0 and n.on_host and not n.children

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_pages: int, spill: bool = True) -> int:
        """Free at least num_pages device pages from unlocked nodes, least recently used first;
        with a host tier (and spill) their KV moves to host memory instead of being dropped.
        Returns the device pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        self._host_lru = None
        freed = 0
        while freed < num_pages and heap:
            _, _, n = heapq.heappop(heap)
            if not self._device_leaf(n):
                continue
            before, parent = self.pool.num_free, n.parent
            if not (spill and self._spill(n)):
                self._drop(n)
            freed += self.pool.num_free - before
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._host_lru = None
        return freed

    def _spill(self, n: Node) -> bool:
        """Move a device node's KV into host slots (making room by dropping host LRU leaves)."""
        if self.host is None or n.size > self.host.num_pages or not self._host_room(n.size):
            return False
        slots = self.host.alloc(n.size)
        self.host.store(n.pages, slots)
        self.pool.decref(n.pages)
        k = len(n.pages)
        self.num_pages -= k
        self.evictable_pages -= k
        self.host_pages += k
        self.spilled_pages += k
        n.pages, n.host = [], slots
        if not n.children:
            self._push_host_leaf(n)
        return True

    def _push_host_leaf(self, n: Node) -> None:
        if self._host_lru is not None:
            heapq.heappush(self._host_lru, (n.last_access, id(n), n))

    def _host_room(self, k: int) -> bool:
        """Free host slots until k are free, dropping unlocked host leaves LRU first."""
        if self.host.num_free >= k:
            return True
        if self._host_lru is None:
            self._host_lru = [(n.last_access, id(n), n) for n in self._nodes() if self._host_leaf(n)]
            heapq.heapify(self._host_lru)
        while self.host.num_free < k and self._host_lru:
            n = heapq.heappop(self._host_lru)[2]
            if not self._host_leaf(n):
                continue
            parent = n.parent
            self._drop(n)
            if self._host_leaf(parent):
                self._push_host_leaf(parent)
        return self.host.num_free >= k

    def _drop(self, n: Node) -> None:
        """Take an unlocked node and everything below it (host nodes only) out of the tree."""
        del n.parent.children[n.key[: self.page]]
        stack = [n]
        while stack:
            m = stack.pop()
            stack.extend(m.children.values())
            if m.on_host:
                self.host.free(m.host)
                self.host_pages -= len(m.host)
            else:
                self.pool.decref(m.pages)
                self.num_pages -= len(m.pages)
                self.evictable_pages -= len(m.pages)
            self.evicted_pages += m.size
            m.parent = None

    def reset(self) -> None:
        """Drop every unlocked page of both tiers (e.g. on shutdown)."""
        self.evict(self.num_pages, spill=False)
        for n in [n for n in self._nodes() if n.on_host and not n.parent.on_host]:
            if n.lock_ref == 0:
                self._drop(n)

    def stats(self) -> dict:
        return {"cached_pages": self.num_pages, "evictable_pages": self.evictable_pages,
                "evicted_pages": self.evicted_pages, "host_pages": self.host_pages,
                "host_pages_total": self.host.num_pages if self.host is not None else 0,
                "spilled_pages": self.spilled_pages, "loaded_pages": self.loaded_pages}
