"""How the chat app words what the daemon says: errors, where a model runs, a reply's stats."""

from __future__ import annotations

from localrun.client import APIError, DaemonUnavailable


def describe_processor(entry: dict | None) -> str:
    """An /api/ps entry -> 'llama.cpp CPU', 'CUDA native', ... (as honest as the daemon is)."""
    if not entry:
        return ""
    backend = entry.get("backend")
    device = entry.get("device")
    if isinstance(backend, dict):
        device = device or backend.get("device")
        backend = backend.get("name")
    if backend and device:
        return "CUDA native" if backend == "native" and str(device).upper().startswith("CUDA") else f"{backend} {device}"
    if backend:
        return str(backend)
    if entry.get("processor"):
        return str(entry["processor"])
    return "GPU" if entry.get("size_vram") else "CPU"


def final_stats(final: dict | None, ttft: float | None, wall: float, completion_chars: int) -> dict:
    """Stats of the last reply from the final chunk (Ollama's fields), TTFT measured here."""
    stats: dict = {"ttft": ttft}
    if not final:
        return stats
    prompt = final.get("prompt_eval_count")
    completion = final.get("eval_count")
    cached = final.get("cached_tokens")  # prompt tokens served from the daemon's prefix cache
    eval_ns = final.get("eval_duration")
    if completion is not None:
        stats.update(prompt=prompt or 0, cached=cached or 0, completion=completion)
        if eval_ns:
            stats["tps"] = completion / (eval_ns / 1e9)
        elif ttft is not None and wall > ttft and completion > 1:
            stats["tps"] = (completion - 1) / (wall - ttft)
    return stats


def explain_error(exc: BaseException, model: str | None) -> str:
    if isinstance(exc, DaemonUnavailable):
        return exc.message + " — then send your message again."
    if isinstance(exc, APIError):
        msg = exc.message
        if exc.status == 404:
            return f"{msg} — /model NAME pulls a model, Ctrl+O lists the library."
        if exc.status == 503:
            return f"the daemon is busy ({msg}) — try again in a moment."
        if exc.status == 507:
            return f"{model or 'the model'} does not fit in memory: {msg} — try a smaller model or /set num_ctx lower."
        if exc.status >= 500:
            return f"{model or 'the model'} failed: {msg}"
        return msg
    return f"unexpected error: {type(exc).__name__}: {exc}"
