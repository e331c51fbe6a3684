"""`localrun bench agents`: coding agents finishing small real tasks on a local model.

    localrun bench agents [--model 0.5b,1.5b | --gguf FILE] [--cli codex,claude] [--profile lean,full]
                          [--tasks read,no-tool] [--timeout 600] [--llama-server [PATH]] [--result FILE]

Each task (agents_tasks.py) runs in a fresh throw-away git repository through the real CLI (Codex
``exec``, Claude Code ``-p``) started by ``localrun launch <cli> [--lean]`` against a daemon this
command starts (its own LOCALRUN_HOME, one slot); the task's check scores the answer or the
repository. A run is bounded (``--timeout``; a timeout is a fail). Per task: pass, wall time, the
daemon's requests, prompt tokens and how many of them came from its prefix cache (its /metrics,
before and after). ``--llama-server`` runs the same suite with both CLIs pointed at llama.cpp's own
llama-server on the same GGUF (same context, same output limit, the same agent settings that
``launch`` gives: agents/command.py and agents/profiles.py); its /metrics counts prompt tokens it
evaluated (cache hits are not counted there) and its log the requests (the slot's "processing task" lines).

The agents run with a throw-away HOME (nothing of the user's configuration is read or written) and
their own documented permission settings for unattended runs: Codex with its sandbox bypassed
(the repository is throw-away), Claude Code with ``--allowedTools`` for its edit and shell tools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from localrun.agents import command as agent_command
from localrun.agents import profiles
from localrun.bench.agents_tasks import Task, make_repo, score

MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
MODEL_DIR = Path(os.environ.get("LOCALRUN_REAL_MODELS") or Path.home() / ".cache" / "localrun-test-models")
BENCH_MODEL = "bench"
AGENT_MODEL = "bench:latest-agent"
CLAUDE_TOOLS = "Bash,Read,Edit,Write,Grep,Glob"


@dataclass
class SuiteConfig:
    models: list[tuple[str, Path]]
    clis: list[str]
    profiles_: list[str]
    tasks: list[Task]
    timeout: float = 600.0
    llama_server: Path | None = None
    localrun: bool = True
    threads: int = 2
    max_ctx: int = 32768
    env: dict[str, str] = field(default_factory=dict)  # extra LOCALRUN_* settings for the daemon (the levers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_models(names: str | None, ggufs: list[Path] | None) -> list[tuple[str, Path]]:
    out = [(p.stem, p) for p in ggufs or []]
    for n in (names.split(",") if names else ([] if out else ["0.5b"])):
        n = n.strip()
        if n not in MODELS:
            raise ValueError(f"unknown model {n!r}: one of {', '.join(MODELS)} (or --gguf FILE)")
        out.append((f"qwen2.5-coder-{n}", MODEL_DIR / MODELS[n]))
    for label, p in out:
        if not p.is_file():
            raise ValueError(f"{p} does not exist (tests/real_models.py assembles the Qwen2.5-Coder files)")
    return out


# -- the servers -------------------------------------------------------------------------------------
class Served:
    """One server the agents talk to: localrun's daemon or llama-server, its own process group."""

    def __init__(self, kind: str, argv: list[str], env: dict, port: int, home: Path):
        self.kind, self.port, self.home = kind, port, home
        self.url = f"http://127.0.0.1:{port}"
        self.log = home / f"{kind}.log"
        home.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(argv, env=env, cwd=home, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        path = "/health" if self.kind == "llama-server" else "/api/version"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited: {self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.kind} not ready in {timeout:.0f}s: {self.tail()}")

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def counters(self) -> dict[str, float]:
        """requests, prompt tokens and cached prompt tokens so far (None where the server counts none)."""
        text = httpx.get(self.url + "/metrics", timeout=60).text
        def total(name: str) -> float:
            pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$"
            return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
        if self.kind == "localrun":
            return {"requests": total("localrun_generations_finished_total"),
                    "prompt_tokens": total("localrun_prompt_tokens_total"),
                    "cached_tokens": total("localrun_cached_prompt_tokens_total")}
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        return {"requests": float(len(re.findall(r"launch_slot_: .*processing task", log))),
                "prompt_tokens": total("llamacpp:prompt_tokens_total"), "cached_tokens": None}


def start_localrun(gguf: Path, home: Path, cfg: SuiteConfig, say: Callable[[str], None]) -> tuple[Served, int]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(LOCALRUN_HOME=str(home / "localrun-home"), LOCALRUN_HOST=f"127.0.0.1:{port}", LOCALRUN_NUM_PARALLEL="1",
               LOCALRUN_KEEP_ALIVE="-1", HF_HUB_OFFLINE="1", **cfg.env)
    s = Served("localrun", [sys.executable, "-m", "localrun.server"], env, port, home)
    s.wait_ready()
    with httpx.Client(base_url=s.url, timeout=1800) as h:
        r = h.post("/api/create", json={"model": BENCH_MODEL, "modelfile": f"FROM {gguf}\n", "stream": False})
        if r.status_code != 200:
            raise RuntimeError(f"create failed: {r.text[:300]}")
        info = h.post("/api/show", json={"model": BENCH_MODEL, "fit_context": True}).json()
        fit = info.get("fit_context") if isinstance(info.get("fit_context"), dict) else {}
        ctx = min(fit.get("num_ctx") or agent_command.trained_context(info) or 8192, cfg.max_ctx)
        # the agent model as `launch` makes it (same Modelfile, same digest), loaded before the clock starts
        modelfile = profiles.agent_modelfile(BENCH_MODEL, ctx, info)
        r = h.post("/api/create", json={"model": AGENT_MODEL, "modelfile": modelfile, "stream": False})
        if r.status_code != 200:
            raise RuntimeError(f"create failed: {r.text[:300]}")
        t0 = time.monotonic()
        h.post("/api/generate", json={"model": AGENT_MODEL, "prompt": "", "keep_alive": -1})
        say(f"localrun: {AGENT_MODEL} loaded (context {ctx}) in {time.monotonic() - t0:.0f}s")
    return s, ctx


def start_llama_server(binary: Path, gguf: Path, ctx: int, info_limit: int, home: Path, cfg: SuiteConfig) -> Served:
    port = _free_port()
    argv = [str(binary), "-m", str(gguf), "-c", str(ctx), "-np", "1", "-n", str(info_limit), "--jinja", "--metrics",
            "-t", str(cfg.threads), "-tb", str(cfg.threads), "--host", "127.0.0.1", "--port", str(port)]
    s = Served("llama-server", argv, dict(os.environ), port, home)
    s.wait_ready()
    return s


# -- one task ----------------------------------------------------------------------------------------
def agent_args(cli: str, prompt: str, timeout: float) -> list[str]:
    if cli == "codex":
        return ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "-c", "model_providers.localrun.request_max_retries=0",
                "-c", "model_providers.localrun.stream_max_retries=0",
                "-c", f"model_providers.localrun.stream_idle_timeout_ms={int(timeout * 1000)}", prompt]
    return ["-p", prompt, "--allowedTools", CLAUDE_TOOLS]


