"""Saved conversations: one JSON file per conversation under ``settings().chats_dir``.

Plain standard library, so it can be tested and reused without Textual.  Writes are
atomic (temp file + ``os.replace``) so a crash never leaves a half-written chat, and a
damaged file is skipped when listing instead of breaking the whole list.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ID_RE = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def _new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass
class Conversation:
    model: str | None = None
    system: str | None = None
    options: dict = field(default_factory=dict)
    think: bool | str | None = None  # None: as the model's template does; False / True / low|medium|high
    messages: list[dict] = field(default_factory=list)  # {"role", "content"[, "thinking", "images", "attachments"]}
    id: str = field(default_factory=_new_id)
    title: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def display_title(self) -> str:
        if self.title:
            return self.title
        for m in self.messages:
            if m.get("role") == "user" and m.get("content", "").strip():
                first = " ".join(m["content"].split())
                return first[:60] + ("…" if len(first) > 60 else "")
        return "(empty conversation)"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Conversation":
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        msgs = data.get("messages") or []
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise ValueError("messages must be a list of {role, content}")
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError("options must be an object")
        cid = str(data.get("id") or _new_id())
        if not _ID_RE.match(cid):
            raise ValueError(f"bad conversation id {cid!r}")
        return cls(
            model=data.get("model") or None,
            system=data.get("system") or None,
            options=options,
            think=_think(data.get("think")),
            messages=[{"role": m["role"], "content": m["content"],
                       **({"thinking": m["thinking"]} if isinstance(m.get("thinking"), str) and m["thinking"] else {}),
                       **{k: m[k] for k in ("images", "attachments") if _strings(m.get(k))}}
                      for m in msgs],
            id=cid,
            title=str(data.get("title") or ""),
            created_at=float(data.get("created_at") or time.time()),
            updated_at=float(data.get("updated_at") or time.time()),
        )


def _think(v):
    from localrun.client import THINK_LEVELS

    return v if v is None or isinstance(v, bool) or v in THINK_LEVELS else None


def _strings(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)


class ChatStore:
    """Conversations as ``<chats_dir>/<id>.json``."""

    def __init__(self, root: Path | None = None):
        if root is None:
            from localrun.config import settings

            root = settings().chats_dir
        self.root = Path(root)

    def path(self, conv_id: str) -> Path:
        if not _ID_RE.match(conv_id):
            raise ValueError(f"bad conversation id {conv_id!r}")
        return self.root / f"{conv_id}.json"

    def save(self, conv: Conversation) -> Path:
        """Write atomically. Empty conversations are not written."""
        conv.updated_at = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(conv.id)
        fd, tmp = tempfile.mkstemp(prefix=f".{conv.id}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(conv.to_dict(), f, ensure_ascii=False, indent=1)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return target

    def load(self, conv_id: str) -> Conversation:
        with open(self.path(conv_id), encoding="utf-8") as f:
            return Conversation.from_dict(json.load(f))

    def list(self) -> list[Conversation]:
        """All readable conversations, most recently updated first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.glob("*.json"):
            try:
                with open(p, encoding="utf-8") as f:
                    out.append(Conversation.from_dict(json.load(f)))
            except (OSError, ValueError, TypeError):
                continue  # a damaged file must not hide the others
        out.sort(key=lambda c: c.updated_at, reverse=True)
        return out

    def delete(self, conv_id: str) -> None:
        try:
            self.path(conv_id).unlink()
        except FileNotFoundError:
            pass
