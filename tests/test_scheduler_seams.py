"""The scheduler and the prefix cache at their seams, in milliseconds, with no model.

`MemoryRunner` honours the runner's interface (`launch(batch)` -> a `StepHandle` whose
`result()` gives the sampled tokens) over an in-memory KV: a step writes each computed token
id into the slot its page table names, and a sampling sequence reads its whole context back
through its page table; its next token is a hash of what it read. So any scheduling mistake
that would corrupt attention (a wrong page, a page shared that should not be, a prefix reused
with the wrong contents, a preempted sequence resumed wrong) shows up as an output that
differs from the reference: the same hash over the sequence's true tokens. The real pool
(`KVPool`), radix cache (`RadixCache`) and page table run underneath; the real runner and
engine keep their own tests (test_engine_hotpath.py, test_engine_tiny.py).
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.kv.base import PagePool, PrefixCache
from localrun.engine.kv.pool import KVPool, PageTable
from localrun.engine.kv.radix import RadixCache
from localrun.engine.runner import StepHandle
from localrun.engine.sampler import SamplingParams
from localrun.engine.scheduler import PENDING, ScheduledBatch, Scheduler, Sequence

TINY = ModelConfig(16, 1, 1, 1, 32, 1000, rope_theta=10000.0)  # hidden 16, 1 layer, 1 head: a few KiB of pages
VOCAB = 1000


def next_token(context: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(bytes(str(context), "ascii"), digest_size=4).digest(), "little") % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class _HostTokens:
    """A launched step's tokens, as `SampleOutput.to_host` hands them over (no logprobs)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def to_host(self, sampling) -> tuple[list[int], list]:
        return list(self.tokens), [None] * len(self.tokens)


class MemoryRunner:
    """The runner interface over a dict of KV slots (slot -> the token id whose KV it holds)."""

    def __init__(self, pool: KVPool, table: PageTable) -> None:
        self.pool, self.table, self.P = pool, table, pool.page_size
        self.kv: dict[int, int] = {}
        self.reads = 0  # context tokens read back through page tables

    def _slot(self, seq: Sequence, pos: int) -> int:
        return int(self.table.host[seq.row, pos // self.P]) * self.P + pos % self.P

    def launch(self, batch: ScheduledBatch) -> StepHandle:
        sampling = []
        for seq, n in zip(batch.seqs, batch.num_tokens):  # before scheduler.update: num_computed is the start
            for pos in range(seq.num_computed, seq.num_computed + n):
                assert seq.token_ids[pos] != PENDING
                self.kv[self._slot(seq, pos)] = seq.token_ids[pos]
            if seq.num_computed + n == len(seq.token_ids):
                sampling.append(seq)
        for src, dst in batch.copies:  # a group follower's own copy of the prompt's partial last page
            for o in range(self.P):
                if src * self.P + o in self.kv:
                    self.kv[dst * self.P + o] = self.kv[src * self.P + o]
        rows = list(sampling)
        for leader, follower in batch.forks:  # a follower samples from its leader's context
            rows.append(follower)
        tokens = []
        for seq in rows:
            context = [self.kv.get(self._slot(seq, p), -1) for p in range(len(seq.token_ids))]
            self.reads += len(context)
            tokens.append(next_token(context))
        return StepHandle(rows, _HostTokens(tokens), None)


class Loop:
    """What the engine does around a step, serially: schedule, launch, update, hand tokens back."""

    def __init__(self, num_pages: int = 64, page_size: int = 4, budget: int = 32, max_seqs: int = 8,
                 cache: bool = True, max_model_len: int = 256) -> None:
        self.cfg = EngineConfig(device="cpu", max_model_len=max_model_len, page_size=page_size,
                                max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        self.pool = KVPool(TINY, num_pages, page_size, torch.float32, "cpu")
        self.cache = RadixCache(self.pool) if cache else None
        self.table = PageTable(max_seqs, -(-max_model_len // page_size), "cpu")
        self.sched = Scheduler(self.cfg, self.pool, self.cache, self.table)
        self.runner = MemoryRunner(self.pool, self.table)
        self.batches: list[ScheduledBatch] = []

    def step(self) -> None:
        batch = self.sched.schedule()
        for seq in self.sched.take_finished():
            assert seq.finish_reason
        if batch is None:
            return
        self.batches.append(batch)
        handle = self.runner.launch(batch)
        self.sched.update(batch)
        positions = [seq.add_pending(row) for row, seq in enumerate(handle.seqs)]
        tokens, _ = handle.result()
        for seq, pos, tok in zip(handle.seqs, positions, tokens):
            seq.resolve(pos, tok)
            if seq.num_output >= seq.params.max_tokens and not seq.finish_reason:
                seq.finish_reason = "length"
                self.sched.finish(seq)

    def run(self, seqs: list[Sequence], max_steps: int = 10_000) -> None:
        for s in seqs:
            self.sched.add(s)
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the scheduler did not finish its work")

    def all_pages_back(self) -> bool:
        if self.cache is not None:
            self.cache.reset()
        return self.pool.num_free == self.pool.num_pages


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_real_pool_and_cache_honour_their_interfaces():
    pool = KVPool(TINY, 8, 4, torch.float32, "cpu")
    assert isinstance(pool, PagePool) and isinstance(RadixCache(pool), PrefixCache)
    assert not isinstance(object(), PagePool) and not isinstance(pool, PrefixCache)


def test_outputs_match_the_reference_through_chunking_sharing_and_preemption():
    """Shared system prompts, long and short prompts, a pool too small for all at once: every
    sequence reads back exactly its own tokens, prefixes are reused, and sequences are preempted."""
    rng = random.Random(0)
    systems = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    seqs = []
    for i in range(24):
        prompt = systems[i % 3] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        seqs.append(Sequence(f"r{i}", prompt, _params(rng.randrange(1, 30))))
    loop = Loop(num_pages=40, page_size=4, budget=32, max_seqs=6)
    loop.run(seqs)
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, s.params.max_tokens), s.id
    assert all(b.total_tokens <= 32 for b in loop.batches)  # the step budget holds
    assert loop.sched.prefix_hit_tokens > 0  # the system prompts came from the prefix cache
    assert loop.sched.num_preemptions > 0  # 40 pages could not hold every running sequence
    assert loop.all_pages_back()


def test_without_a_prefix_cache_outputs_are_the_same():
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 50))] for _ in range(12)]
    seqs = [Sequence(f"r{i}", p, _params(12)) for i, p in enumerate(prompts)]
    loop = Loop(num_pages=30, cache=False)
    loop.run(seqs)
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 12)
    assert loop.sched.prefix_hit_tokens == 0 and loop.all_pages_back()


