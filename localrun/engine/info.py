"""The engine's counters for `LLMEngine.stats()`: weights, KV pool, prefix cache and its host tier, scheduler, speculation.

Read by the native backend for /api/ps and /metrics and by the benchmarks; off the step's
path (the engine calls it on request, never per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localrun.engine.config import kv_dtype_name

if TYPE_CHECKING:
    from localrun.engine.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict:
    """The counters of `engine`, a flat dict of numbers and names."""
    s = engine.scheduler
    pool, cache, host_pool = engine.pool, engine.cache, engine.host_pool
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "tensor_parallel": engine.tp.world, "weight_bytes_per_rank": weights, "kv_bytes_per_rank": pool.nbytes,
        "kv_pages_total": pool.num_pages, "kv_pages_free": pool.num_free,
        "page_size": pool.page_size, "kv_bytes": pool.nbytes, "kv_dtype": kv_dtype_name(pool.dtype),
        "weight_dtype": engine.config.weight_dtype, "weight_bytes": engine.weight_bytes,
        "cached_pages": cache.num_pages if cache else 0,
        "evictable_pages": cache.evictable_pages if cache else 0,
        "prefill_tokens": s.prefill_tokens, "forked_seqs": s.forked_seqs,
        "prefix_hit_tokens": s.prefix_hit_tokens, "prefix_query_tokens": s.prefix_query_tokens,
        "prefix_device_hit_tokens": s.prefix_hit_tokens - s.prefix_host_hit_tokens,
        "prefix_host_hit_tokens": s.prefix_host_hit_tokens,
        "host_pages_total": host_pool.num_pages if host_pool else 0,
        "host_pages_used": cache.host_pages if cache else 0,
        "host_bytes": host_pool.nbytes if host_pool else 0,
        "spilled_pages": cache.spilled_pages if cache else 0,
        "loaded_pages": cache.loaded_pages if cache else 0,
        "running": sum(q.status == "running" for q in s.running),
        "waiting": sum(q.status == "waiting" for q in s.waiting), "preemptions": s.num_preemptions,
        **(engine.spec.stats() if engine.spec is not None else {"speculative": "off"}),
    }
