"""Error types shared by every layer.

Each carries the HTTP status the daemon answers with, so routes map errors in one
place and no layer below the server knows about HTTP objects. Messages are written
for users: they say what was wrong and what to do next, and never leak local paths
or user names into HTTP answers (``public_message``).
"""

from __future__ import annotations


class LocalrunError(Exception):
    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code

    @property
    def public_message(self) -> str:
        return self.message


class InvalidRequest(LocalrunError):
    """Bad input from a user: a malformed name, digest, parameter or Modelfile."""

    status = 400
    code = "invalid_request_error"


class NotFound(LocalrunError):
    status = 404
    code = "model_not_found"


class ModelDamaged(LocalrunError):
    """A stored model's own files are missing or invalid (a blob deleted, truncated, not a valid GGUF; a
    corrupt manifest): the request is fine, the daemon's store is not. The message names the model, says
    what is wrong and how to repair it (`localrun pull NAME` again, or `localrun rm NAME` and create it
    again). Never a 404: that stays "no such model" (a client pulls on it)."""

    status = 500
    code = "model_damaged"


class Conflict(LocalrunError):
    status = 409
    code = "conflict"


class InsufficientMemory(LocalrunError):
    """A model (or its context) does not fit in free memory."""

    status = 507
    code = "insufficient_memory"


class Busy(LocalrunError):
    """The request queue is full; retry later."""

    status = 503
    code = "server_busy"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class BackendError(LocalrunError):
    """A backend failed to load or run a model."""

    status = 500
    code = "backend_error"


class ShuttingDown(LocalrunError):
    """The daemon is stopping: no new work, and work still running past the grace period ends."""

    status = 503
    code = "shutting_down"
