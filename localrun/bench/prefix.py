"""`localrun bench prefix`: prefix reuse, the engine's prefix cache on vs off, same run.

Two workloads, both of token ids (so they run on any model, random weights included):

- shared: one long shared system prompt (default 1,024 tokens) followed by many distinct
  questions (default 64 x 32 tokens): the first alone, then all the others at once;
- multi-turn: chats (default 16) of several turns (default 4); turn r of every chat is
  submitted together and its prompt is the whole history (earlier user turns and the
  model's own answers) plus a new user turn.

A third, `run_host_tier` (`localrun bench prefix --host-tier`), measures the prefix cache's
host-memory tier: many chats whose histories together are several times the device KV pool
(default 3x), visited round-robin one request at a time (chat 0 turn 1, chat 1 turn 1, ...,
chat 0 turn 2, ...), so the device pool alone has always evicted a chat's history by the
time it comes back; run with the host tier off and then on (prefix cache on in both).

For the first two, with EngineConfig.enable_prefix_cache on and then off (one engine at a time, so
an 8B model fits twice on one GPU): wall time, total tok/s, TTFT p50/p95 (first token
time - submission of the batch) and the hit rate = cached prompt tokens / prompt tokens
(from each output's cached_tokens). Outputs use ignore_eos with fixed max_tokens so both
runs do exactly the same decode work.
"""

from __future__ import annotations

import random
import time
from typing import Any

from localrun.bench.results import PeakMemory, percentile, progress_bar
from localrun.bench.throughput import BenchModelSource, engine_config, load_engine, release_memory, shutdown_engine


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 4)  # keep clear of special/control tokens at the bottom
    return [rng.randrange(lo, vocab) for _ in range(n)]


def build_shared(vocab: int, system_len: int, num_questions: int, question_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = _ids(rng, system_len, vocab)
    return [system + _ids(rng, question_len, vocab) for _ in range(num_questions)]


def _measure(engine, prompts: list[list[int]], max_tokens: int, update=None) -> tuple[list, float, float]:
    from localrun.engine import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, progress=update)
    return outs, t, time.perf_counter() - t


def _summary(outs: list, submit_times: list[float], elapsed: float) -> dict[str, Any]:
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    out_tokens = sum(o.completion_tokens for o in outs)
    ttft = [(o.first_token_time - (getattr(o, "arrival_time", None) or s)) * 1000.0
            for o, s in zip(outs, submit_times) if o.first_token_time is not None]
    return {
        "requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "output_tokens": out_tokens,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (prompt_tokens + out_tokens) / elapsed,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p95": percentile(ttft, 95),
        "ttft_ms_mean": sum(ttft) / len(ttft) if ttft else None,
    }


def warm_up(engine, vocab: int, prompts: int = 2) -> None:
    """Unrelated prompts, then the prefix cache cleared: the first steps' one-time costs (kernels,
    allocator) count in no measured run, and nothing they cached is left for it."""
    _measure(engine, [_ids(random.Random(99 + i), 64, vocab) for i in range(prompts)], 4)
    if callable(getattr(engine, "clear_prefix_cache", None)):
        engine.clear_prefix_cache()


def run_shared(engine, prompts: list[list[int]], max_tokens: int, console=None) -> dict[str, Any]:
    """Every question at once, as a load generator sends them (SGLang's bench_serving): with the
    cache on, the engine computes the system prompt once (the scheduler admits one of the
    requests that share an uncached page, the others the step after, from the cache)."""
    prog, update = progress_bar("shared prefix", len(prompts), console)
    with prog:
        outs, t, dt = _measure(engine, prompts, max_tokens, update)
    return _summary(outs, [t] * len(outs), dt)


def run_multiturn(engine, vocab: int, chats: int, turns: int, user_len: int, max_tokens: int, seed: int = 1,
                  console=None) -> dict[str, Any]:
    rng = random.Random(seed)
    history: list[list[int]] = [[] for _ in range(chats)]
    all_outs: list = []
    submits: list[float] = []
    elapsed = 0.0
    prog, update = progress_bar("multi-turn", chats * turns, console)
    with prog:
        for r in range(turns):
            prompts = [h + _ids(rng, user_len, vocab) for h in history]
            outs, t, dt = _measure(engine, prompts, max_tokens, lambda d, n, r=r: update(r * chats + d))
            elapsed += dt
            all_outs += outs
            submits += [t] * len(outs)
            history = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    res = _summary(all_outs, submits, elapsed)
    res["turns"] = turns
    res["chats"] = chats
    return res


