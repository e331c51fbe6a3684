"""The data the library hands out: resolved models, list entries, pull progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from localrun.errors import LocalrunError
from localrun.library.gguf_info import GGUFInfo


class Cancelled(LocalrunError):
    """A pull or create was cancelled by its caller; nothing was installed."""

    status = 499
    code = "cancelled"


@dataclass
class ResolvedModel:
    name: str  # canonical "name:tag"
    digest: str  # "sha256:<hex>" of the manifest
    weights: Path  # the .gguf blob, or a directory of the safetensors model's files
    format: str  # "gguf" | "safetensors"
    template: str | None
    system: str | None
    parameters: dict[str, Any]
    messages: list[dict]
    license: str | None
    adapter: str | None
    info: GGUFInfo | None
    size: int
    modified_at: datetime
    details: dict[str, Any] = field(default_factory=dict)
    projector: Path | None = None  # the vision projector GGUF (its own layer), when the model takes images


@dataclass
class ModelSummary:
    name: str
    digest: str
    size: int
    modified_at: datetime
    details: dict[str, Any]
    capabilities: list[str] = field(default_factory=list)  # as show's (localrun.library.capabilities)


@dataclass
class PullEvent:
    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in (("status", self.status), ("digest", self.digest),
                                  ("total", self.total), ("completed", self.completed)) if v is not None}


ProgressFn = Callable[[PullEvent], None] | None  # where a pull or create reports its progress
