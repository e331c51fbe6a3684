"""Where each agent is, and its argv and environment pointed at one server only.

Claude Code gets ``ANTHROPIC_BASE_URL`` (its non-essential traffic off); Codex a
``model_providers.localrun`` entry (``wire_api = "responses"``) as ``-c`` overrides, placed before its
subcommand (they are global). With ``lean``, each agent's own minimal settings (profiles.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from localrun.agents import profiles as lp

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
            extra: list[str], *, lean: bool = False, catalog: str | None = None,
            max_output: int | None = None, env: dict | None = None) -> tuple[list[str], dict]:
    """The agent's argv and environment, pointed at the daemon only; with ``lean``, the agent's own
    minimal settings (see launch_profiles); ``catalog``: Codex's model catalog file; ``max_output``:
    Claude Code's output limit; ``env``: the environment to start from (default: this process's)."""
    env = dict(os.environ if env is None else env)
    if agent == "claude":
        if max_output:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model,
                   ANTHROPIC_DEFAULT_HAIKU_MODEL=model, ANTHROPIC_API_KEY=api_key or "localrun",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                   DISABLE_ERROR_REPORTING="1")
        env.pop("ANTHROPIC_AUTH_TOKEN", None)
        return [exe, *(lp.claude_lean_args() if lean else []), *extra], env
    overrides = ['model_provider="localrun"', 'model_providers.localrun.name="localrun"',
                 f'model_providers.localrun.base_url="{base_url}/v1"', 'model_providers.localrun.wire_api="responses"',
                 "analytics.enabled=false"]
    if api_key:
        env["LOCALRUN_API_KEY"] = api_key
        overrides.append('model_providers.localrun.env_key="LOCALRUN_API_KEY"')
    if catalog:
        overrides.append(f"model_catalog_json={json.dumps(catalog)}")
    argv = [exe]
    # `codex exec ...` / `codex resume ...`: the overrides go before the subcommand, which is global
    for o in overrides:
        argv += ["-c", o]
    return argv + (lp.CODEX_LEAN_FLAGS if lean else []) + ["-m", model, *extra], env


__all__ = ["AGENTS", "CACHE", "LaunchError", "agent_binary", "trained_context", "agent_model_name", "command"]
