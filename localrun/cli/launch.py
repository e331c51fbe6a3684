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
import subprocess

from localrun.agents import profiles as lp
from localrun.agents.command import LaunchError, agent_binary, agent_model_name, command, trained_context
from localrun.cli.common import CLIError
from localrun.client import DaemonClient


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
        modelfile = lp.agent_modelfile(model, ctx, info)
        events = list(client.create(name, modelfile))
        last = events[-1] if events else {}
        if last.get("status") != "success":
            raise LaunchError(f"could not make {name}: {last.get('error') or last}")
    lean = bool(getattr(args, "lean", False))
    max_output = lp.output_limit(ctx, info)
    catalog = None
    if args.agent == "codex":
        own = None if lean else lp.codex_own_entry(exe, dict(os.environ))
        entries = lp.codex_catalog(name, ctx, lean, own)
        catalog = str(lp.write_catalog(entries)) if entries else None
    argv, env = command(args.agent, exe, client.base_url, name, getattr(client, "api_key", None), args.agent_args,
                        lean=lean, catalog=catalog, max_output=max_output)
    print(f"localrun: {args.agent} on {name} (context {ctx or 'the default'} tokens"
          + (f": {fit['reason']}" if fit.get("reason") else "") + f"; answers up to {max_output} tokens"
          + ("; lean profile" if lean else "") + f") via {client.base_url}", flush=True)
    params = lp.parameter_count(info)
    if not lean and params and params < lp.SMALL_MODEL:
        print(f"localrun: note: {model} is small ({params / 1e9:.1f}B parameters): the agent's full prompt and "
              f"tool set can overwhelm it; `localrun launch {args.agent} --lean` starts it with its own minimal "
              "settings (short instructions, the few tools a task needs)", flush=True)
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
