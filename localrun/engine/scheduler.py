"""Continuous batching: chunked prefill under a per-step token budget, mixed with decodes;
admission by free KV; preemption by recompute; abort frees at once.

Each step: every running sequence gets its next chunk (1 token for a decode) while the
budget lasts, oldest first; a sequence that cannot get a page preempts the newest running
ones (their KV is released, their computed prefix stays in the radix cache, and they
return to the waiting queue to be recomputed). Then waiting sequences are admitted,
ordered by longest cached prefix (FCFS tie-break; plain FCFS when the queue is long),
while KV pages, sequence slots and budget last.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from localrun.engine.config import EngineConfig
from localrun.engine.kv_pool import KVPool
from localrun.engine.radix_cache import RadixCache
from localrun.engine.sampler import SamplingParams

_arrivals = itertools.count()
LONG_QUEUE = 128  # beyond this many waiting, skip prefix matching and go FCFS


class Sequence:
    def __init__(self, seq_id: str, prompt_ids: list[int], params: SamplingParams, device="cpu") -> None:
        self.id = seq_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.arrival = next(_arrivals)
        self.pages: list[int] = []
        self.num_computed = 0  # tokens whose KV is in the pool
        self.cached_tokens = -1  # prompt tokens served by the prefix cache at first admission
        self.node = None  # radix node locked by this sequence
        self.num_tree_pages = 0  # leading pages already inserted into the radix tree
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes first, then prefill chunks
    num_tokens: list[int]
    num_decodes: int

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: KVPool, cache: RadixCache | None) -> None:
        self.cfg, self.pool, self.cache = cfg, pool, cache
        self.P = pool.page_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.num_preemptions = 0

    # -- pages -------------------------------------------------------------------------------
    def _grab(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if self.pool.num_free < n and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n) if self.pool.num_free >= n else None

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        got = self._grab(-(-num_tokens // self.P) - len(seq.pages))
        if got is None:
            return False
        seq.pages += got
        return True

    def cache_prefix(self, seq: Sequence) -> None:
        """Insert the sequence's fully computed pages into the radix tree and lock them."""
        if self.cache is None:
            return
        full = min(seq.num_computed, len(seq.token_ids)) // self.P
        if full <= seq.num_tree_pages:
            return
        tree_pages, node = self.cache.insert(seq.token_ids[: full * self.P], seq.pages[:full])
        for i, (mine, theirs) in enumerate(zip(seq.pages[:full], tree_pages)):
            if mine != theirs:  # the tree already had this run: share its page, drop ours
                self.pool.incref([theirs])
                self.pool.decref([mine])
                seq.pages[i] = theirs
        self.cache.lock(node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.node, seq.num_tree_pages = node, full

    def release(self, seq: Sequence, keep_prefix: bool = True) -> None:
        """Give back every page of the sequence (its computed prefix stays cached)."""
        if keep_prefix:
            self.cache_prefix(seq)
        if self.cache is not None and seq.node is not None:
            self.cache.unlock(seq.node)
        self.pool.decref(seq.pages)
        seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = [], None, 0, 0

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        for q in (self.running, self.waiting):
            for s in q:
                if s.id == seq_id:
                    q.remove(s)
                    self.release(s)
                    s.finish_reason = s.finish_reason or "abort"
                    return s
        return None

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _order_waiting(self) -> list[Sequence]:
        if self.cache is None or len(self.waiting) > LONG_QUEUE:
            return sorted(self.waiting, key=lambda s: s.arrival)
        hits = {s.id: len(self.cache.match_prefix(s.token_ids[: self._cacheable(s)])[0]) for s in self.waiting}
        return sorted(self.waiting, key=lambda s: (-hits[s.id], s.arrival))

    def _cacheable(self, seq: Sequence) -> int:
        return (len(seq.token_ids) - 1) // self.P * self.P  # the last token is always computed

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.cfg.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            need = len(seq.token_ids) - seq.num_computed
            n = min(need, budget)
            while not self._ensure_pages(seq, seq.num_computed + n):
                victim = max(self.running, key=lambda s: s.arrival)
                if victim is seq and len(self.running) == 1:
                    seq.finish_reason = "length"  # alone and still out of pages: the pool is too small
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running or seq.finish_reason:
                continue
            (decodes if need == 1 else prefills).append((seq, n))
            budget -= n
        if not preempted:
            budget = self._admit(budget, prefills)
        batch = decodes + prefills
        if not batch:
            return None
        return ScheduledBatch([s for s, _ in batch], [n for _, n in batch], len(decodes))

    def _admit(self, budget: int, prefills: list[tuple[Sequence, int]]) -> int:
        reserve = max(1, self.pool.num_pages // 100)
        admitted: list[Sequence] = []
        for seq in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            pages, node = [], None
            if self.cache is not None:
                pages, node = self.cache.match_prefix(seq.token_ids[: self._cacheable(seq)])
                if any(self._shares_uncached(seq, a, len(pages)) for a in admitted):
                    continue  # let the one admitted this step compute the shared pages first
            cached = len(pages) * self.P
            total_pages = -(-len(seq.token_ids) // self.P)
            if node is not None:
                self.cache.lock(node)
            evictable = self.cache.evictable_pages if self.cache is not None else 0
            if self.pool.num_free + evictable < total_pages - len(pages) + reserve:
                if node is not None:
                    self.cache.unlock(node)
                break  # FCFS: do not let later requests overtake this one
            n = min(len(seq.token_ids) - cached, budget)
            self.pool.incref(pages)
            seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = list(pages), node, len(pages), cached
            if not self._ensure_pages(seq, cached + n):
                self.release(seq, keep_prefix=False)
                break
            if seq.cached_tokens < 0:
                seq.cached_tokens = cached
                self.prefix_hit_tokens += cached
                self.prefix_query_tokens += seq.prompt_len
            self.waiting.remove(seq)
            self.running.append(seq)
            admitted.append(seq)
            prefills.append((seq, n))
            budget -= n
        return budget

    def _shares_uncached(self, seq: Sequence, other: Sequence, cached_pages: int) -> bool:
        """True when seq shares at least one more full page with `other` than the cache holds."""
        P, i = self.P, cached_pages * self.P
        j = i + P
        return j <= min(self._cacheable(seq), len(other.token_ids)) and seq.token_ids[i:j] == other.token_ids[i:j]

    def update(self, batch: ScheduledBatch) -> None:
        """Advance the computed counts after the model ran; cache prefixes of finished prefills."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            if n > 1:
                self.cache_prefix(seq)
