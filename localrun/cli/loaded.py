"""`ps` and `stop`: the models the daemon has loaded."""

from __future__ import annotations

from localrun.cli.common import CLIError, human_size, human_until, short_id, table
from localrun.client import APIError, DaemonClient


def processor(m: dict) -> str:
    if m.get("processor"):
        return str(m["processor"])
    size, vram = m.get("size") or 0, m.get("size_vram") or 0
    if not size or vram <= 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    gpu = round(100 * vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def backend_name(m: dict) -> str:
    b = m.get("backend")
    if isinstance(b, dict):
        return str(b.get("name") or b.get("backend") or "-")
    return str(b or "-")


def cmd_ps(args, client: DaemonClient) -> int:
    models = client.ps()
    rows = [[m.get("name") or m.get("model", "?"), short_id(m.get("digest")), human_size(m.get("size")),
             processor(m), m.get("placement") or m.get("device") or "-", backend_name(m),
             str(m.get("context_length") or "-"), str(m.get("slots") or "-"),
             human_until(m.get("expires_at"))] for m in models]
    print(table(["NAME", "ID", "SIZE", "PROCESSOR", "WHERE", "BACKEND", "CONTEXT", "PARALLEL", "UNTIL"], rows))
    if args.verbose:
        for m in models:
            runner = m.get("runner") or {}
            proc = (f"\n  runner process {runner['pid']}: {human_size(runner.get('rss_bytes'))} resident"
                    + (f", {human_size(runner['vram_bytes'])} VRAM" if runner.get("vram_bytes") else "")
                    if runner.get("pid") else "")
            kv = f" ({m['kv_cache_type']} KV cache)" if m.get("kv_cache_type") else ""
            print(f"\n{m.get('name') or m.get('model', '?')}: context {m.get('context_length', '-')} tokens{kv}, "
                  f"{m.get('slots', '-')} slot(s), {m.get('active', 0)} active, {m.get('waiting', 0)} waiting"
                  + proc + (f"\n  {m['reason']}" if m.get("reason") else "")
                  + "".join(f"\n  fallback: {f}" for f in m.get("fallbacks") or ()) + prompt_cache_line(m))
    return 0


def prompt_cache_line(m: dict) -> str:
    """ps -v's line on the prompt cache on disk ("" when the model has none)."""
    pc = m.get("prompt_cache")
    if not isinstance(pc, dict):
        return ""
    return (f"\n  prompt cache on disk: {pc.get('hits', 0)} hit(s), {pc.get('misses', 0)} miss(es), "
            f"{pc.get('restored_tokens', 0)} tokens restored, {human_size(pc.get('read_bytes'))} read, "
            f"{human_size(pc.get('written_bytes'))} written, {pc.get('entries', 0)} saved prompt(s)"
            + (f", {pc['bad_files']} bad file(s) removed" if pc.get("bad_files") else ""))


def cmd_stop(args, client: DaemonClient) -> int:
    """As `ollama stop`: a generate with keep_alive 0, so the daemon resolves the name as every other verb's
    (aliases such as smollm2 -> smollm2:135m, case) and answers with the one it unloaded."""
    running = {m.get("name") or m.get("model") for m in client.ps()}
    try:
        answer = client.stop(args.model)
    except APIError as exc:
        if exc.status == 404:
            raise CLIError(f"couldn't find model '{args.model}' to stop (see `localrun list`)") from None
        raise
    name = answer.get("model") or args.model
    if name not in running:  # the daemon's answer is "unload" either way
        raise CLIError(f"model '{args.model}' is not running (see `localrun ps`)")
    if answer.get("done_reason") not in (None, "unload"):
        raise CLIError(f"the daemon did not unload {name} (it answered {answer.get('done_reason')!r})")
    return 0
