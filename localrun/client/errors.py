"""What the clients raise: the daemon's error answers (APIError) and no daemon at all (DaemonUnavailable)."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """The daemon answered with an error (4xx/5xx, or an error event inside a stream)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


class DaemonUnavailable(Exception):
    """No daemon answers at the base URL (and none could be started)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def error_message(body: Any, fallback: str) -> str:
    """Ollama ({"error": "..."}), OpenAI ({"error": {"message": ...}}) or FastAPI
    ({"detail": ...}) error bodies -> one line."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            err = err.get("message") or err.get("msg") or json.dumps(err)
        if isinstance(err, list):  # FastAPI validation errors
            err = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}" if isinstance(e, dict) else str(e)
                for e in err
            )
        if err:
            return str(err)
    if isinstance(body, str) and body.strip():
        return body.strip().splitlines()[0][:300]
    return fallback


def check_event(event: Any) -> dict:
    """An error event inside an NDJSON stream (the HTTP status was already 200) raises."""
    if isinstance(event, dict) and event.get("error"):
        code = event.get("status")
        raise APIError(code if isinstance(code, int) else 500, error_message(event, "error"))
    return event
