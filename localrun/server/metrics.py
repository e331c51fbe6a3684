"""Prometheus metrics (``GET /metrics``), in the spirit of vLLM's and SGLang's.

Counted as requests happen: HTTP requests by route and status (an ASGI middleware), prompt /
completion / cached tokens, finished requests by reason, time to first token and
inter-token latency histograms (as the daemon sees them, i.e. as clients do). Read at
scrape time: queue depth and running requests per model (the model manager), KV pages
used/free, the engine's prefix hit rate and its hits by tier (device KV pool / host RAM), and
the host tier's pages per model (asked of each runner, bounded).
Each app has its own registry, so several daemons in one process (tests) never mix.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATS_TIMEOUT = 1.0  # seconds a runner gets to report its KV pages at scrape time

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/responses", "/api/generate", "/api/chat", "/api/embed",
          "/api/embeddings", "/api/pull", "/api/create", "/api/tags", "/api/show", "/api/ps", "/api/copy",
          "/api/delete", "/api/version", "/completion", "/completions", "/infill", "/props", "/health", "/tokenize",
          "/detokenize", "/tokenizer_info", "/v1/rerank", "/rerank", "/v2/rerank", "/metrics", "/")


def route_label(path: str) -> str:
    """A bounded label for a path: known routes as they are, the rest by prefix."""
    if path in ROUTES:
        return path
    for prefix in ("/v1/models/", "/v1/responses/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return "other"


class Metrics:
    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("localrun_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("localrun_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.cached_tokens = Counter("localrun_cached_prompt_tokens",
                                     "Prompt tokens whose KV came from a prefix cache", ["model"], registry=r)
        self.completion_tokens = Counter("localrun_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.finished_requests = Counter("localrun_generations_finished", "Generations finished, by reason",
                                         ["model", "api", "finish_reason"], registry=r)
        self.ttft = Histogram("localrun_time_to_first_token_seconds", "Time to first token, request arrival to "
                              "the first generated token", ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("localrun_inter_token_latency_seconds", "Time between generated tokens", ["model"],
                             buckets=_ITL_BUCKETS, registry=r)
        self._itl: dict[str, Any] = {}  # model -> its inter-token histogram child
        self._runner_stats: dict[str, dict] = {}
        self.token_totals: dict[str, list[int]] = {}  # model -> [prompt tokens, cached tokens]
        r.register(_Live(self))

    # -- called by the generation service -------------------------------------------------------
    def started(self, gen: Any) -> None:
        pass

    def first_token(self, gen: Any, seconds: float) -> None:
        self.ttft.labels(gen.model).observe(seconds)

    def inter_token(self, gen: Any, seconds: float, count: int) -> None:
        h = self._itl.get(gen.model)
        if h is None:  # labels() once a model, not once a token (its lookup takes a lock)
            h = self._itl[gen.model] = self.itl.labels(gen.model)
        for _ in range(min(count, 64)):  # a coalesced chunk: its tokens share the gap
            h.observe(seconds)

    def finished(self, gen: Any, usage: Any, reason: str) -> None:
        m = gen.model
        totals = self.token_totals.setdefault(m, [0, 0])
        totals[0] += usage.prompt_tokens
        totals[1] += usage.cached_tokens
        if usage.prompt_tokens:
            self.prompt_tokens.labels(m).inc(usage.prompt_tokens)
        if usage.cached_tokens:
            self.cached_tokens.labels(m).inc(usage.cached_tokens)
        if usage.completion_tokens:
            self.completion_tokens.labels(m).inc(usage.completion_tokens)
        self.finished_requests.labels(m, gen.job.api, reason).inc()

    # -- the scrape -------------------------------------------------------------------------------
    async def render(self) -> bytes:
        """Ask each loaded model's runner for its KV stats (bounded), then format everything."""
        self._runner_stats = await runner_stats(list(self.manager.runners.values()))
        return generate_latest(self.registry)


async def runner_stats(runners: list) -> dict[str, dict]:
    """Each loaded model's backend stats (name -> dict), each runner asked at most STATS_TIMEOUT seconds."""

    async def one(r) -> tuple[str, dict]:
        stats = getattr(r.backend, "stats", None)
        if stats is None:
            return r.name, {}
        try:
            return r.name, await asyncio.wait_for(stats(), STATS_TIMEOUT) or {}
        except Exception:  # a busy or dying runner: no KV figures this time
            return r.name, {}

    return dict(await asyncio.gather(*(one(r) for r in runners)))


