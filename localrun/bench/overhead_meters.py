"""Where the overhead bench's time and CPU go: each side's own decode time and its CPU time per generated token.

Used by localrun/bench/overhead.py (its docstring says how the two sides are compared).
"""

from __future__ import annotations

import time


class StepClock:
    """Each side's own llama_decode time, so a pair can be compared with it taken out: a TTFT pair
    less the prefill (the steps that carry prompt tokens), a long stream's time per token less its
    decode steps. The direct side: llama-cpp-python's context's decode, timed around the call (as the
    runner's loop times its own); the daemon side: the runner's `localrun_compute_seconds_total` by
    step and `localrun_decode_tokens_total` from /metrics, read after each request. A short request's
    prefill swings by +-10 ms on a 2-vCPU VM and a process's decode steps run a few percent faster or
    slower than another's: what is left, the time around llama_decode, is each side's own path."""

    def __init__(self, llm, http, model: str) -> None:
        self.http, self.model = http, model
        self.direct_s = 0.0  # prefill seconds
        self.direct_dec = [0.0, 0]  # decode seconds, decode steps (one-token batches)
        ctx = getattr(llm, "_ctx", None)
        decode = getattr(ctx, "decode", None)
        self.ok = decode is not None
        if self.ok:
            def timed(batch):
                t0 = time.perf_counter()
                try:
                    return decode(batch)
                finally:
                    if batch.batch.n_tokens > 1:  # a prompt's step (a short request's is one)
                        self.direct_s += time.perf_counter() - t0
                    else:
                        self.direct_dec[0] += time.perf_counter() - t0
                        self.direct_dec[1] += 1
            ctx.decode = timed
        self._last = self._daemon_counters() if self.ok else None

    def _daemon_counters(self) -> tuple[float | None, float | None, float | None] | None:
        """(prefill seconds, decode seconds, decode tokens) of the runner since its load, one /metrics read."""
        got = self._samples(("localrun_compute_seconds_total", {"step": "prefill"}),
                            ("localrun_compute_seconds_total", {"step": "decode"}),
                            ("localrun_decode_tokens_total", {}))
        return None if None in got else got

    def _delta(self) -> tuple[float, float, float] | None:
        """The daemon's counters' growth since the last read (the request just run)."""
        now = self._daemon_counters()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        return now[0] - last[0], now[1] - last[1], now[2] - last[2]

    def thread_changes(self) -> float | None:
        """How often the daemon's thread governor changed llama.cpp's thread count since the load."""
        return self._samples(("localrun_compute_thread_changes_total", {}))[0]

    def _samples(self, *wanted: tuple[str, dict]) -> list[float | None]:
        from prometheus_client.parser import text_string_to_metric_families

        out: list[float | None] = [None] * len(wanted)
        wants = [(name, {"model": self.model, **labels}) for name, labels in wanted]
        try:
            for family in text_string_to_metric_families(self.http.get("/metrics").text):
                for sample in family.samples:
                    for i, (name, want) in enumerate(wants):
                        if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                            out[i] = sample.value
        except Exception:  # noqa: BLE001 - an older daemon, or none: not shown
            pass
        return out

    def direct(self, run, *args):
        """(result, prefill seconds) of `run(*args)` on the direct side."""
        before = self.direct_s
        res = run(*args)
        return res, self.direct_s - before

    def daemon(self, run, *args):
        """(result, prefill seconds) of `run(*args)` through the daemon (the counters are read after it, not
        before: nothing of the daemon's runs on the request's way in but the request itself)."""
        res = run(*args)
        d = self._delta()
        return res, None if d is None else d[0]

    def direct_steps(self, run, *args):
        """(result, mean seconds of its decode steps) of a stream `run(*args)` on the direct side."""
        s0, n0 = self.direct_dec
        res = run(*args)
        n = self.direct_dec[1] - n0
        return res, (self.direct_dec[0] - s0) / n if n else None

    def daemon_steps(self, run, *args, **kw):
        """(result, mean seconds of its decode steps) of a stream `run(*args, **kw)` through the daemon (one
        stream at a time: each decode step samples one token)."""
        res = run(*args, **kw)
        d = self._delta()
        return res, d[1] / d[2] if d is not None and d[2] else None


class CpuTally:
    """CPU time per generated token on each side, from the processes' own counters (psutil):
    the direct side is this process (llama.cpp's threads and llama-cpp-python's Python); the daemon
    side is the runner process (llama.cpp's threads and the loop's Python), the daemon process,
    and this process's thread reading the stream (the HTTP client). On a machine whose cores all
    compute for llama.cpp, every CPU-microsecond the other processes spend per token is taken from
    the step: this says where the overhead goes."""

    def __init__(self, clients: tuple[str, ...] = ("daemon",)) -> None:
        self._daemon = None  # (watch: each round's daemon)
        self.sums = {"direct": 0.0}
        self.tokens = {"direct": 0}
        for c in clients:  # the daemon side, per HTTP client
            self.sums.update({f"{c}.runner": 0.0, f"{c}.daemon": 0.0, f"{c}.client": 0.0})
            self.tokens[c] = 0

    def watch(self, daemon_pid: int) -> None:
        """The daemon whose runs are counted from now on (a round's fresh one); the sums go on."""
        import psutil

        self._daemon = psutil.Process(daemon_pid)

    @staticmethod
    def _cpu(p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001 - gone: counts nothing
            return 0.0

    def _runners(self) -> list:
        try:
            return self._daemon.children(recursive=True)
        except Exception:  # noqa: BLE001
            return []

    def direct(self, run, *args):
        """`run(*args)` (run_direct), its CPU time counted on the direct side; returns its result."""
        t0 = time.process_time()
        res = run(*args)
        self.sums["direct"] += time.process_time() - t0
        self.tokens["direct"] += res[2]
        return res

    def daemon(self, run, *args, client: str = "daemon"):
        """`run(*args)` (run_daemon or run_daemon_stdlib), the runner's, the daemon's and this thread's CPU time counted."""
        runners = self._runners()
        r0 = {p.pid: self._cpu(p) for p in runners}
        d0, c0 = self._cpu(self._daemon), time.thread_time()
        res = run(*args)
        self.sums[f"{client}.client"] += time.thread_time() - c0
        self.sums[f"{client}.daemon"] += self._cpu(self._daemon) - d0
        self.sums[f"{client}.runner"] += sum(self._cpu(p) - r0.get(p.pid, 0.0) for p in runners)
        self.tokens[client] += res[2]
        return res

    def report(self, client: str = "daemon") -> str:
        def us(key: str, side: str) -> float:
            return 1e6 * self.sums[key] / max(1, self.tokens[side])

        parts = [us(f"{client}.{k}", client) for k in ("runner", "daemon", "client")]
        direct = us("direct", "direct")
        more = 100.0 * (sum(parts) - direct) / direct if direct else 0.0
        return (f"CPU per generated token: direct {direct:.0f} us (llama.cpp's threads + "
                f"llama-cpp-python); through the daemon with {client} {sum(parts):.0f} us = runner {parts[0]:.0f} "
                f"(llama.cpp's threads + the loop) + daemon {parts[1]:.0f} + HTTP client {parts[2]:.0f} "
                f"(sums over all prompts, prefill included): {more:+.1f}%, what the daemon costs a box whose "
                f"cores all compute, steadier than its tok/s")
