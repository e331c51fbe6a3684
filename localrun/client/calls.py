"""The daemon's API described once, as request descriptions that both clients send.

Every request is a :class:`Call` (method, path, JSON body, whether the answer is an NDJSON
stream and how to pick the result out of the body), made by a method of :class:`Requests`;
:func:`bind_requests` turns those methods into a client's own, sent by its ``_send``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: dict | None = None
    stream: bool = False  # the answer is an NDJSON stream of events
    pick: Callable[[Any], Any] | None = None  # turns the decoded body into the result


THINK_LEVELS = ("low", "medium", "high")


def parse_think(text: str) -> bool | str:
    """A think setting as a user writes it (CLI --think, /set think): true/false (on/off, yes/no,
    1/0; empty = true) or an effort level, as Ollama's `think` takes it. ValueError otherwise."""
    t = text.strip().lower()
    if t in ("", "true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    if t in THINK_LEVELS:
        return t
    raise ValueError(f"wants true, false, low, medium or high, got {text!r}")


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


class Requests:
    """The daemon's API as request descriptions. Subclasses send them."""

    def version(self) -> Call:
        return Call("GET", "/api/version")

    def tags(self) -> Call:
        return Call("GET", "/api/tags", pick=lambda b: b.get("models") or [])

    def ps(self) -> Call:
        return Call("GET", "/api/ps", pick=lambda b: b.get("models") or [])

    def show(self, name: str, verbose: bool = False, fit_context: bool = False) -> Call:
        return Call("POST", "/api/show", _drop_none({"model": name, "verbose": verbose or None,
                                                     "fit_context": fit_context or None}))

    def pull(self, name: str, insecure: bool = False) -> Call:
        return Call("POST", "/api/pull", _drop_none({"model": name, "insecure": insecure or None, "stream": True}), stream=True)

    def create(self, name: str, modelfile: str, base_dir: str | None = None,
               files: dict[str, str] | None = None, quantize: str | None = None) -> Call:
        """files: {file name: digest} of blobs uploaded first (upload_blob), for a Modelfile with no FROM;
        quantize: the type the GGUF model is stored in (e.g. q4_K_M)."""
        body = _drop_none({"model": name, "modelfile": modelfile, "base_dir": base_dir, "files": files,
                           "quantize": quantize, "stream": True})
        return Call("POST", "/api/create", body, stream=True)

    def save_session(self, name: str, model: str, *, system: str | None = None, parameters: dict | None = None,
                     messages: list[dict] | None = None) -> Call:
        """A new model from `model` with a chat session's system message, parameters and messages (Ollama's
        REPL /save: /api/create with `from`)."""
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages or []
                if m.get("role") in ("system", "user", "assistant")]
        body = _drop_none({"model": name, "from": model, "system": system or None,
                           "parameters": {k: v for k, v in (parameters or {}).items() if v is not None} or None,
                           "messages": msgs or None, "stream": True})
        return Call("POST", "/api/create", body, stream=True)

    def copy(self, src: str, dst: str) -> Call:
        return Call("POST", "/api/copy", {"source": src, "destination": dst}, pick=lambda b: None)

    def delete(self, name: str) -> Call:
        return Call("DELETE", "/api/delete", {"model": name}, pick=lambda b: None)

    def chat(self, model: str, messages: list[dict], *, options: dict | None = None, stream: bool = True,
             keep_alive: str | int | float | None = None, format: str | dict | None = None,
             tools: list[dict] | None = None, think: bool | str | None = None) -> Call:
        body = _drop_none({"model": model, "messages": messages, "options": options or None, "stream": stream,
                           "keep_alive": keep_alive, "format": format, "tools": tools, "think": think})
        return Call("POST", "/api/chat", body, stream=True)

    def generate(self, model: str, prompt: str, *, system: str | None = None, options: dict | None = None,
                 stream: bool = True, keep_alive: str | int | float | None = None,
                 format: str | dict | None = None, raw: bool = False) -> Call:
        body = _drop_none({"model": model, "prompt": prompt, "system": system, "options": options or None,
                           "stream": stream, "keep_alive": keep_alive, "format": format, "raw": raw or None})
        return Call("POST", "/api/generate", body, stream=True)

    def embed(self, model: str, input: str | list[str], *, keep_alive: str | int | float | None = None,
              truncate: bool | None = None, dimensions: int | None = None) -> Call:
        """Ollama's /api/embed: one vector per input."""
        body = _drop_none({"model": model, "input": input, "keep_alive": keep_alive, "truncate": truncate,
                           "dimensions": dimensions})
        return Call("POST", "/api/embed", body, pick=lambda b: b.get("embeddings") or [])

    def stop(self, model: str) -> Call:
        """Unload a model now (Ollama's way: a generate with no prompt and keep_alive 0). The daemon
        resolves the name (aliases, case) and answers with it: {"model": NAME, "done_reason": "unload", ...};
        404 when no such model is in the library."""
        return Call("POST", "/api/generate", {"model": model, "keep_alive": 0, "stream": False},
                    pick=lambda b: b if isinstance(b, dict) else {})

    def resolve_name(self, model: str) -> Call:
        """The library name the daemon resolves `model` to ('smollm2' -> 'smollm2:135m' through its catalog
        alias, case folded, ...), without loading it: GET /v1/models/NAME's id. 404 when there is none."""
        return Call("GET", f"/v1/models/{quote(model, safe='/:@')}",
                    pick=lambda b: b.get("id") if isinstance(b, dict) and isinstance(b.get("id"), str) else model)


_ENDPOINTS = [n for n, v in vars(Requests).items() if callable(v) and not n.startswith("_")]


def bind_requests(sender: str):
    """Class decorator: each Requests method `m` becomes `self.<sender>(m(...))`."""

    def wrap(builder):
        @functools.wraps(builder)
        def method(self, *args, **kwargs):
            return getattr(self, sender)(builder(self, *args, **kwargs))

        # the builder returns a Call; the method returns what the sender makes of it
        method.__signature__ = inspect.signature(builder).replace(return_annotation=inspect.Signature.empty)
        return method

    def decorate(cls):
        for name in _ENDPOINTS:
            setattr(cls, name, wrap(getattr(Requests, name)))
        return cls

    return decorate
