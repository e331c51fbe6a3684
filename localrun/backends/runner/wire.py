"""What crosses the pipe between the daemon and a runner process: plain JSON-able dicts.

The pipe is one end of a Unix socket pair each (:class:`Channel`): every message is a 4-byte
little-endian length, then one JSON object. Daemon -> runner: ``{"op": ..., "id": ...}``
(generate, abort, delivered, tokenize, detokenize, embed, rerank, close). Runner -> daemon:
``{"t": ..., "id": ...}`` (ready, load_error, chunk, error, result, fatal, and info: the
BackendInfo again after a change, e.g. a fallback after loading). The codecs here turn
the Backend protocol's dataclasses into those dicts and back; errors travel as their class
name, status and message so the daemon re-raises the same typed error.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import select
import socket
import threading
from typing import Any

from localrun import errors
from localrun.backends.base import (BackendInfo, Chunk, GenerationRequest, Infill, LoadSpec, SamplingOptions,
                                    TokenLogprob, Usage)


MAX_MESSAGE = 256 * 2**20  # bytes; embeddings of many long inputs stay well under this


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def loads(data: bytes) -> dict:
    return json.loads(data)


def frame(obj: dict) -> bytes:
    """One message as it goes on the pipe: its length, then its JSON."""
    data = dumps(obj)
    return len(data).to_bytes(4, "little") + data


class Channel:
    """Length-prefixed JSON messages over a connected stream socket, on the running loop.

    ``send`` never blocks (asyncio's transport buffers); both ends read all the time, so the
    buffer stays small. ``recv`` raises EOFError when the peer is gone. A direct channel (the
    runner's end) writes to the socket itself instead, so another thread can :meth:`write` too."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fd: int | None = None) -> None:
        self.reader, self.writer = reader, writer
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []  # messages sent in this turn of the loop: written together
        # direct (a runner's end): every write goes straight to the socket under this lock, from the
        # event loop or from another thread (the llama.cpp loop's, between two steps), never through
        # asyncio's transport, whose buffer a write from outside its loop could overtake
        self._fd, self._direct = fd, fd is not None
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    async def connect(cls, sock: socket.socket, *, direct: bool = False) -> "Channel":
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        # a number of our own for the socket: it stays valid (no other file can take it) until close()
        fd = os.dup(writer.get_extra_info("socket").fileno()) if direct else None
        return cls(reader, writer, fd)

    def send(self, obj: dict, now: bool = False) -> None:
        """Queue one message. The messages sent in one turn of the event loop go out in one write
        (a step of the batched llama.cpp loop yields a chunk for every running request: one system
        call, not one each); `now`: this one (after any queued before it) goes out at once, not at
        the end of the turn. Dropped when the peer is gone (its EOF, or the process watcher, reports
        that)."""
        if now:
            self._out.append(frame(obj))
            self._flush()
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(frame(obj))

    def _flush(self) -> None:
        data, self._out = b"".join(self._out), []
        if not data:
            return
        if self._direct:
            self.write(data)
            return
        if self.writer.transport.is_closing():
            return
        try:  # asyncio drops writes to a closed transport itself; uvloop raises RuntimeError
            self.writer.write(data)
        except (RuntimeError, ConnectionError):
            pass

    def write(self, data: bytes) -> None:
        """Framed messages (:func:`frame`) to a direct channel's socket now, whole, from any thread.
        A full socket buffer (a daemon that is slow to read) is waited out; a peer that is gone
        drops the rest (its EOF, or the process watcher, reports that)."""
        with self._lock:
            view = memoryview(data)
            while view and not self._closed:  # (closed: _fd is None)
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:
                    poll = select.poll()
                    poll.register(self._fd, select.POLLOUT)
                    poll.poll(1000)
                except OSError:
                    self._closed = True

    async def recv(self) -> dict:
        try:
            n = int.from_bytes(await self.reader.readexactly(4), "little")
            if n > MAX_MESSAGE:
                raise EOFError(f"message of {n} bytes is over the {MAX_MESSAGE} byte limit")
            return loads(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise EOFError(str(exc)) from None

    async def drain(self) -> None:
        self._flush()
        await self.writer.drain()

    def close(self) -> None:
        self._flush()
        with self._lock:  # no thread writes once it is closed
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        self.writer.close()


# -- requests -------------------------------------------------------------------------------
def request_to_wire(r: GenerationRequest) -> dict:
    d = {"prompt": r.prompt, "options": dict(r.options.__dict__), "request_id": r.request_id,
         "add_special": r.add_special, "prompt_token_ids": r.prompt_token_ids,
         "group": list(r.group) if r.group is not None else None, "window": r.window}
    if r.preserve:
        d["preserve"] = list(r.preserve)
    if r.images:
        d["images"] = [base64.b64encode(b).decode("ascii") for b in r.images]
    if r.infill is not None:
        d["infill"] = dict(r.infill.__dict__)
    if r.return_prompt_ids:
        d["rp"] = True
    if r.cache_key:
        d["ck"] = r.cache_key
    return d


def request_from_wire(d: dict) -> GenerationRequest:
    options = SamplingOptions(**d["options"])
    if options.logit_bias:  # JSON object keys are strings
        options.logit_bias = {int(k): float(v) for k, v in options.logit_bias.items()}
    return GenerationRequest(prompt=d["prompt"], options=options, request_id=d["request_id"],
                             add_special=d["add_special"], prompt_token_ids=d["prompt_token_ids"],
                             group=tuple(d["group"]) if d.get("group") else None, window=d.get("window"),
                             images=[base64.b64decode(b) for b in d["images"]] if d.get("images") else None,
                             infill=Infill(**d["infill"]) if d.get("infill") else None,
                             return_prompt_ids=bool(d.get("rp")),
                             preserve=list(d["preserve"]) if d.get("preserve") else None,
                             cache_key=d.get("ck") if isinstance(d.get("ck"), str) else None)


# -- chunks ---------------------------------------------------------------------------------
def chunk_to_wire(c: Chunk) -> dict:
    d: dict[str, Any] = {"x": c.text, "i": c.token_ids}
    if c.logprobs:
        d["lp"] = _lps_to_wire(c.logprobs)
    if c.finish_reason is not None:
        d["f"] = c.finish_reason
    if c.usage is not None:
        d["u"] = dict(c.usage.__dict__)
    if c.stop_sequence is not None:
        d["s"] = c.stop_sequence
    if c.prompt_tokens is not None:
        d["p"] = c.prompt_tokens
    if c.prompt_token_ids is not None:
        d["pi"] = c.prompt_token_ids
    if c.cached_tokens is not None:
        d["ct"] = c.cached_tokens
    if c.cut_chars:
        d["cc"] = c.cut_chars
    if c.prompt_logprobs is not None:
        d["pl"] = _lps_to_wire(c.prompt_logprobs)
    return d


def _lps_to_wire(lps: list[TokenLogprob]) -> list:
    """[token, logprob, top], and where bytes are not whole UTF-8 or the alternatives' ids are known:
    [raw hex, [each top's raw hex], [top ids]] after them."""
    return [[lp.token, lp.logprob, lp.top] if lp.raw is None and lp.top_raw is None and lp.top_ids is None else
            [lp.token, lp.logprob, lp.top, lp.raw.hex() if lp.raw is not None else None,
             [r.hex() if r is not None else None for r in lp.top_raw] if lp.top_raw is not None else None,
             lp.top_ids]
            for lp in lps]


def _lps_from_wire(items: list) -> list[TokenLogprob]:
    out = []
    for t, lp, top, *raw in items:
        x = TokenLogprob(t, lp, [(a, b) for a, b in top])
        if raw:
            x.raw = bytes.fromhex(raw[0]) if raw[0] is not None else None
            x.top_raw = [bytes.fromhex(r) if r is not None else None for r in raw[1]] if raw[1] is not None else None
            x.top_ids = raw[2] if len(raw) > 2 else None
        out.append(x)
    return out


def chunk_from_wire(d: dict) -> Chunk:
    return Chunk(text=d["x"], token_ids=d["i"], logprobs=_lps_from_wire(d["lp"]) if "lp" in d else None,
                 finish_reason=d.get("f"), usage=Usage(**d["u"]) if "u" in d else None, stop_sequence=d.get("s"),
                 prompt_tokens=d.get("p"), prompt_token_ids=d.get("pi"), cached_tokens=d.get("ct"),
                 cut_chars=int(d.get("cc") or 0),
                 prompt_logprobs=_lps_from_wire(d["pl"]) if "pl" in d else None)


# -- load spec and info -----------------------------------------------------------------------
# What a runner's backend reads of the daemon's parsed GGUF header (library.GGUFInfo): the pooling keys of an
# embedding model or reranker, the head sizes that decide a quantized KV cache's type, the sizes of a memory
# estimate. It travels with the load order, so a runner neither reads the header again nor imports gguf-py for it.
# Measured on a 2-core box: the tiny test embedder's load through the daemon 487 -> 394 ms (medians of 12); a
# 262k-token vocabulary's header (Gemma 3) alone takes 130-200 ms to read.
GGUF_INFO_FIELDS = ("architecture", "tensor_bytes", "block_count", "embedding_length", "head_count", "head_count_kv",
                    "vocab_size", "context_length")
# longer metadata strings (chat templates, licences) stay behind, as do long arrays (the vocabulary); a short one
# (a classifier's output labels) travels
MAX_META_STR = 256
MAX_META_LIST = 64


def _small(v: Any) -> bool:
    if isinstance(v, str):
        return len(v) <= MAX_META_STR
    if isinstance(v, (list, tuple)):
        return len(v) <= MAX_META_LIST and all(_small(x) and not isinstance(x, (list, tuple)) for x in v)
    return isinstance(v, (int, float, bool))


def _gguf_info_to_wire(info: Any) -> dict:
    meta = getattr(info, "metadata", None) or {}
    return {**{k: getattr(info, k, None) for k in GGUF_INFO_FIELDS},
            "metadata": {k: list(v) if isinstance(v, tuple) else v for k, v in meta.items() if _small(v)}}


def spec_to_wire(s: LoadSpec) -> dict:
    """Only JSON-able extras travel, and the daemon's parsed GGUF header as the fields a backend reads of it."""
    extra = {k: v for k, v in s.extra.items() if isinstance(v, (str, int, float, bool, type(None)))}
    d = {"name": s.name, "weights": str(s.weights), "format": s.format, "num_ctx": s.num_ctx,
         "num_parallel": s.num_parallel, "embedding": s.embedding, "extra": extra}
    if s.extra.get("gguf_info") is not None:
        d["gguf_info"] = _gguf_info_to_wire(s.extra["gguf_info"])
    return d


def spec_from_wire(d: dict) -> LoadSpec:
    from pathlib import Path
    from types import SimpleNamespace

    extra = dict(d["extra"])
    if isinstance(d.get("gguf_info"), dict):
        extra["gguf_info"] = SimpleNamespace(**{k: d["gguf_info"].get(k) for k in GGUF_INFO_FIELDS},
                                             metadata=dict(d["gguf_info"].get("metadata") or {}))
    return LoadSpec(name=d["name"], weights=Path(d["weights"]), format=d["format"], num_ctx=d["num_ctx"],
                    num_parallel=d["num_parallel"], embedding=d["embedding"], extra=extra)


def info_to_wire(i: BackendInfo) -> dict:
    return dict(i.__dict__)


_INFO_FIELDS = {f.name for f in dataclasses.fields(BackendInfo)}


def info_from_wire(d: dict) -> BackendInfo:
    """Fields this daemon does not know (a newer runner's) are left out."""
    return BackendInfo(**{k: v for k, v in d.items() if k in _INFO_FIELDS})


# -- errors ---------------------------------------------------------------------------------
_ERRORS = {cls.__name__: cls for cls in (errors.LocalrunError, errors.InvalidRequest, errors.NotFound,
                                         errors.Conflict, errors.InsufficientMemory, errors.BackendError)}


def error_to_wire(exc: BaseException) -> dict:
    if isinstance(exc, errors.LocalrunError) and type(exc).__name__ in _ERRORS:
        return {"type": type(exc).__name__, "message": exc.message, "status": exc.status, "code": exc.code}
    return {"type": "BackendError", "message": f"{type(exc).__name__}: {exc}", "status": 500, "code": "backend_error"}


def error_from_wire(d: dict) -> errors.LocalrunError:
    cls = _ERRORS.get(d.get("type", ""), errors.BackendError)
    return cls(d.get("message", "backend error"), status=d.get("status"), code=d.get("code"))