def test_a_group_prefills_once_and_its_followers_fork():
    prompt = list(range(10, 31))  # 21 tokens: 5 full pages and a partial one
    leader, *followers = [Sequence(f"g{i}", prompt, _params(6)) for i in range(4)]
    loop = Loop(num_pages=64, budget=64)
    loop.sched.add_group(leader, followers)
    loop.run([])
    want = reference(prompt, 6)
    for s in [leader, *followers]:
        assert s.output_ids == want
    assert loop.sched.forked_seqs == 3
    assert loop.sched.prefill_tokens == len(prompt)  # one prefill for the four
    assert loop.all_pages_back()


def test_an_abort_frees_its_pages_at_once():
    loop = Loop(num_pages=32)
    a = Sequence("a", list(range(1, 30)), _params(50))
    b = Sequence("b", list(range(40, 50)), _params(5))
    for s in (a, b):
        loop.sched.add(s)
    loop.step()
    loop.step()
    used = loop.pool.num_pages - loop.pool.num_free
    assert loop.sched.abort("a") is a and a.finish_reason == "abort"
    assert loop.pool.num_pages - loop.pool.num_free < used
    loop.run([])
    assert b.output_ids == reference(b.prompt_ids, 5)
    assert loop.all_pages_back()


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_a_prompt_longer_than_the_budget_is_chunked(budget):
    s = Sequence("long", list(range(100, 150)), _params(4))
    loop = Loop(budget=budget)
    loop.run([s])
    assert s.output_ids == reference(s.prompt_ids, 4)
    assert [b.total_tokens for b in loop.batches[:50 // budget]] == [budget] * (50 // budget)


def test_the_prefix_cache_contract():
    """insert / load_prefix / lock / evict / reset as kv.base.PrefixCache states them."""
    P = 4
    pool = KVPool(TINY, 16, P, torch.float32, "cpu")
    cache = RadixCache(pool)
    toks = list(range(12))
    pages = pool.alloc(3)
    tree_pages, node = cache.insert(toks, pages)
    assert tree_pages == pages and cache.cached_pages(toks) == 3 and cache.cached_pages(toks[:8] + [99] * 4) == 2
    again, _ = cache.insert(toks, pool.alloc(3))  # the same prefix again: the cache keeps its own pages
    assert again == pages
    pool.decref(pages)  # the first caller is done with them: the cache's reference remains
    found, node, loaded = cache.load_prefix(toks + [5])
    assert found == pages and loaded == 0
    cache.lock(node)
    assert cache.evictable_pages == 0 and cache.evict(3) == 0  # locked: nothing can go
    cache.unlock(node)
    assert cache.evictable_pages == 3
    free = pool.num_free
    assert cache.evict(1) >= 1 and pool.num_free > free  # least recently used leaf first
    cache.reset()
    assert cache.cached_pages(toks) == 0