def _agent_env(home: Path, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "LOCALRUN_"))}
    env.update(HOME=str(home), API_TIMEOUT_MS=str(int(timeout * 1000)), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
               PATH=str(agent_command.CACHE) + os.pathsep + env.get("PATH", ""))
    return env


def argv_for(server: Served, cli: str, lean: bool, prompt: str, ctx: int, home: Path, timeout: float,
             own_entry: dict | None) -> tuple[list[str], dict]:
    env = _agent_env(home, timeout)
    if server.kind == "localrun":  # the real `localrun launch`
        argv = [sys.executable, "-m", "localrun", "--host", f"127.0.0.1:{server.port}", "--no-autostart", "launch", cli,
                *(["--lean"] if lean else []), "--model", BENCH_MODEL, "--", *agent_args(cli, prompt, timeout)]
        return argv, env
    # llama-server: the same settings `launch` gives the agent, pointed at llama-server
    exe = agent_command.agent_binary(cli)
    catalog = None
    if cli == "codex":
        entries = profiles.codex_catalog(AGENT_MODEL, ctx, lean, None if lean else own_entry)
        catalog = str(profiles.write_catalog(entries, home / "codex-models")) if entries else None
    return agent_command.command(cli, exe, server.url, AGENT_MODEL, None, agent_args(cli, prompt, timeout), lean=lean,
                                 catalog=catalog, max_output=profiles.output_limit(ctx, {}), env=env)


