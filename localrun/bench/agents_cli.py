"""The `localrun bench agents` command line (stdlib-only at import; the run is bench/agents.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("agents", help="coding agents (Codex exec, Claude Code -p) finishing small tasks in throw-away "
                                      "git repositories, started by `localrun launch` (see bench/agents.py)")
    p.add_argument("--model", help="the Qwen2.5-Coder models: 0.5b, 1.5b or both, comma-separated (default 0.5b)")
    p.add_argument("--gguf", type=Path, action="append", help="another GGUF file (repeatable)")
    p.add_argument("--cli", default="codex,claude", help="codex, claude or both (default both)")
    p.add_argument("--profile", default="lean,full", help="lean, full or both (default both)")
    p.add_argument("--lean", dest="profile", action="store_const", const="lean", help="only the lean profile")
    p.add_argument("--full", dest="profile", action="store_const", const="full", help="only the full profile")
    p.add_argument("--tasks", help="comma-separated task names (default: all; see bench/agents_tasks.py)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a task may take; a timeout fails (default 600)")
    p.add_argument("--llama-server", nargs="?", const="build", default=None, metavar="PATH",
                   help="also run the suite against llama.cpp's llama-server on the same GGUF "
                        "(PATH, or the cached build)")
    p.add_argument("--only-llama-server", action="store_true", help="with --llama-server: skip localrun's side")
    p.add_argument("--max-ctx", type=int, default=32768, help="the largest context given to the agent model")
    p.add_argument("--daemon-env", action="append", default=[], metavar="K=V",
                   help="a LOCALRUN_* setting for the daemon (repeatable): the levers, e.g. LOCALRUN_SPECULATIVE=...")
    p.add_argument("--result", type=Path, help="write the rows and summary as JSON here")


def cmd(a: argparse.Namespace) -> int:
    from localrun.bench.agents import SuiteConfig, resolve_models, run_suite
    from localrun.bench.agents_tasks import select

    clis = [c.strip() for c in a.cli.split(",") if c.strip()]
    profs = [c.strip() for c in a.profile.split(",") if c.strip()]
    if not clis or set(clis) - {"codex", "claude"}:
        raise ValueError(f"--cli takes codex, claude or both, not {a.cli!r}")
    if not profs or set(profs) - {"lean", "full"}:
        raise ValueError(f"--profile takes lean, full or both, not {a.profile!r}")
    env = {}
    for kv in a.daemon_env:
        k, sep, v = kv.partition("=")
        if not sep or not k.startswith("LOCALRUN_"):
            raise ValueError(f"--daemon-env takes LOCALRUN_NAME=VALUE, not {kv!r}")
        env[k] = v
    binary = None
    if a.llama_server:
        if a.llama_server == "build":
            from localrun.bench.llama_server_build import ensure_llama_server

            binary = ensure_llama_server()
        else:
            binary = Path(a.llama_server)
    if a.only_llama_server and binary is None:
        raise ValueError("--only-llama-server needs --llama-server")
    cfg = SuiteConfig(resolve_models(a.model, a.gguf), clis, profs, select(a.tasks), timeout=a.timeout,
                      llama_server=binary,
                 localrun=not a.only_llama_server, max_ctx=a.max_ctx, env=env)
    partial = a.result.with_suffix(".partial.jsonl") if a.result else None
    if partial:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")

    def sink(row: dict) -> None:
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")

    res = run_suite(cfg, say=lambda s: print(s, flush=True), sink=sink)
    print(f"\n{'server':12} {'model':22} {'cli':6} {'profile':7} {'pass':>6} {'wall s':>8} {'requests':>8} "
          f"{'prompt tok':>10} {'cached':>8}")
    for s in res["summary"]:
        print(f"{s['server']:12} {s['model']:22} {s['cli']:6} {s['profile']:7} {s['passed']:>2}/{s['tasks']:<3} "
              f"{s['wall_s']:>8.1f} {str(s['requests']):>8} {str(s['prompt_tokens']):>10} {str(s['cached_tokens']):>8}")
    if a.result:
        a.result.parent.mkdir(parents=True, exist_ok=True)
        a.result.write_text(json.dumps(res, indent=1) + "\n")
        print(f"written to {a.result}")
    return 0
