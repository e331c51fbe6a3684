"""localrun's chat TUI (Textual).

`run_chat` is what `localrun run MODEL` (on a terminal) and `localrun chat [MODEL]` call.
Textual is imported lazily, so importing this package costs nothing on machines that never
open the TUI."""

from __future__ import annotations


def run_chat(model: str | None = None, base_url: str | None = None, options: dict | None = None,
             think: bool | str | None = None) -> int:
    """Open the chat app against the daemon at `base_url` (default: settings().base_url).

    Returns the process exit code (0 on a normal quit)."""
    from localrun.tui.app import ChatApp

    app = ChatApp(model=model, base_url=base_url, options=options, think=think)
    result = app.run()
    if app.return_code not in (None, 0):
        return app.return_code
    return int(result or 0)


__all__ = ["run_chat"]
