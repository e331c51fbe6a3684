"""What `localrun launch` tells each agent about the model, and its `--lean` profile.

Codex knows only OpenAI's models: for any other it prints "Model metadata for `X` not found.
Defaulting to fallback metadata". Its documented ``model_catalog_json`` setting (a file in the
shape of its own catalog, `codex debug models`) names the model with its context window, so
Codex budgets (and compacts) by the real one. The full profile is Codex's own catalog entry for
a GPT-5 model with tools (the one `codex debug models` lists without a code-mode tool set), with
the local model's name and context window; the lean one is a minimal entry: short instructions,
the plain shell tool, and Codex's optional features off by their documented flags.

Claude Code reads its output limit from ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``; its lean profile is
its own minimal mode: ``--bare``, a short ``--system-prompt`` and four ``--tools``.

The lean instructions are the same words for both agents and for every model: nothing in them is
tuned to one model.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

LEAN_INSTRUCTIONS = ("You are a coding agent working in the current directory. Use the tools to read files, "
                     "search, run commands and edit files when the task needs it, then give a short final answer.")
CLAUDE_LEAN_TOOLS = "Bash,Read,Edit,Write"
# Codex's documented feature flags and settings for the tools and prompt parts a small task needs none of
CODEX_LEAN_FLAGS = ["--disable", "goals", "--disable", "multi_agent", "--disable", "apps", "--disable", "plugins",
                    "--disable", "image_generation", "-c", 'web_search="disabled"',
                    "-c", "skills.bundled.enabled=false",
                    "-c", "include_apps_instructions=false", "-c", "include_environment_context=false",
                    "--disable", "view_image"]
SMALL_MODEL = 7_000_000_000  # below this many parameters `launch` suggests --lean
CATALOG_DIR = Path.home() / ".cache" / "localrun-agents" / "codex-models"


def parameter_count(info: dict) -> int | None:
    """The model's parameter count, from `show`'s model_info or its details ("1.5B", "494.03M")."""
    for key, value in (info.get("model_info") or {}).items():
        if key.endswith("parameter_count") and isinstance(value, int) and value > 0:
            return value
    size = str((info.get("details") or {}).get("parameter_size") or "")
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMBT])\s*", size, re.I)
    if not m:
        return None
    return int(float(m.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()])


def output_limit(ctx: int | None, info: dict) -> int:
    """The most tokens one answer may take: the model's own num_predict if it sets one, else a quarter
    of the context (at most 8,192), so an answer never crowds out the conversation."""
    params = str(info.get("parameters") or "")
    m = re.search(r"^\s*num_predict\s+(\d+)", params, re.M)
    if m and int(m.group(1)) > 0:
        return int(m.group(1))
    return max(256, min((ctx or 8192) // 4, 8192))


def agent_modelfile(model: str, ctx: int, info: dict) -> str:
    """The agent model's Modelfile: the model with the context chosen for agents and, unless the model
    sets one, an output limit (Codex sends none)."""
    text = f"FROM {model}\nPARAMETER num_ctx {ctx}\n"
    if not re.search(r"^\s*num_predict\s", str(info.get("parameters") or ""), re.M):
        text += f"PARAMETER num_predict {output_limit(ctx, info)}\n"
    return text


def _minimal_entry(name: str, ctx: int | None, instructions: str) -> dict:
    entry = {"slug": name, "display_name": name, "description": "a local model served by localrun",
             "supported_reasoning_levels": [], "shell_type": "shell_command", "visibility": "list",
             "supported_in_api": True, "priority": 1, "upgrade": None, "base_instructions": instructions,
             "supports_reasoning_summaries": False, "support_verbosity": False, "default_verbosity": None,
             "apply_patch_tool_type": None, "truncation_policy": {"mode": "tokens", "limit": 10000},
             "supports_parallel_tool_calls": False, "experimental_supported_tools": [], "input_modalities": ["text"]}
    if ctx:
        entry["context_window"] = ctx
    return entry


def codex_own_entry(exe: str, env: dict) -> dict | None:
    """Codex's own catalog entry for a GPT-5 model with plain tools (`codex debug models`), or None."""
    try:
        r = subprocess.run([exe, "debug", "models"], capture_output=True, text=True, timeout=60, env=env,
                           stdin=subprocess.DEVNULL)
        models = json.loads(r.stdout).get("models") or []
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError):
        return None
    plain = [m for m in models if isinstance(m, dict) and not m.get("tool_mode") and m.get("base_instructions")]
    return dict(min(plain, key=lambda m: m.get("priority", 0))) if plain else None


def codex_catalog(name: str, ctx: int | None, lean: bool, own: dict | None) -> dict:
    """The catalog (`model_catalog_json`) that names the agent model for Codex ({} when there is none
    of Codex's own to start the full profile from: then Codex keeps its fallback)."""
    if lean:
        return {"models": [_minimal_entry(name, ctx, LEAN_INSTRUCTIONS)]}
    if own is None:
        return {}
    entry = dict(own)
    entry.update(slug=name, display_name=name, description="a local model served by localrun", priority=1,
                 visibility="list", supported_in_api=True, upgrade=None, prefer_websockets=False,
                 use_responses_lite=False, input_modalities=["text"])
    for key in ("max_context_window", "auto_compact_token_limit", "availability_nux"):
        entry.pop(key, None)
    if ctx:
        entry["context_window"] = ctx
    return {"models": [entry]}


def write_catalog(catalog: dict, directory: Path = CATALOG_DIR) -> Path:
    text = json.dumps(catalog, indent=1, sort_keys=True)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"catalog-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def claude_lean_args() -> list[str]:
    return ["--bare", "--system-prompt", LEAN_INSTRUCTIONS, "--tools", CLAUDE_LEAN_TOOLS]


__all__ = ["LEAN_INSTRUCTIONS", "CLAUDE_LEAN_TOOLS", "CODEX_LEAN_FLAGS", "SMALL_MODEL", "parameter_count",
           "output_limit", "agent_modelfile", "codex_own_entry", "codex_catalog", "write_catalog", "claude_lean_args"]
