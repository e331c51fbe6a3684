"""`localrun launch claude|codex [--model M] [-- AGENT ARGS]`: a coding agent pointed at the daemon.

The agent (Claude Code or Codex CLI, from the npm registry: on PATH, or under
``~/.cache/localrun-agents/node_modules/.bin``) is started with only its documented settings:
Claude Code with ``ANTHROPIC_BASE_URL`` (and its non-essential traffic off), Codex with a
``model_providers.localrun`` entry (``wire_api = "responses"``) passed as ``-c`` overrides, so
neither reaches anything but the daemon. Agents send 15-25k-token prompts and no context size,
so the model they get is ``<model>-agent`` (made here: the same weights, ``PARAMETER num_ctx``
set as ``ollama launch`` does: the context the model was trained for as the ceiling, lowered to
what the free memory holds, by the daemon's own memory plan (``/api/show`` with
``fit_context``: the load's estimate and plan, every model unloaded); the choice is printed.
Agents send tools with every request: `launch` says when they reach the model in the generic JSON
format (its template renders none), and refuses when they cannot reach it at all (that format off).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from localrun.cli.common import CLIError
from localrun.client import DaemonClient

AGENTS = {"claude": ("claude", "@anthropic-ai/claude-code"), "codex": ("codex", "@openai/codex")}
CACHE = Path.home() / ".cache" / "localrun-agents" / "node_modules" / ".bin"


class LaunchError(Exception):
    pass


def agent_binary(agent: str) -> str:
    exe, package = AGENTS[agent]
    found = shutil.which(exe) or (str(CACHE / exe) if (CACHE / exe).exists() else None)
    if found is None:
        raise LaunchError(f"{exe} is not installed: install it from the npm registry with "
                          f"`npm install -g {package}` (or `npm install --prefix ~/.cache/localrun-agents {package}`)")
    return found


def trained_context(info: dict) -> int | None:
    """The context length the model was trained for, from `show`'s model_info."""
    for key, value in (info.get("model_info") or {}).items():
        if key.endswith(".context_length") and isinstance(value, int) and value > 0:
            return value
    return None


def agent_model_name(model: str) -> str:
    name, _, tag = model.partition(":")
    return f"{name}:{tag or 'latest'}-agent"


def command(agent: str, exe: str, base_url: str, model: str, api_key: str | None,
            extra: list[str]) -> tuple[list[str], dict]:
    """The agent's argv and environment, pointed at the daemon only."""
    env = dict(os.environ)
    if agent == "claude":
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model,
                   ANTHROPIC_DEFAULT_HAIKU_MODEL=model, ANTHROPIC_API_KEY=api_key or "localrun",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                   DISABLE_ERROR_REPORTING="1")
        env.pop("ANTHROPIC_AUTH_TOKEN", None)
        return [exe, *extra], env
    overrides = ['model_provider="localrun"', 'model_providers.localrun.name="localrun"',
                 f'model_providers.localrun.base_url="{base_url}/v1"', 'model_providers.localrun.wire_api="responses"',
                 "analytics.enabled=false"]
    if api_key:
        env["LOCALRUN_API_KEY"] = api_key
        overrides.append('model_providers.localrun.env_key="LOCALRUN_API_KEY"')
    argv = [exe]
    # `codex exec ...` / `codex resume ...`: the overrides go before the subcommand, which is global
    for o in overrides:
        argv += ["-c", o]
    return argv + ["-m", model, *extra], env


def run(args, client) -> int:
    """Make the agent model, then run the agent in the foreground; its exit code is ours."""
    exe = agent_binary(args.agent)
    models = [m.get("name") or m.get("model") for m in client.tags()]
    model = args.model
    if model is None:
        base = [m for m in models if m and not m.endswith("-agent")]
        if len(base) != 1:
            raise LaunchError("name the model for the agent with --model (one of: " + ", ".join(base or ["none yet: "
                              "`localrun pull` one"]) + ")")
        model = base[0]
    info = client.show(model, fit_context=True)
    tools = info.get("tool_format")
    if "tool_format" in info and tools is None:  # every agent request carries tools: each would be a 400
        raise LaunchError(f"{model}'s chat template cannot render tools and the generic tool format is off "
                          "(LOCALRUN_GENERIC_TOOLS=off), so every request of the agent would be refused: turn "
                          "the generic format on, or choose a model whose template renders tools")
    if tools == "generic":
        print(f"localrun: note: {model}'s chat template renders no tools; they reach it in the generic JSON format "
              "(`localrun show` says so). A small model may answer with tool calls only, turn after turn: a model "
              "trained for tool calls (its template renders them) works better with agents.", flush=True)
    fit = info.get("fit_context") if isinstance(info.get("fit_context"), dict) else {}
    ctx = fit.get("num_ctx") or trained_context(info)  # the daemon's memory plan; an older daemon: trained
    name = model
    if ctx:
        name = agent_model_name(model)
        events = list(client.create(name, f"FROM {model}\nPARAMETER num_ctx {ctx}\n"))
        last = events[-1] if events else {}
        if last.get("status") != "success":
            raise LaunchError(f"could not make {name}: {last.get('error') or last}")
    argv, env = command(args.agent, exe, client.base_url, name, getattr(client, "api_key", None), args.agent_args)
    print(f"localrun: {args.agent} on {name} (context {ctx or 'the default'} tokens"
          + (f": {fit['reason']}" if fit.get("reason") else "") + f") via {client.base_url}", flush=True)
    try:
        return subprocess.call(argv, env=env)
    except KeyboardInterrupt:
        return 130


def cmd_launch(args, client: DaemonClient) -> int:
    try:
        return run(args, client)
    except LaunchError as exc:
        raise CLIError(str(exc)) from None


__all__ = ["run", "command", "agent_binary", "trained_context", "agent_model_name", "LaunchError", "cmd_launch"]
