"""The prefix cache's host-memory tier: radix-cache spill / load / LRU across both tiers /
budget / locks / refcounts (with a consistency check of the whole tree after each step), the
engine with and without it on a tiny random model, its setting and its metrics."""

from __future__ import annotations

import random

import pytest
import torch

from localrun.config import parse_host_cache, settings
from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.kv.host import HostKVPool
from localrun.engine.kv.pool import KVPool
from localrun.engine.kv.radix import RadixCache
from localrun.engine.models.shapes import SHAPES

P = 4  # tokens per page
ModelConfig = SHAPES["smollm2-135m"].__class__


def _setup(device_pages=8, host_pages=4):
    pool = KVPool(ModelConfig(8, 2, 1, 1, 8, 10), device_pages, P, torch.float32, "cpu")
    host = HostKVPool(pool, host_pages) if host_pages else None
    return pool, host, RadixCache(pool, host)


def _fill(pool: KVPool, pages: list[int], tag: float) -> None:
    """Give each page distinct contents in every page tensor."""
    for j, t in enumerate(pool.page_tensors()):
        for p in pages:
            t[p] = tag + p / 100 + j / 10000


def _cache(cache: RadixCache, tokens: list[int], tag: float) -> list[int]:
    """What a finished sequence leaves: its pages in the tree (and no reference of its own)."""
    pool, need = cache.pool, len(tokens) // P
    if pool.num_free < need:
        cache.evict(need - pool.num_free)
    pages = pool.alloc(need)
    _fill(pool, pages, tag)
    tree_pages, _ = cache.insert(tokens, pages)
    pool.decref(pages)
    return tree_pages


def _snapshot(pool: KVPool, pages: list[int]) -> list[torch.Tensor]:
    return [t[pages].clone() for t in pool.page_tensors()]


def check(cache: RadixCache) -> None:
    """Every counter agrees with the tree; refcounts and free lists add up; tiers nest."""
    pool, host = cache.pool, cache.host
    dev = host_n = evictable = 0
    tree_pages: list[int] = []
    slots: list[int] = []
    for n in cache._nodes():
        assert n.parent is not None and n.parent.children[n.key[:P]] is n
        assert len(n.key) == n.size * P and n.size > 0
        if n.on_host:
            assert not n.pages and all(c.on_host for c in n.children.values())  # host nodes only below
            host_n += len(n.host)
            slots += n.host
        else:
            dev += len(n.pages)
            tree_pages += n.pages
            evictable += len(n.pages) if n.lock_ref == 0 else 0
        assert n.lock_ref <= n.parent.lock_ref or n.parent is cache.root  # a lock covers the path
    assert (cache.num_pages, cache.host_pages, cache.evictable_pages) == (dev, host_n, evictable)
    assert len(set(tree_pages)) == len(tree_pages) and all(pool.refcount[p] >= 1 for p in tree_pages)
    in_use = sum(c > 0 for c in pool.refcount)
    assert pool.num_free + in_use == pool.num_pages and set(pool._free).isdisjoint(tree_pages)
    if host is not None:
        assert len(set(slots)) == len(slots) and set(slots).isdisjoint(host._free)
        assert host.num_free + host_n == host.num_pages  # the budget: never more than the pool holds


def test_evict_spills_to_host_and_a_match_loads_back():
    pool, host, cache = _setup(device_pages=8, host_pages=4)
    a = list(range(12))
    pages = _cache(cache, a, 1.0)
    before = _snapshot(pool, pages)
    assert cache.evict(3) == 3 and pool.num_free == 8
    assert cache.num_pages == 0 and cache.host_pages == 3 and cache.spilled_pages == 3 and cache.evicted_pages == 0
    check(cache)
    assert cache.match_prefix(a) == ([], cache.root)  # on the host: no device pages until loaded
    assert cache.cached_pages(a + [5]) == 3
    host.flush()
    for t in pool.page_tensors():
        t.zero_()  # the device pages are reused by others
    got, node, loaded = cache.load_prefix(a[:8] + [99, 98, 97, 96])  # the match ends inside the node: split
    assert loaded == 2 and len(got) == 2 and node.pages == got and cache.loaded_pages == 2
    assert cache.host_pages == 1 and cache.num_pages == 2  # the unmatched page stays on the host
    check(cache)
    assert host.pending == 2
    host.flush()
    assert all(torch.equal(t[got], b[:2]) for t, b in zip(pool.page_tensors(), before))
    got, node, loaded = cache.load_prefix(a)  # the rest, below the now device-resident part
    assert loaded == 1 and len(got) == 3 and cache.host_pages == 0
    host.flush()
    assert all(torch.equal(t[got[2:]], b[2:]) for t, b in zip(pool.page_tensors(), before))
    check(cache)