PROMPT_DISK_FIELDS = ("disk_hits", "disk_misses", "disk_read_bytes", "disk_written_bytes", "disk_restored_tokens",
                      "disk_saved", "disk_bad_files", "disk_entries")


def prompt_cache_ps(st: dict) -> dict | None:
    """The prompt cache on disk's figures for /api/ps (None when the model has none)."""
    if "disk_hits" not in st:
        return None
    return {k.removeprefix("disk_"): st[k] for k in PROMPT_DISK_FIELDS if k in st}


class _Live:
    """Gauges read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        runners = list(self.metrics.manager.runners.values())
        loaded = GaugeMetricFamily("localrun_models_loaded", "Models loaded (one runner process each)")
        loaded.add_metric([], len(runners))
        yield loaded
        waiting = GaugeMetricFamily("localrun_queue_depth", "Requests waiting for a slot", labels=["model"])
        running = GaugeMetricFamily("localrun_running_requests", "Requests generating", labels=["model"])
        used = GaugeMetricFamily("localrun_kv_pages_used", "KV cache pages in use", labels=["model"])
        free = GaugeMetricFamily("localrun_kv_pages_free", "KV cache pages free", labels=["model"])
        hit = GaugeMetricFamily("localrun_prefix_cache_hit_rate",
                                "Share of prompt tokens served from the prefix cache since load", labels=["model"])
        hit_tokens = CounterMetricFamily("localrun_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the native engine's prefix cache since load, by "
                                         "where their KV was: device (the KV pool) or host (loaded back from RAM)",
                                         labels=["model", "tier"])
        host_used = GaugeMetricFamily("localrun_host_kv_pages_used",
                                      "Prefix-cache KV pages held in the host-memory tier", labels=["model"])
        host_total = GaugeMetricFamily("localrun_host_kv_pages_total",
                                       "Pages the prefix cache's host-memory tier holds at most", labels=["model"])
        spec_tokens = CounterMetricFamily("localrun_spec_tokens",
                                          "Speculative decoding: tokens drafted and, of those, "
                                          "accepted by the model since load", labels=["model", "kind"])
        spec_rate = GaugeMetricFamily("localrun_spec_acceptance_rate",
                                      "Share of drafted tokens the model accepted since load", labels=["model"])
        spec_tps = GaugeMetricFamily("localrun_spec_tokens_per_step",
                                     "Tokens a sequence gains per verification step since load (1 = no gain)",
                                     labels=["model"])
        prefill = CounterMetricFamily("localrun_prefill_tokens",
                                      "Tokens the native engine computed in prefill since load (prompts, recomputes); "
                                      "a request's n choices prefill their prompt once", labels=["model"])
        forked = CounterMetricFamily("localrun_forked_sequences",
                                     "Choices (n > 1) that started from another choice's prefill instead of their own",
                                     labels=["model"])
        cells_used = GaugeMetricFamily("localrun_kv_cells_used", "llama.cpp: KV cache cells in use (running and "
                                       "cached prefixes)", labels=["model"])
        cells = GaugeMetricFamily("localrun_kv_cells_total", "llama.cpp: KV cache cells of the model's context",
                                  labels=["model"])
        seqs = GaugeMetricFamily("localrun_sequences", "llama.cpp: sequences by state (running: generating; waiting: "
                                 "not started yet; idle: holding a cached prefix)", labels=["model", "state"])
        steps = CounterMetricFamily("localrun_engine_steps", "Batched steps since load (one llama_decode each)",
                                    labels=["model"])
        decoded = CounterMetricFamily("localrun_decode_tokens", "Tokens sampled by decode steps since load "
                                      "(decode tokens / engine steps = the mean decode batch)", labels=["model"])
        threads = GaugeMetricFamily("localrun_compute_threads", "llama.cpp: the threads it computes with now "
                                    "(fewer while other programs keep the CPUs busy; not shown when a Modelfile's "
                                    "num_thread fixes them)", labels=["model"])
        thread_changes = CounterMetricFamily("localrun_compute_thread_changes",
                                             "llama.cpp: times its thread count changed since load", labels=["model"])
        compute = CounterMetricFamily("localrun_compute_seconds", "llama.cpp: seconds in llama_decode since load, "
                                      "by step (prefill: a step with prompt tokens; decode: only sampled ones)",
                                      labels=["model", "step"])
        for r in runners:
            waiting.add_metric([r.name], r.waiting)
            running.add_metric([r.name], r.active)
            st = self.metrics._runner_stats.get(r.name) or {}
            if "kv_pages_total" in st:
                used.add_metric([r.name], st["kv_pages_total"] - st["kv_pages_free"])
                free.add_metric([r.name], st["kv_pages_free"])
            if "prefix_host_hit_tokens" in st:
                hit_tokens.add_metric([r.name, "device"], st["prefix_device_hit_tokens"])
                hit_tokens.add_metric([r.name, "host"], st["prefix_host_hit_tokens"])
            if "prefill_tokens" in st:
                prefill.add_metric([r.name], st["prefill_tokens"])
            if "forked_seqs" in st:
                forked.add_metric([r.name], st["forked_seqs"])
            if "cells" in st:
                cells_used.add_metric([r.name], st["cells_used"])
                cells.add_metric([r.name], st["cells"])
                for state, key in (("running", "running"), ("waiting", "waiting"), ("idle", "idle_sequences")):
                    seqs.add_metric([r.name, state], st[key])
                steps.add_metric([r.name], st["steps"])
                for kind in ("prefill", "decode"):
                    compute.add_metric([r.name, kind], st.get(f"{kind}_seconds", 0.0))
                decoded.add_metric([r.name], st["decode_tokens"])
                if st.get("threads") is not None:  # the thread governor's (an automatic thread count)
                    threads.add_metric([r.name], st["threads"])
                    thread_changes.add_metric([r.name], st["thread_changes"])
            if "host_pages_total" in st:
                host_used.add_metric([r.name], st["host_pages_used"])
                host_total.add_metric([r.name], st["host_pages_total"])
            if "spec_draft_tokens" in st:
                spec_tokens.add_metric([r.name, "drafted"], st["spec_draft_tokens"])
                spec_tokens.add_metric([r.name, "accepted"], st["spec_accepted_tokens"])
                spec_rate.add_metric([r.name], st["spec_acceptance_rate"])
                spec_tps.add_metric([r.name], st["spec_tokens_per_row_step"])
            if st.get("prefix_query_tokens"):  # the engine's own count
                hit.add_metric([r.name], st["prefix_hit_tokens"] / st["prefix_query_tokens"])
            elif (t := self.metrics.token_totals.get(r.name)) and t[0]:  # what the backend reported per request
                hit.add_metric([r.name], t[1] / t[0])
        yield from self._prompt_disk(runners)
        yield from (waiting, running, used, free, hit, hit_tokens, host_used, host_total, prefill, forked, spec_tokens,
                    spec_rate, spec_tps, cells_used, cells, seqs, steps, decoded, threads, thread_changes, compute)


    def _prompt_disk(self, runners):
        """The prompt cache on disk (backends/prompt_disk.py), per model."""
        lookups = CounterMetricFamily("localrun_prompt_disk_lookups", "prompt cache on disk: prompts that looked "
                                      "for a saved state, by result (hit: read back instead of prefilled)",
                                      labels=["model", "result"])
        nbytes = CounterMetricFamily("localrun_prompt_disk_bytes", "prompt cache on disk: bytes read and written",
                                     labels=["model", "direction"])
        restored = CounterMetricFamily("localrun_prompt_disk_restored_tokens", "prompt cache on disk: prompt tokens "
                                       "read back instead of computed", labels=["model"])
        bad = CounterMetricFamily("localrun_prompt_disk_bad_files", "prompt cache on disk: truncated, corrupt or "
                                  "foreign files ignored and removed", labels=["model"])
        entries = GaugeMetricFamily("localrun_prompt_disk_entries", "prompt cache on disk: the model's saved prompts",
                                    labels=["model"])
        for r in runners:
            st = self.metrics._runner_stats.get(r.name) or {}
            if "disk_hits" not in st:
                continue
            lookups.add_metric([r.name, "hit"], st["disk_hits"])
            lookups.add_metric([r.name, "miss"], st["disk_misses"])
            nbytes.add_metric([r.name, "read"], st["disk_read_bytes"])
            nbytes.add_metric([r.name, "written"], st["disk_written_bytes"])
            restored.add_metric([r.name], st["disk_restored_tokens"])
            bad.add_metric([r.name], st["disk_bad_files"])
            entries.add_metric([r.name], st["disk_entries"])
        return lookups, nbytes, restored, bad, entries


class MetricsMiddleware:
    """Counts every HTTP request by route and final status (pure ASGI: streams pass untouched)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route_label(scope.get("path", "")), str(status)).inc()


__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE", "route_label"]
