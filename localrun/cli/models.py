"""`pull`, `list`, `show`, `rm` and `cp`: the daemon's model library, as tables and text."""

from __future__ import annotations

from localrun.cli.common import human_ago, human_count, human_size, print_error, short_id, table
from localrun.cli.progress import show_progress
from localrun.client import APIError, DaemonClient


def render_show(info: dict, verbose: bool = False) -> str:
    mi = info.get("model_info") or {}
    details = info.get("details") or {}
    arch = mi.get("general.architecture") or details.get("family") or "-"

    def arch_key(name):
        return mi.get(f"{arch}.{name}")

    params = mi.get("general.parameter_count")
    model_rows = [
        ("architecture", arch),
        ("parameters", human_count(params) if params else details.get("parameter_size") or "-"),
        ("context length", arch_key("context_length") or "-"),
        ("embedding length", arch_key("embedding_length") or "-"),
        *([("experts", f"{arch_key('expert_count')} ({arch_key('expert_used_count') or '?'} active per token)")]
          if arch_key("expert_count") else []),
        ("quantization", details.get("quantization_level") or "-"),
        ("format", details.get("format") or "-"),
    ]
    out = ["  Model"] + [f"    {k:<20}{v}" for k, v in model_rows]
    if info.get("damaged"):  # the store's copy cannot be used: say so before anything else
        out = ["  Damaged", f"    {info['damaged']}", ""] + out

    def section(title: str, body: str | None, limit: int | None = None):
        if not body or not str(body).strip():
            return
        lines = str(body).strip().splitlines()
        if limit and len(lines) > limit:
            lines = lines[:limit] + ["..."]
        out.extend(["", f"  {title}"] + [f"    {ln}" for ln in lines])

    if info.get("capabilities"):
        caps = [c + (" (generic format: the template renders none)" if c == "tools"
                     and info.get("tool_format") == "generic" else "") for c in info["capabilities"]]
        section("Capabilities", "\n".join(caps))
    section("Parameters", info.get("parameters"))
    section("System", info.get("system"), limit=None if verbose else 4)
    section("License", info.get("license"), limit=None if verbose else 2)
    weights = [f"path      {info['weights_path']}"] if info.get("weights_path") else []
    if info.get("projector_path"):
        weights.append(f"projector {info['projector_path']}")
    if info.get("digest"):
        weights.append(f"digest    {info['digest']}")
    section("Weights", "\n".join(weights))
    if verbose:
        section("Metadata", "\n".join(f"{k:<40}{v}" for k, v in sorted(mi.items())))
    return "\n".join(out) + "\n"


def cmd_pull(args, client: DaemonClient) -> int:
    last = show_progress(client.pull(args.model))
    return 0 if last and last.get("status") == "success" else 1


def list_capabilities(m: dict) -> str:
    """What `list` shows of a model's capabilities: all but plain completion (vision, tools, ...)."""
    caps = [str(c) for c in m.get("capabilities") or [] if c != "completion"]
    return ", ".join(caps) or "-"


def cmd_list(args, client: DaemonClient) -> int:
    rows = [[m.get("name") or m.get("model", "?"), short_id(m.get("digest")), human_size(m.get("size")),
             human_ago(m.get("modified_at")), list_capabilities(m)] for m in client.tags()]
    print(table(["NAME", "ID", "SIZE", "MODIFIED", "CAPABILITIES"], rows))
    return 0


def cmd_show(args, client: DaemonClient) -> int:
    info = client.show(args.model, verbose=args.verbose)
    for field in ("modelfile", "parameters", "system", "template", "license"):
        if getattr(args, field):
            text = info.get(field) or ""
            print(text, end="" if text.endswith("\n") or not text else "\n")
            return 0
    print(render_show(info, verbose=args.verbose), end="")
    return 0


def cmd_rm(args, client: DaemonClient) -> int:
    failed = 0
    for name in args.models:
        try:
            client.delete(name)
            print(f"deleted '{name}'")
        except APIError as exc:
            print_error(exc.message)
            failed += 1
    return 1 if failed else 0


def cmd_cp(args, client: DaemonClient) -> int:
    client.copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0