def run_task(server: Served, cli: str, lean: bool, task: Task, ctx: int, work: Path, timeout: float,
             own_entry: dict | None) -> dict[str, Any]:
    repo = make_repo(task, work / "repo")
    home = work / "home"
    home.mkdir()
    argv, env = argv_for(server, cli, lean, task.prompt, ctx, home, timeout, own_entry)
    before = server.counters()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    except BaseException:  # interrupted: the agent (its own session) goes too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.monotonic() - t0
    after = server.counters()
    answer = "\n".join(line for line in (out or "").splitlines() if not line.startswith("localrun: "))
    passed, why = (False, f"timed out after {timeout:.0f}s") if timed_out else score(task, repo, answer)
    delta = {k: (after[k] - before[k]) if after.get(k) is not None and before.get(k) is not None else None
             for k in after}
    return {"task": task.name, "passed": passed, "why": why, "wall_s": round(wall, 1), "rc": proc.returncode,
            "timed_out": timed_out, **{k: (int(v) if v is not None else None) for k, v in delta.items()},
            "answer_head": answer.strip()[:300], "answer_tail": answer.strip()[-300:],
            "stderr_tail": (err or "").strip()[-300:]}


def run_model(servers: list[Served], model: str, ctx: int, cfg: SuiteConfig, scratch: Path,
              say: Callable[[str], None], sink: Callable[[dict], None]) -> list[dict]:
    """Every (profile, cli, task) on each server in turn, back to back: the two sides of a task run
    under the same load of the machine."""
    rows = []
    own = None
    if "full" in cfg.profiles_ and "codex" in cfg.clis:
        own = profiles.codex_own_entry(agent_command.agent_binary("codex"), _agent_env(scratch, cfg.timeout))
    for profile in cfg.profiles_:
        for cli in cfg.clis:
            for task in cfg.tasks:
                for server in servers:
                    work = Path(tempfile.mkdtemp(prefix=f"{cli}-{task.name}-", dir=scratch))
                    row = {"model": model, "server": server.kind, "cli": cli, "profile": profile, "ctx": ctx,
                           **run_task(server, cli, profile == "lean", task, ctx, work, cfg.timeout, own)}
                    shutil.rmtree(work, ignore_errors=True)
                    rows.append(row)
                    sink(row)
                    say(f"{server.kind:12} {model:22} {cli:6} {profile:4} {task.name:12} "
                        f"{'PASS' if row['passed'] else 'fail'} {row['wall_s']:7.1f}s req {row['requests']} prompt "
                        f"{row['prompt_tokens']} cached {row['cached_tokens']}  ({row['why']}; answer "
                        f"{row['answer_tail'][-120:]!r})")
    return rows


def run_suite(cfg: SuiteConfig, say: Callable[[str], None] = print,
              sink: Callable[[dict], None] = lambda row: None) -> dict[str, Any]:
    """``sink`` gets each row as it is measured (a long run keeps what it measured when cut short)."""
    rows: list[dict] = []

    def stop(signum, frame):  # SIGTERM ends the run like Ctrl+C: the servers are stopped on the way out
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    scratch = Path(tempfile.mkdtemp(prefix="localrun-bench-agents-"))
    try:
        for model, gguf in cfg.models:
            servers: list[Served] = []
            try:
                lr, ctx = start_localrun(gguf, scratch / model, cfg, say)
                servers.append(lr)
                if cfg.llama_server:
                    servers.append(start_llama_server(cfg.llama_server, gguf, ctx, profiles.output_limit(ctx, {}),
                                                      scratch / model, cfg))
                    if not cfg.localrun:
                        lr.stop()
                        servers.remove(lr)
                rows += run_model(servers, model, ctx, cfg, scratch, say, sink)
            finally:
                for s in servers:
                    s.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    return {"bench": "agents", "timeout_s": cfg.timeout, "daemon_env": cfg.env, "rows": rows,
            "summary": summarize(rows)}


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["server"], r["cli"], r["profile"]), []).append(r)
    out = []
    for (model, server, cli, profile), rs in groups.items():
        def tot(k: str):
            vals = [r[k] for r in rs if r.get(k) is not None]
            return sum(vals) if vals else None
        out.append({"model": model, "server": server, "cli": cli, "profile": profile, "tasks": len(rs),
                    "passed": sum(r["passed"] for r in rs), "wall_s": round(sum(r["wall_s"] for r in rs), 1),
                    "requests": tot("requests"), "prompt_tokens": tot("prompt_tokens"),
                    "cached_tokens": tot("cached_tokens")})
    return out


__all__ = ["SuiteConfig", "run_suite", "summarize", "resolve_models", "agent_args", "MODELS"]