def test_copies_are_batched_and_run_in_order():
    pool, host, cache = _setup(device_pages=2, host_pages=4)  # room for one chat on the device
    a, b = list(range(8)), list(range(100, 108))
    pa = _cache(cache, a, 1.0)
    want_a = _snapshot(pool, pa)
    assert cache.evict(2) == 2  # a -> host: a store queued, a's device pages free at once
    host.flush()  # (a step boundary: the next step's compute may now overwrite those pages)
    pb = _cache(cache, b, 2.0)
    assert set(pb) == set(pa)  # b's KV lives where a's was
    want_b = _snapshot(pool, pb)
    got, _, loaded = cache.load_prefix(a)  # a comes back into b's pages: b must reach the host first
    assert loaded == 2 and cache.host_pages == 2 and set(got) == set(pb)
    assert [(k, len(src)) for k, src, _ in host._runs] == [("store", 2), ("load", 2)]  # one run each way
    check(cache)
    host.flush()
    assert all(torch.equal(t[got], w) for t, w in zip(pool.page_tensors(), want_a))
    got, _, loaded = cache.load_prefix(b)  # and back: the store of a and the load of b in one flush
    assert loaded == 2
    host.flush()
    assert all(torch.equal(t[got], w) for t, w in zip(pool.page_tensors(), want_b))
    got, _, _ = cache.load_prefix(a)
    host.flush()
    assert all(torch.equal(t[got], w) for t, w in zip(pool.page_tensors(), want_a))
    check(cache)


def test_a_slot_written_twice_before_a_flush_starts_a_new_run():
    pool, host, cache = _setup(device_pages=4, host_pages=2)
    a, b = list(range(8)), list(range(100, 108))
    _cache(cache, a, 1.0)
    cache.evict(2)  # a -> host (both slots)
    _cache(cache, b, 2.0)
    want_b = _snapshot(pool, cache.match_prefix(b)[0])
    cache.evict(2)  # b -> host: a is dropped and its slots (still to be written by the queued store) reused
    assert cache.cached_pages(a) == 0 and cache.host_pages == 2
    assert [k for k, _, _ in host._runs] == ["store", "store"]
    host.flush()
    got, _, _ = cache.load_prefix(b)
    host.flush()
    assert all(torch.equal(t[got], w) for t, w in zip(pool.page_tensors(), want_b))
    check(cache)


def test_lru_across_tiers_and_host_budget():
    pool, host, cache = _setup(device_pages=4, host_pages=4)
    chats = [[1000 * c + i for i in range(8)] for c in range(4)]  # 2 pages each: 8 pages, 4 + 4 fit
    for c in chats:
        _cache(cache, c, float(len(c)))
        check(cache)
    # device holds the two newest, host the two oldest
    assert [cache.cached_pages(c) for c in chats] == [2, 2, 2, 2]
    assert [len(cache.match_prefix(c)[0]) for c in chats] == [0, 0, 2, 2]
    cache.cached_pages(chats[0])  # touch chat 0: chat 1 is now the least recently used
    _cache(cache, [5000 + i for i in range(8)], 9.0)  # 2 more pages: a device pair spills, host drops LRU
    check(cache)
    assert cache.cached_pages(chats[1]) == 0 and cache.cached_pages(chats[0]) == 2
    assert cache.host_pages <= host.num_pages and cache.evicted_pages == 2


