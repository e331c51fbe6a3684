"""Progress bars for the daemon's pull and create events, and the pull that `run` and `chat` do first."""

from __future__ import annotations

from typing import Iterable

from localrun.client import APIError, DaemonClient


def show_progress(events: Iterable[dict]) -> dict | None:
    """Draw rich progress bars (bytes, speed, ETA) from Ollama-style progress events,
    one bar per digest (or, without one, per status: a create's copying and quantizing); other statuses print as
    lines. Returns the last event."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    console = Console(stderr=True, highlight=False)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=console)
    bars: dict[str, int] = {}
    last: dict | None = None
    last_status = None
    try:
        for ev in events:
            last = ev
            status = str(ev.get("status", ""))
            total, key = ev.get("total"), ev.get("digest") or (status if "completed" in ev else None)
            if total and key:
                if not bars:
                    progress.start()  # only once there is something to draw
                if key not in bars:
                    bars[key] = progress.add_task(status, total=total)
                progress.update(bars[key], total=total, completed=ev.get("completed") or 0)
            elif status and status != last_status:
                console.print(status, markup=False)
            last_status = status
    finally:
        if bars:
            progress.stop()
    return last


def ensure_model(client: DaemonClient, model: str) -> dict:
    """Pull the model first when the library lacks it, as `ollama run` does; its /api/show answer."""
    try:
        return client.show(model)
    except APIError as exc:
        if exc.status != 404:
            raise
        show_progress(client.pull(model))
    return client.show(model)