def run_prefix(
    src: BenchModelSource,
    system_len: int = 1024,
    num_questions: int = 64,
    question_len: int = 32,
    chats: int = 16,
    turns: int = 4,
    user_len: int = 64,
    max_tokens: int = 32,
    warmup: int = 2,
    engine_args: dict[str, Any] | None = None,
    console=None,
) -> dict[str, Any]:
    """Both workloads, cache on then off; returns the result dict with speedups."""
    if min(system_len, num_questions, question_len, chats, turns, user_len, max_tokens) < 1:
        raise ValueError("prefix benchmark sizes must all be >= 1")
    runs: dict[str, Any] = {}
    for label, enabled in (("cache_on", True), ("cache_off", False)):
        config = engine_config({**(engine_args or {}), "enable_prefix_cache": enabled})
        engine = load_engine(src, config)
        try:
            vocab = engine.model_config.vocab_size
            if warmup:
                warm_up(engine, vocab, warmup)
            shared = build_shared(vocab, system_len, num_questions, question_len)
            with PeakMemory() as mem:
                runs[label] = {
                    "shared": run_shared(engine, shared, max_tokens, console),
                    "multiturn": run_multiturn(engine, vocab, chats, turns, user_len, max_tokens, console=console),
                }
            runs[label].update(mem.as_dict())
            stats = getattr(engine, "stats", None)
            if callable(stats):
                s = stats()
                runs[label]["engine_stats"] = {k: s.get(k) for k in ("prefix_hit_tokens", "prefix_query_tokens") if k in s}
        finally:
            shutdown_engine(engine)
            engine = None  # the last reference: cache-off's engine loads into the freed memory
            release_memory()
    speedup = {}
    for w in ("shared", "multiturn"):
        on, off = runs["cache_on"][w], runs["cache_off"][w]
        speedup[w] = {
            "throughput_x": on["total_tok_s"] / off["total_tok_s"],
            "ttft_p50_x": (off["ttft_ms_p50"] / on["ttft_ms_p50"]) if on["ttft_ms_p50"] else None,
        }
    return {
        "mode": "prefix",
        "model": src.name,
        "workload": {"system_len": system_len, "num_questions": num_questions, "question_len": question_len,
                     "chats": chats, "turns": turns, "user_len": user_len, "max_tokens": max_tokens,
                     "ignore_eos": True},
        **runs,
        "speedup": speedup,
    }


def run_roundrobin(engine, vocab: int, chats: int, turns: int, user_len: int, max_tokens: int, seed: int = 2,
                   console=None) -> dict[str, Any]:
    """Turn after turn, each chat's next request alone (its prompt the whole history so far)."""
    rng = random.Random(seed)
    history: list[list[int]] = [[] for _ in range(chats)]
    outs, submits, elapsed = [], [], 0.0
    prog, update = progress_bar("round-robin chats", chats * turns, console)
    with prog:
        for r in range(turns):
            for c in range(chats):
                prompt = history[c] + _ids(rng, user_len, vocab)
                (out,), t, dt = _measure(engine, [prompt], max_tokens)
                elapsed += dt
                outs.append(out)
                submits.append(t)
                history[c] = prompt + list(out.token_ids)
                update(r * chats + c + 1)
    res = _summary(outs, submits, elapsed)
    res["prefill_tokens"] = res["prompt_tokens"] - res["cached_tokens"]
    return res


def run_host_tier(
    src: BenchModelSource,
    turns: int = 4,
    user_len: int = 64,
    max_tokens: int = 32,
    working_set: float = 3.0,
    host_cache_bytes: int | None = None,
    warmup: int = 2,
    engine_args: dict[str, Any] | None = None,
    console=None,
) -> dict[str, Any]:
    """Round-robin chats whose final histories add up to `working_set` x the device KV pool, host
    tier off then on (host_cache_bytes: its budget; None: the engine's default)."""
    if min(turns, user_len, max_tokens) < 1 or working_set <= 0:
        raise ValueError("host-tier benchmark sizes must all be positive")
    runs: dict[str, Any] = {}
    chats = None
    for label, host in (("host_off", 0), ("host_on", host_cache_bytes)):
        config = engine_config({**(engine_args or {}), "enable_prefix_cache": True, "host_cache_bytes": host})
        engine = load_engine(src, config)
        try:
            vocab = engine.model_config.vocab_size
            pool_tokens = engine.pool.num_pages * engine.pool.page_size
            per_chat = turns * (user_len + max_tokens)
            if per_chat >= pool_tokens:
                raise ValueError(f"one chat ({per_chat} tokens) does not fit the device KV pool ({pool_tokens} "
                                 "tokens): lower --turns/--user-len/--max-tokens or give the pool more room")
            if chats is None:  # sized once (from the first engine's pool), the same for both runs
                chats = max(2, -(-int(working_set * pool_tokens) // per_chat))
            if warmup:
                n = min(64, pool_tokens // 2)
                _measure(engine, [_ids(random.Random(99 + i), n, vocab) for i in range(warmup)], 4)
                engine.clear_prefix_cache()
            with PeakMemory() as mem:
                runs[label] = run_roundrobin(engine, vocab, chats, turns, user_len, max_tokens, console=console)
            runs[label].update(mem.as_dict())
            s = engine.stats()
            runs[label]["engine_stats"] = {k: s.get(k) for k in (
                "kv_pages_total", "page_size", "host_pages_total", "host_bytes", "prefix_hit_tokens",
                "prefix_device_hit_tokens", "prefix_host_hit_tokens", "spilled_pages", "loaded_pages")}
            runs[label]["device_pool_tokens"] = pool_tokens
        finally:
            shutdown_engine(engine)
            engine = None
            release_memory()
    on, off = runs["host_on"], runs["host_off"]
    return {
        "mode": "prefix-host-tier",
        "model": src.name,
        "workload": {"chats": chats, "turns": turns, "user_len": user_len, "max_tokens": max_tokens,
                     "working_set_x_device_pool": working_set, "order": "round-robin, one request at a time",
                     "ignore_eos": True},
        **runs,
        "speedup": {
            "elapsed_x": off["elapsed_s"] / on["elapsed_s"],
            "ttft_p50_x": (off["ttft_ms_p50"] / on["ttft_ms_p50"]) if on["ttft_ms_p50"] else None,
            "ttft_mean_x": (off["ttft_ms_mean"] / on["ttft_ms_mean"]) if on["ttft_ms_mean"] else None,
        },
    }