def test_locked_nodes_are_never_spilled_or_dropped():
    pool, host, cache = _setup(device_pages=6, host_pages=2)
    a = list(range(12))
    _cache(cache, a, 1.0)
    _, node = cache.match_prefix(a[:8])  # a running request holds the first two pages
    cache.lock(node)
    check(cache)
    assert cache.evict(10) == 1  # only the unlocked third page goes (to the host)
    assert cache.num_pages == 2 and cache.host_pages == 1
    _cache(cache, [50 + i for i in range(16)], 2.0)  # 4 pages: all that is free
    assert cache.evict(10) == 4 and cache.num_pages == 2  # the locked path stays on the device
    assert cache.match_prefix(a[:8]) == (node.pages, node) and not node.on_host and node.lock_ref == 1
    check(cache)
    cache.unlock(node)
    cache.reset()
    assert cache.num_pages == cache.host_pages == 0 and pool.num_free == 6 and host.num_free == 2
    check(cache)


def test_host_pool_sizing_stays_within_its_budget():
    pool, _, _ = _setup()
    per_page = sum(t[0].numel() * t.element_size() for t in pool.page_tensors())
    for budget in (per_page - 1, per_page, 10 * per_page + 5, 12345):
        n = HostKVPool.pages_for_budget(pool, budget)
        assert n == budget // per_page or n == budget // per_page - 1  # 64-byte alignment of each tensor
        if n:
            host = HostKVPool(pool, n)
            assert host.nbytes <= budget and host.num_pages == n
            assert [t.shape[1:] for t in host.tensors] == [t.shape[1:] for t in pool.page_tensors()]
    assert HostKVPool.pages_for_budget(pool, 0) == 0


def test_node_larger_than_the_host_pool_is_dropped():
    pool, host, cache = _setup(device_pages=8, host_pages=2)
    _cache(cache, list(range(12)), 1.0)
    assert cache.evict(3) == 3 and cache.host_pages == 0 and cache.evicted_pages == 3
    check(cache)


def test_random_workload_keeps_the_books():
    rng = random.Random(0)
    pool, host, cache = _setup(device_pages=12, host_pages=6)
    bases = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    locked = []
    for step in range(300):
        toks = rng.choice(bases)[: rng.choice([4, 8, 12])] + [rng.randrange(50) for _ in range(rng.choice([0, 4, 8]))]
        op = rng.random()
        if op < 0.4:
            pages, node, _ = cache.load_prefix(toks)
            if node is not cache.root and rng.random() < 0.5 and len(locked) < 2:
                cache.lock(node)
                locked.append(node)
        elif op < 0.7:
            need = len(toks) // P
            if pool.num_free < need:
                cache.evict(need - pool.num_free)
            if pool.num_free >= need and need:
                pages = pool.alloc(need)
                cache.insert(toks, pages)
                pool.decref(pages)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 6))
        if rng.random() < 0.3:
            host.flush()
        check(cache)
    for n in locked:
        cache.unlock(n)
    cache.reset()
    check(cache)
    assert pool.num_free == pool.num_pages and host.num_free == host.num_pages
    assert cache.spilled_pages > 0 and cache.loaded_pages > 0 and cache.evicted_pages > 0


# -- the engine --------------------------------------------------------------------------------
TINY = ModelConfig(64, 2, 4, 2, 128, 500)


def _chats(engine_cfg: dict, turns=3, chats=5):
    """Round-robin multi-turn chats on a device pool too small for them; greedy outputs, stats and
    the tokens the model actually ran."""
    eng = LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=256, page_size=4, kv_cache_tokens=80,
                                                   max_num_seqs=4, **engine_cfg))
    ran = []
    launch = eng.runner.launch
    eng.runner.launch = lambda batch: (ran.append(batch.total_tokens), launch(batch))[1]
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, 500, (20,), generator=g).tolist() for _ in range(chats)]
    outs, cached = [], 0
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for _ in range(turns):
        for c in range(chats):
            o = eng.generate([hist[c]], params)[0]
            outs.append(o.token_ids)
            cached += o.cached_tokens
            hist[c] = hist[c] + o.token_ids + torch.randint(0, 500, (6,), generator=g).tolist()
    return outs, eng.stats(), sum(ran), cached


