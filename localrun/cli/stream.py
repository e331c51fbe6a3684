"""Streaming a chat answer to the terminal, shared by `run PROMPT` and the REPL.

The settings of a run (options, format, thinking), the thinking shown as Ollama shows it,
word wrapping at the terminal's width, and the --verbose stats block.
"""

from __future__ import annotations

import os
import sys
import time

from localrun.client import DaemonClient


class RunSettings:
    def __init__(self, options: dict | None = None, keep_alive=None, format=None, verbose=False, system=None,
                 wordwrap=True, think: bool | str | None = None, hide_thinking: bool = False):
        self.options = dict(options or {})
        self.keep_alive = keep_alive
        self.format = format
        self.verbose = verbose
        self.system = system
        self.wordwrap = wordwrap
        self.think = think  # None: as the model's template does; False / True / low|medium|high (Ollama's)
        self.hide_thinking = hide_thinking


class ThinkingShown:
    """A thinking model's reasoning on the terminal as Ollama shows it: 'Thinking...', the thoughts
    (dim on a terminal), '...done thinking.', then the answer."""

    def __init__(self, out) -> None:
        self.out, self.open = out, False
        self.dim = sys.stdout.isatty() and not os.environ.get("NO_COLOR")

    def write(self, piece: str) -> None:
        if not self.open:
            self.open = True
            self.out.write("Thinking...\n")
            if self.dim:
                sys.stdout.write("\x1b[2m")
        self.out.write(piece)
        self.out.flush()

    def close(self) -> None:
        if self.open:
            self.open = False
            self.out.flush()
            if self.dim:
                sys.stdout.write("\x1b[0m")
            self.out.write("\n...done thinking.\n\n")
            self.out.flush()


class WordWrapper:
    """Streams text to a terminal, breaking lines between words at the terminal's width
    (a word is held back until the whitespace after it arrives)."""

    def __init__(self, out, width: int):
        self.out, self.width, self.col, self.word = out, max(width, 20), 0, ""

    def write(self, text: str) -> None:
        for ch in text:
            if ch in " \n":
                self._flush_word()
                if ch == "\n":
                    self.out.write("\n")
                    self.col = 0
                elif self.col < self.width:
                    self.out.write(" ")
                    self.col += 1
            else:
                self.word += ch
        self.out.flush()

    def _flush_word(self) -> None:
        if self.word:
            if self.col and self.col + len(self.word) > self.width:
                self.out.write("\n")
                self.col = 0
            self.out.write(self.word)
            self.col += len(self.word)
            self.word = ""

    def flush(self) -> None:
        self._flush_word()
        self.out.flush()


def _writer(rs: RunSettings):
    if rs.wordwrap and not rs.format and sys.stdout.isatty():
        import shutil

        return WordWrapper(sys.stdout, shutil.get_terminal_size().columns - 1)
    return sys.stdout


def _spinner():
    """A transient spinner on stderr while waiting for the first token (terminals only)."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console

    status = Console(stderr=True).status("", spinner="dots")
    status.start()
    return status


def stream_chat(client: DaemonClient, model: str, messages: list[dict], rs: RunSettings) -> str:
    """Stream one answer to stdout; return its text. Ctrl+C closes the stream (the
    daemon aborts the request) and propagates."""
    msgs = ([{"role": "system", "content": rs.system}] if rs.system else []) + messages
    start = time.perf_counter()
    ttft = None
    final: dict = {}
    parts: list[str] = []
    out = _writer(rs)
    spinner = None
    thinking = ThinkingShown(out)
    stream = client.chat(model, msgs, options=rs.options, keep_alive=rs.keep_alive, format=rs.format,
                         think=rs.think)
    try:
        spinner = _spinner()  # loading a big model can take a while: show that something happens
        for chunk in stream:
            if spinner is not None:
                spinner.stop()
                spinner = None
            message = chunk.get("message") or {}
            thought = message.get("thinking") or chunk.get("thinking") or ""
            if thought:
                if ttft is None:
                    ttft = time.perf_counter() - start
                if not rs.hide_thinking:
                    thinking.write(thought)
            piece = message.get("content") or chunk.get("response") or ""
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - start
                thinking.close()
                parts.append(piece)
                out.write(piece)
                out.flush()
            if chunk.get("done"):
                final = chunk
    finally:  # close the stream first: that is what makes the daemon abort the request
        try:
            stream.close()
        finally:
            if spinner is not None:
                spinner.stop()
            thinking.close()
            out.flush()
    text = "".join(parts)
    sys.stdout.write("\n" if not text.endswith("\n") else "")
    sys.stdout.flush()
    if rs.verbose:
        print(format_stats(final, ttft), file=sys.stderr)
    return text


def _dur(ns) -> str:
    if not ns:
        return "0s"
    s = ns / 1e9
    return f"{s * 1000:.3f}ms" if s < 1 else f"{s:.3f}s"


def _rate(count, ns) -> str:
    return f"{count / (ns / 1e9):.2f} tokens/s" if count and ns else "-"


def format_stats(final: dict, ttft: float | None) -> str:
    """Ollama's --verbose block (from the final chunk's stats), plus the time to the
    first token as this client saw it and the prompt tokens served from the cache."""
    pc, pd = final.get("prompt_eval_count"), final.get("prompt_eval_duration")
    ec, ed = final.get("eval_count"), final.get("eval_duration")
    cached = final.get("cached_tokens")
    rows = [
        ("total duration", _dur(final.get("total_duration"))),
        ("load duration", _dur(final.get("load_duration"))),
        ("time to first token", _dur(ttft * 1e9) if ttft is not None else "-"),
        ("prompt eval count", f"{pc if pc is not None else '-'} token(s)"),
        ("cached prompt tokens", f"{cached if cached is not None else '-'} token(s)"),
        ("prompt eval duration", _dur(pd)),
        ("prompt eval rate", _rate(pc, pd)),
        ("eval count", f"{ec if ec is not None else '-'} token(s)"),
        ("eval duration", _dur(ed)),
        ("eval rate", _rate(ec, ed)),
    ]
    return "\n".join(f"{k + ':':<22}{v}" for k, v in rows)
