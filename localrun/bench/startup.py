"""`localrun bench startup`: cold start, from process start to the first token.

- ``--target serve`` (default): spawn ``python -m localrun serve`` on a free port, wait
  until it answers, send one streamed completion for ``--model`` and time the first
  token. Reports the time to a ready daemon and to the first token, both from spawn.
- ``--target engine``: spawn a bare Python process that imports the native engine, loads
  the model and generates one token (no daemon): the engine's own cold start.

Each is repeated ``--runs`` times (fresh processes; the OS file cache stays warm after
the first, as it does for a user who restarts). The first run starts with an empty Triton
kernel cache (a fresh TRITON_CACHE_DIR: every kernel is compiled, as on a new machine); the
later runs share that cache. Both the cold first run and the median are reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from localrun.bench.results import percentile

_ENGINE_CHILD = r"""
import sys, json, time
from localrun.bench.throughput import resolve_model, engine_config, load_engine
from localrun.engine import SamplingParams
src = resolve_model(sys.argv[1] or None, random_weights=bool(sys.argv[2]), shape=sys.argv[2] or None)
t_import = time.time()
engine = load_engine(src, engine_config(json.loads(sys.argv[3])))
t_load = time.time()
tok = getattr(engine, "tokenizer", None)
ids = tok.encode("Hello", add_special=True) if tok is not None else [1000, 1001, 1002, 1003]
out = engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
print(json.dumps({"first_token": time.time(), "import_done": t_import, "load_done": t_load,
                  "tokens": len(out[0].token_ids), "engine_timings": getattr(engine, "timings", {})}), flush=True)
"""


class StartupError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _child_env(threads: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads in the child
    env.update(extra or {})
    return env


def engine_start(model: str | None, shape: str | None, engine_args: dict[str, Any], timeout: float,
                 threads: int | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine cold start in a fresh process."""
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_CHILD, model or "", shape or "", json.dumps(engine_args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(threads, env),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise StartupError(f"the engine gave no token within {timeout:.0f} s") from None
    t_end = time.time()
    line = next((ln for ln in out.splitlines() if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        tail = (err or out).strip().splitlines()[-5:]
        raise StartupError("the engine process failed:\n" + "\n".join(tail))
    ev = json.loads(line)
    return {
        "first_token_s": ev["first_token"] - t0,
        "import_s": ev["import_done"] - t0,
        "load_s": ev["load_done"] - ev["import_done"],
        "process_exit_s": t_end - t0,
        **{f"engine_{k}": v for k, v in (ev.get("engine_timings") or {}).items()},
    }


async def _first_token(url: str, model: str, deadline: float, proc: subprocess.Popen) -> tuple[float, float]:
    """Poll until the daemon answers, then stream one request: (ready time, first token time)."""
    import httpx

    from localrun.bench.serve import RequestTrace, BenchClient

    from localrun.config import settings

    client = BenchClient(url, model, "completions", settings().api_key, 1)  # the child has our environment
    try:
        while True:
            if proc.poll() is not None:
                raise StartupError(f"the daemon exited with code {proc.returncode} before answering")
            if time.time() > deadline:
                raise StartupError("the daemon did not answer in time")
            try:
                r = await client.http.get(url + "/models", timeout=2.0)
                if r.status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
        ready = time.time()
        tr = RequestTrace(sent=0.0)
        await client.request("Hello", 1, tr)
        if tr.error:
            raise StartupError(f"the first request failed: {tr.error}")
        if not tr.chunk_times:
            raise StartupError("the first request streamed no token")
        # chunk times are perf_counter values: convert to wall clock
        first = time.time() - (time.perf_counter() - tr.chunk_times[0])
        return ready, first
    finally:
        await client.close()


def serve_start(model: str, home: Path | None, timeout: float, threads: int | None = None,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """One daemon cold start: spawn -> ready -> first streamed token."""
    port = free_port()
    # LOCALRUN_* names are settings' business: pass them through the child's environment only.
    extra = {**(env or {}), "LOCALRUN_HOST": f"127.0.0.1:{port}"}
    if home is not None:
        extra["LOCALRUN_HOME"] = str(home)
    env = _child_env(threads, extra)
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready, first = asyncio.run(_first_token(f"http://127.0.0.1:{port}/v1", model, t0 + timeout, proc))
    except StartupError as exc:
        log.seek(0)
        tail = log.read().strip().splitlines()[-8:]
        raise StartupError(f"{exc}\n" + "\n".join(tail)) from None
    finally:
        _stop(proc)
        log.close()
    return {"ready_s": ready - t0, "first_token_s": first - t0}


def run_startup(
    target: str = "serve",
    model: str | None = None,
    shape: str | None = None,
    runs: int = 3,
    home: Path | None = None,
    timeout: float = 600.0,
    engine_args: dict[str, Any] | None = None,
    threads: int | None = None,
    console=None,
) -> dict[str, Any]:
    from localrun.bench.results import progress_bar

    if runs < 1:
        raise StartupError("--runs must be >= 1")
    if target == "serve" and not model:
        raise StartupError("`bench startup --target serve` needs --model NAME (a model in the library)")
    if target == "engine" and not (model or shape):
        raise StartupError("`bench startup --target engine` needs --model PATH or --random-weights --shape NAME")
    samples = []
    prog, update = progress_bar(f"cold starts ({target})", runs, console)
    with prog, tempfile.TemporaryDirectory(prefix="localrun-triton-cache-") as cache:
        env = {"TRITON_CACHE_DIR": cache}  # empty for the first run, then shared by the rest
        for i in range(runs):
            if target == "serve":
                samples.append(serve_start(model, home, timeout, threads, env))
            else:
                samples.append(engine_start(model, shape, engine_args or {}, timeout, threads, env))
            samples[-1]["triton_cache"] = "cold" if i == 0 else "warm"
            update(i + 1)
    ft = [s["first_token_s"] for s in samples]
    return {
        "mode": "startup",
        "target": target,
        "model": model or f"random:{shape}",
        "runs": samples,
        "first_run_cold_s": ft[0],
        "first_token_s_min": min(ft),
        "first_token_s_p50": percentile(ft, 50),
        "first_token_s_max": max(ft),
        "warm_first_token_s_p50": percentile(ft[1:], 50),
    }