def test_engine_host_tier_same_outputs_fewer_prefill_tokens():
    off, s_off, ran_off, cached_off = _chats({"host_cache_bytes": 0})
    on, s_on, ran_on, cached_on = _chats({"host_cache_bytes": 1 << 20})
    lap, s_lap, _, _ = _chats({"host_cache_bytes": 1 << 20, "overlap": True})  # copies queued a step ahead
    assert on == off and lap == off
    assert s_off["host_pages_total"] == 0 and s_off["prefix_host_hit_tokens"] == 0
    assert s_on["prefix_host_hit_tokens"] > 0 and s_on["host_pages_total"] > 0 and s_on["loaded_pages"] > 0
    assert s_on["prefix_hit_tokens"] == cached_on == s_on["prefix_device_hit_tokens"] + s_on["prefix_host_hit_tokens"]
    assert cached_on > cached_off and ran_on < ran_off
    assert s_lap["prefix_host_hit_tokens"] == s_on["prefix_host_hit_tokens"]
    assert s_on["kv_pages_free"] + s_on["cached_pages"] == s_on["kv_pages_total"]


def test_engine_host_tier_moves_quantized_pages_with_their_scales():
    """int8 KV pages spill and load back with their per-token scales (KVPool.page_tensors()):
    the same greedy outputs as with the tier off, with host hits."""
    off, _, _, _ = _chats({"host_cache_bytes": 0, "kv_cache_dtype": "int8"})
    on, s_on, _, _ = _chats({"host_cache_bytes": 1 << 20, "kv_cache_dtype": "int8"})
    assert s_on["kv_dtype"] == "int8" and s_on["prefix_host_hit_tokens"] > 0
    assert on == off


def test_engine_host_cache_setting():
    with pytest.raises(ValueError, match="host_cache_bytes"):
        EngineConfig(device="cpu", host_cache_bytes=-1)
    with pytest.raises(ValueError, match="host_cache_bytes"):
        EngineConfig(device="cpu", host_cache_bytes=1.5)
    eng = LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=64, kv_cache_tokens=64))
    assert eng.host_pool is not None  # default: on, bounded by 4x the device pool
    assert eng.host_pool.nbytes <= 4 * eng.pool.nbytes
    eng = LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=64, enable_prefix_cache=False))
    assert eng.host_pool is None


def test_host_cache_env_parse():
    assert parse_host_cache(None) is None and parse_host_cache("auto") is None
    assert parse_host_cache("0") == 0 and parse_host_cache("off") == 0
    assert parse_host_cache("4GiB") == parse_host_cache("4G") == 4 << 30
    assert parse_host_cache("2GB") == 2_000_000_000 and parse_host_cache("512MiB") == 512 << 20
    assert parse_host_cache("1048576") == 1 << 20
    assert parse_host_cache("0.1") == parse_host_cache("10%") == pytest.approx(0.1)
    for bad in ("lots", "-1", "4XB", "95%", "1.5", "0%"):
        with pytest.raises(ValueError, match="LOCALRUN_HOST_CACHE"):
            parse_host_cache(bad)
    assert dict(settings({"LOCALRUN_HOST_CACHE": "10%"}).describe())["LOCALRUN_HOST_CACHE"] == "10% of available RAM"
    assert dict(settings({}).describe())["LOCALRUN_HOST_CACHE"] == "auto"
    with pytest.raises(ValueError, match="LOCALRUN_HOST_CACHE"):
        settings({"LOCALRUN_HOST_CACHE": "big"})


def test_native_backend_passes_the_setting(monkeypatch):
    from localrun.backends import native

    monkeypatch.setattr("localrun.engine.kv.host.available_ram", lambda: 1000)
    assert native._host_cache_bytes(0.5) == 500
    assert native._host_cache_bytes(4096) == 4096 and native._host_cache_bytes(None) is None


def test_metrics_split_hits_by_tier():
    pytest.importorskip("prometheus_client")
    from fakes import engine_metric_samples

    stats = {"kv_pages_total": 10, "kv_pages_free": 4, "prefix_hit_tokens": 30, "prefix_query_tokens": 60,
             "prefix_device_hit_tokens": 20, "prefix_host_hit_tokens": 10, "host_pages_total": 8, "host_pages_used": 3}
    samples = engine_metric_samples(stats)
    assert samples[("localrun_prefix_cache_hit_tokens_total", (("model", "m"), ("tier", "device")))] == 20
    assert samples[("localrun_prefix_cache_hit_tokens_total", (("model", "m"), ("tier", "host")))] == 10
    assert samples[("localrun_host_kv_pages_used", (("model", "m"),))] == 3
    assert samples[("localrun_host_kv_pages_total", (("model", "m"),))] == 8
    assert samples[("localrun_prefix_cache_hit_rate", (("model", "m"),))] == 0.5
