"""`localrun`: the command line, a thin HTTP client of the daemon (see localrun.client).

Every verb except `serve` and `bench` talks to the daemon and starts it in the
background when none answers.  Errors end as one line on stderr and a non-zero exit
code, never a traceback; Ctrl+C stops a stream cleanly (exit 130).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

from localrun import __version__
from localrun.attachments import Attachment, AttachmentError, read_images, split_image_paths
from localrun.client import APIError, DaemonClient, DaemonUnavailable, base_url_for
from localrun.client import parse_think as client_parse_think
from localrun.config import ENV_VARS, parse_duration, parse_hostport, settings
from localrun.errors import LocalrunError

PROG = "localrun"


class CLIError(Exception):
    """A user mistake found by the CLI itself (missing file, bad value)."""


class UnknownOption(CLIError):
    """A generation option name that is no Modelfile PARAMETER (a typo like num_predcit): the daemon would
    ignore it, so the CLI refuses it (a usage error for `run -o`, a message in the REPL)."""


# --------------------------------------------------------------------------------------
# Small formatting helpers
# --------------------------------------------------------------------------------------


def human_size(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit != "GB" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: int | float | None) -> str:
    """134515008 -> '134.52M' (as `ollama show` prints parameter counts)."""
    if not n:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def parse_time(value) -> datetime | None:
    if not value or not isinstance(value, str):
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", value.strip()).replace("Z", "+00:00")
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _span(seconds: float) -> str:
    for size, unit in ((86400 * 365, "year"), (86400 * 30, "month"), (86400 * 7, "week"), (86400, "day"),
                       (3600, "hour"), (60, "minute"), (1, "second")):
        if seconds >= size:
            k = int(seconds // size)
            return f"{k} {unit}{'s' if k != 1 else ''}"
    return "0 seconds"


def human_ago(value) -> str:
    t = parse_time(value)
    if t is None:
        return "-"
    secs = (datetime.now(timezone.utc) - t).total_seconds()
    return "just now" if secs < 1 else f"{_span(secs)} ago"


def human_until(value) -> str:
    t = parse_time(value)
    if t is None:
        return "Forever"
    secs = (t - datetime.now(timezone.utc)).total_seconds()
    if secs > 86400 * 365 * 5:  # the daemon reports 'forever' as a far-future time
        return "Forever"
    return "Stopping..." if secs < 1 else f"{_span(secs)} from now"


def short_id(digest: str | None) -> str:
    d = (digest or "").split(":", 1)[-1]
    return d[:12] or "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return "\n".join("    ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows])


def parse_value(text: str):
    """'0.2' -> 0.2, '42' -> 42, 'true' -> True, else the string."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    if len(t) >= 2 and t[0] == t[-1] == '"':
        return t[1:-1]
    return t


def check_option_name(name: str) -> str:
    """`name` when it is a Modelfile PARAMETER (Ollama's option names); UnknownOption naming the closest
    known ones otherwise (the daemon passes over an option it does not know, so a typo would go unseen)."""
    import difflib

    from localrun.library.modelfile import PARAMETERS

    if name in PARAMETERS:
        return name
    close = difflib.get_close_matches(name.lower(), list(PARAMETERS), n=3, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]}" + (f" (or {', '.join(close[1:])})" if close[1:] else "") + "?"
    else:
        hint = "known options: " + ", ".join(sorted(PARAMETERS))
    raise UnknownOption(f"unknown option {name!r}; {hint}")


def set_option(options: dict, name: str, value: str) -> None:
    """Ollama option names; `stop` accumulates like repeated PARAMETER stop lines."""
    name = name.strip()
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            check_option_name(name)  # e.g. Temperature: say which name is meant
        raise CLIError(f"bad parameter name {name!r}: use an Ollama option name like temperature or num_ctx")
    check_option_name(name)
    if name == "stop":
        options.setdefault("stop", []).append(str(parse_value(value)))
    else:
        options[name] = parse_value(value)


def _err(msg: str) -> None:
    print(f"Error: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------
# Progress (pull, create)
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Chat streaming, shared by `run PROMPT` and the REPL
# --------------------------------------------------------------------------------------


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


def parse_think(value: str, what: str = "--think") -> bool | str:
    try:
        return client_parse_think(value)
    except ValueError as exc:
        raise CLIError(f"{what} {exc}") from None


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


# --------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------


def render_show(info: dict, verbose: bool = False) -> str:
    mi = info.get("model_info") or {}
    details = info.get("details") or {}
    arch = mi.get("general.architecture") or details.get("family") or "-"

    def arch_key(name):
        return mi.get(f"{arch}.{name}")

    params = mi.get("general.parameter_count")
    model_rows = [
        ("architecture", arch),
        ("parameters", human_count(params) if params else details.get("parameter_size") or "-"),
        ("context length", arch_key("context_length") or "-"),
        ("embedding length", arch_key("embedding_length") or "-"),
        ("quantization", details.get("quantization_level") or "-"),
        ("format", details.get("format") or "-"),
    ]
    out = ["  Model"] + [f"    {k:<20}{v}" for k, v in model_rows]
    if info.get("damaged"):  # the store's copy cannot be used: say so before anything else
        out = ["  Damaged", f"    {info['damaged']}", ""] + out

    def section(title: str, body: str | None, limit: int | None = None):
        if not body or not str(body).strip():
            return
        lines = str(body).strip().splitlines()
        if limit and len(lines) > limit:
            lines = lines[:limit] + ["..."]
        out.extend(["", f"  {title}"] + [f"    {ln}" for ln in lines])

    if info.get("capabilities"):
        caps = [c + (" (generic format: the template renders none)" if c == "tools"
                     and info.get("tool_format") == "generic" else "") for c in info["capabilities"]]
        section("Capabilities", "\n".join(caps))
    section("Parameters", info.get("parameters"))
    section("System", info.get("system"), limit=None if verbose else 4)
    section("License", info.get("license"), limit=None if verbose else 2)
    weights = [f"path      {info['weights_path']}"] if info.get("weights_path") else []
    if info.get("projector_path"):
        weights.append(f"projector {info['projector_path']}")
    if info.get("digest"):
        weights.append(f"digest    {info['digest']}")
    section("Weights", "\n".join(weights))
    if verbose:
        section("Metadata", "\n".join(f"{k:<40}{v}" for k, v in sorted(mi.items())))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------
# The REPL (`run MODEL` without a prompt when the TUI is unavailable, or --plain)
# --------------------------------------------------------------------------------------

REPL_HELP = """Available commands:
  /set parameter NAME VALUE   set a generation option (temperature, num_ctx, stop, ...)
  /set system TEXT            set the system message
  /set format json | /set noformat
  /set think | /set nothink   ask a thinking model to think, or not (/set think high: an effort level)
  /set hidethinking | /set showthinking
  /set verbose | /set quiet   show or hide timing stats after each answer
  /show [info|modelfile|parameters|system|template|license]
  /clear                      forget the conversation
  /save MODEL                 save this session (model, system message, parameters, conversation) as a new model
  /load MODEL                 switch to another model
  /bye                        exit
  /?, /help                   this help

Use \"\"\" to begin and end a multi-line message."""


class Repl:
    def __init__(self, client: DaemonClient, model: str, rs: RunSettings, interactive: bool):
        self.client = client
        self.model = model
        self.rs = rs
        self.interactive = interactive
        self.messages: list[dict] = []

    def _input(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def read_message(self) -> str:
        line = self._input(">>> ")
        if not line.lstrip().startswith('"""'):
            return line
        text = line.lstrip()[3:]
        if text.endswith('"""'):
            return text[:-3]
        lines = [text] if text else []
        while True:
            more = self._input("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines)
            lines.append(more)

    def run(self) -> int:
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            print('>>> Send a message (/? for help, /bye to exit)')
        while True:
            try:
                text = self.read_message()
            except EOFError:
                if self.interactive:
                    print()
                return 0
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                continue
            if not text.strip():
                continue
            stripped, paths = split_image_paths(text)
            starts_with_path = bool(paths) and text.strip().split()[0].strip("'\"").startswith(paths[0].split()[0])
            if text.strip().startswith("/") and not text.startswith('"""') and not starts_with_path:
                if self.command(text.strip()) == "bye":
                    return 0
                continue
            msg: dict = {"role": "user", "content": text}
            if paths:  # image files named in the message go with it as images (as `ollama run` does)
                try:
                    msg = {"role": "user", "content": stripped, "images": [a.b64 for a in read_images(paths)]}
                except AttachmentError as exc:
                    _err(str(exc))
                    continue
                print(f"Added image{'s' if len(paths) > 1 else ''} {', '.join(paths)}", file=sys.stderr)
            self.messages.append(msg)
            try:
                answer = stream_chat(self.client, self.model, self.messages, self.rs)
            except KeyboardInterrupt:
                print()
                self.messages.pop()
                continue
            except APIError as exc:
                _err(exc.message)
                self.messages.pop()
                continue
            self.messages.append({"role": "assistant", "content": answer})

    def command(self, line: str) -> str | None:
        words = line.split()
        cmd, args = words[0].lower(), words[1:]
        try:
            if cmd in ("/bye", "/exit", "/quit"):
                return "bye"
            if cmd in ("/?", "/help"):
                print(REPL_HELP)
            elif cmd == "/clear":
                self.messages.clear()
                print("Cleared session context")
            elif cmd == "/save":
                if len(args) != 1:
                    print("Usage:\n  /save <modelname>")
                else:
                    self.save(args[0])
            elif cmd == "/load" and len(args) == 1:
                ensure_model(self.client, args[0])
                self.model = args[0]
                self.messages.clear()
                print(f"Loading model '{self.model}'")
            elif cmd == "/set" and args:
                self.set(args, line)
            elif cmd == "/show":
                self.show(args[0] if args else "info")
            else:
                print(f"Unknown command '{line}'. Type /? for help")
        except (CLIError, APIError) as exc:
            _err(str(exc))
        return None

    def save(self, name: str) -> None:
        """Ollama's /save: a new model FROM this one with the session's system message and parameters,
        and the conversation as its MESSAGE history (/load NAME, or `run NAME`, goes on from it).
        Images are left out: a MESSAGE holds text."""
        for _ in self.client.save_session(name, self.model, system=self.rs.system, parameters=self.rs.options,
                                          messages=self.messages):
            pass
        print(f"Created new model '{name}'")

    def set(self, args: list[str], line: str) -> None:
        what = args[0].lower()
        if what == "parameter":
            if len(args) < 3:
                raise CLIError("usage: /set parameter NAME VALUE")
            set_option(self.rs.options, args[1], line.split(None, 3)[3])
            print(f"Set parameter '{args[1]}' to '{line.split(None, 3)[3]}'")
        elif what == "system":
            text = line.split(None, 2)[2] if len(args) > 1 else ""
            self.rs.system = text.strip().strip('"') or None
            print("Set system message.")
        elif what == "format" and len(args) == 2:
            self.rs.format = args[1]
            print(f"Set format to '{args[1]}' mode.")
        elif what == "noformat":
            self.rs.format = None
            print("Disabled format.")
        elif what in ("verbose", "quiet"):
            self.rs.verbose = what == "verbose"
            print(f"Set '{what}' mode.")
        elif what == "think":
            self.rs.think = parse_think(args[1], "/set think") if len(args) > 1 else True
            print("Set 'think' mode." if self.rs.think is True else f"Set 'think' mode to '{self.rs.think}'.")
        elif what == "nothink":
            self.rs.think = False
            print("Set 'nothink' mode.")
        elif what in ("hidethinking", "showthinking"):
            self.rs.hide_thinking = what == "hidethinking"
            print(f"Set '{what}' mode.")
        else:
            raise CLIError(f"unknown /set {what!r}; type /? for help")

    def show(self, what: str) -> None:
        info = self.client.show(self.model)
        if what == "info":
            print(render_show(info), end="")
            if self.rs.options:
                print("  Session parameters\n" + "\n".join(f"    {k:<20}{v}" for k, v in self.rs.options.items()))
            if self.rs.system:
                print(f"  Session system message\n    {self.rs.system}")
        elif what in ("modelfile", "parameters", "system", "template", "license"):
            print(info.get(what) or f"No {what} was specified for this model.")
        else:
            raise CLIError(f"unknown /show {what!r}: info, modelfile, parameters, system, template or license")


# --------------------------------------------------------------------------------------
# Verbs
# --------------------------------------------------------------------------------------


def ensure_model(client: DaemonClient, model: str) -> dict:
    """Pull the model first when the library lacks it, as `ollama run` does; its /api/show answer."""
    try:
        return client.show(model)
    except APIError as exc:
        if exc.status != 404:
            raise
        show_progress(client.pull(model))
    return client.show(model)


def _run_pooled(client: DaemonClient, args, kind: str, prompt: str) -> int:
    """`run` on an embedding model prints the prompt's embedding as a JSON array, as `ollama run` does; a
    reranker cannot be run."""
    if kind == "rerank":
        raise CLIError(f"{args.model} is a reranker: it scores documents against a query through POST /v1/rerank, "
                       "and cannot chat or embed")
    if not prompt.strip():
        raise CLIError(f'embedding models require input text. Usage: localrun run {args.model} "your text here"')
    truncate = None if args.truncate is None else parse_bool_flag(args.truncate, "--truncate")
    vectors = client.embed(args.model, prompt, keep_alive=args.keepalive, truncate=truncate,
                           dimensions=args.dimensions)
    if not vectors:
        raise CLIError("no embeddings returned")
    print(json.dumps(vectors[0], separators=(",", ":")))
    return 0


def parse_bool_flag(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise CLIError(f"{what} takes true or false, not {value!r}")


def _open_tui(model: str | None, base_url: str, rs: RunSettings | None = None) -> int | None:
    """Run the chat TUI; None when it cannot open here (not installed, or not a terminal)."""
    import importlib.util

    if not (sys.stdin.isatty() and sys.stdout.isatty()) or importlib.util.find_spec("textual") is None:
        return None
    try:
        from localrun.tui import run_chat
    except ImportError:
        return None
    return run_chat(model, base_url=base_url, options=rs.options if rs else None, think=rs.think if rs else None)


def parse_format(value: str | None) -> str | dict | None:
    """--format: 'json', an inline JSON schema, or the path of a JSON schema file."""
    if value is None or value == "json":
        return value
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise CLIError(f"--format wants 'json', a JSON schema or a schema file; {value!r} is none of these")
        text = path.read_text(encoding="utf-8")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise CLIError(f"--format: the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise CLIError("--format: a JSON schema must be an object")
    return schema


def run_images(args, prompt: str) -> tuple[str, list[Attachment]]:
    """The --image files and the image paths written inside the prompt (which leave it), read and
    checked before anything is sent; a missing, unreadable, too large or non-image file is a CLIError."""
    prompt, in_prompt = split_image_paths(prompt)
    try:
        return prompt, read_images([*(args.image or []), *in_prompt])
    except AttachmentError as e:
        raise CLIError(str(e)) from None


def run_options(items: list[str] | None) -> dict:
    """`run -o NAME=VALUE ...` -> the request's options (UnknownOption for a name that is no option)."""
    options: dict = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise CLIError(f"--option wants NAME=VALUE, got {item!r}")
        set_option(options, name, value)
    return options


def cmd_run(args, client: DaemonClient) -> int:
    if getattr(args, "attachments", None) is None:
        args.prompt_text, args.attachments = run_images(args, " ".join(args.prompt))
    prompt, images = args.prompt_text, args.attachments
    piped = not sys.stdin.isatty()
    if piped and not args.plain:
        text = sys.stdin.read()
        prompt = f"{prompt}\n\n{text}" if prompt and text.strip() else (prompt or text)
    options = getattr(args, "options", None)
    if options is None:
        options = run_options(args.option)
    rs = RunSettings(options, keep_alive=args.keepalive, format=parse_format(args.format), verbose=args.verbose,
                     wordwrap=not args.nowordwrap, think=None if args.think is None else parse_think(args.think),
                     hide_thinking=args.hidethinking)
    caps = ensure_model(client, args.model).get("capabilities") or []
    if "embedding" in caps or "rerank" in caps:
        return _run_pooled(client, args, "rerank" if "rerank" in caps else "embedding", prompt)
    if prompt.strip() or images:
        msg: dict = {"role": "user", "content": prompt}
        if images:
            msg["images"] = [a.b64 for a in images]
        stream_chat(client, args.model, [msg], rs)
        return 0
    if piped and not args.plain:  # empty stdin: just load the model, as `ollama run M </dev/null` does
        for _ in client.generate(args.model, "", keep_alive=args.keepalive):
            pass
        return 0
    if not args.plain:
        code = _open_tui(args.model, client.base_url, rs)
        if code is not None:
            return code
    return Repl(client, args.model, rs, interactive=not piped).run()


def cmd_chat(args, client: DaemonClient) -> int:
    if args.model:
        ensure_model(client, args.model)
    code = _open_tui(args.model, client.base_url)
    if code is not None:
        return code
    if not args.model:
        raise CLIError("the chat TUI needs a terminal and the textual package; "
                       "use `localrun run MODEL --plain` for a line-by-line chat")
    return Repl(client, args.model, RunSettings(), interactive=sys.stdin.isatty()).run()


def cmd_pull(args, client: DaemonClient) -> int:
    last = show_progress(client.pull(args.model))
    return 0 if last and last.get("status") == "success" else 1


def list_capabilities(m: dict) -> str:
    """What `list` shows of a model's capabilities: all but plain completion (vision, tools, ...)."""
    caps = [str(c) for c in m.get("capabilities") or [] if c != "completion"]
    return ", ".join(caps) or "-"


def cmd_list(args, client: DaemonClient) -> int:
    rows = [[m.get("name") or m.get("model", "?"), short_id(m.get("digest")), human_size(m.get("size")),
             human_ago(m.get("modified_at")), list_capabilities(m)] for m in client.tags()]
    print(table(["NAME", "ID", "SIZE", "MODIFIED", "CAPABILITIES"], rows))
    return 0


def processor(m: dict) -> str:
    if m.get("processor"):
        return str(m["processor"])
    size, vram = m.get("size") or 0, m.get("size_vram") or 0
    if not size or vram <= 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    gpu = round(100 * vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def backend_name(m: dict) -> str:
    b = m.get("backend")
    if isinstance(b, dict):
        return str(b.get("name") or b.get("backend") or "-")
    return str(b or "-")


def cmd_ps(args, client: DaemonClient) -> int:
    models = client.ps()
    rows = [[m.get("name") or m.get("model", "?"), short_id(m.get("digest")), human_size(m.get("size")),
             processor(m), m.get("placement") or m.get("device") or "-", backend_name(m),
             str(m.get("context_length") or "-"), str(m.get("slots") or "-"),
             human_until(m.get("expires_at"))] for m in models]
    print(table(["NAME", "ID", "SIZE", "PROCESSOR", "WHERE", "BACKEND", "CONTEXT", "PARALLEL", "UNTIL"], rows))
    if args.verbose:
        for m in models:
            runner = m.get("runner") or {}
            proc = (f"\n  runner process {runner['pid']}: {human_size(runner.get('rss_bytes'))} resident"
                    + (f", {human_size(runner['vram_bytes'])} VRAM" if runner.get("vram_bytes") else "")
                    if runner.get("pid") else "")
            kv = f" ({m['kv_cache_type']} KV cache)" if m.get("kv_cache_type") else ""
            print(f"\n{m.get('name') or m.get('model', '?')}: context {m.get('context_length', '-')} tokens{kv}, "
                  f"{m.get('slots', '-')} slot(s), {m.get('active', 0)} active, {m.get('waiting', 0)} waiting"
                  + proc + (f"\n  {m['reason']}" if m.get("reason") else "")
                  + "".join(f"\n  fallback: {f}" for f in m.get("fallbacks") or ()))
    return 0


def cmd_show(args, client: DaemonClient) -> int:
    info = client.show(args.model, verbose=args.verbose)
    for field in ("modelfile", "parameters", "system", "template", "license"):
        if getattr(args, field):
            text = info.get(field) or ""
            print(text, end="" if text.endswith("\n") or not text else "\n")
            return 0
    print(render_show(info, verbose=args.verbose), end="")
    return 0


def cmd_stop(args, client: DaemonClient) -> int:
    """As `ollama stop`: a generate with keep_alive 0, so the daemon resolves the name as every other verb's
    (aliases such as smollm2 -> smollm2:135m, case) and answers with the one it unloaded."""
    running = {m.get("name") or m.get("model") for m in client.ps()}
    try:
        answer = client.stop(args.model)
    except APIError as exc:
        if exc.status == 404:
            raise CLIError(f"couldn't find model '{args.model}' to stop (see `localrun list`)") from None
        raise
    name = answer.get("model") or args.model
    if name not in running:  # the daemon's answer is "unload" either way
        raise CLIError(f"model '{args.model}' is not running (see `localrun ps`)")
    if answer.get("done_reason") not in (None, "unload"):
        raise CLIError(f"the daemon did not unload {name} (it answered {answer.get('done_reason')!r})")
    return 0


def cmd_rm(args, client: DaemonClient) -> int:
    failed = 0
    for name in args.models:
        try:
            client.delete(name)
            print(f"deleted '{name}'")
        except APIError as exc:
            _err(exc.message)
            failed += 1
    return 1 if failed else 0


def cmd_cp(args, client: DaemonClient) -> int:
    client.copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_create(args, client: DaemonClient) -> int:
    path = Path(args.file).expanduser()
    if not path.is_file():
        raise CLIError(f"no Modelfile at {path}: pass one with -f PATH")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {path}: {exc}") from None
    base = path.resolve().parent
    if client.sees_my_files():  # the daemon reads the files FROM names itself (one copy, no upload)
        last = show_progress(client.create(args.name, text, base_dir=str(base), quantize=args.quantize))
    else:
        last = _create_remote(args.name, text, base, client, args.quantize)
    return 0 if last and last.get("status") == "success" else 1


def _create_remote(name: str, text: str, base: Path, client: DaemonClient, quantize: str | None = None) -> dict | None:
    """A daemon on another machine (or in a container) cannot read this one's files: as `ollama create` does, the files
    FROM names are uploaded (POST /api/blobs/<sha256>, skipped when the daemon has them) and the
    create names them in `files`; a FROM that names a model goes as it is."""
    from localrun.errors import InvalidRequest
    from localrun.library.modelfile import local_source, parse_modelfile, render_modelfile

    try:
        mf = parse_modelfile(text)
        sources = [local_source(mf.from_ or "", base)] + ([local_source(mf.projector, base)] if mf.projector else [])
    except InvalidRequest as exc:
        raise CLIError(str(exc)) from None
    if sources[0] is None:
        if any(sources[1:]):
            raise CLIError(f"the daemon at {client.base_url} does not see this machine's files: a projector file can only go "
                           "with the model as a file too (FROM ./model.gguf, then FROM ./mmproj.gguf)")
        return show_progress(client.create(name, text, quantize=quantize))
    files: dict[str, Path] = {}
    for src in sources:
        files.update(_files_to_upload(src))
    digests = {fn: _upload(client, fn, p) for fn, p in files.items()}
    rest = render_modelfile(None, mf.parameters, mf.template, mf.system, mf.messages, mf.license, mf.adapter)
    return show_progress(client.create(name, rest, files=digests, quantize=quantize))


def _files_to_upload(src: Path) -> dict[str, Path]:
    """{name: path}: a GGUF file, or the files localrun keeps of a safetensors model directory."""
    from localrun.errors import InvalidRequest
    from localrun.library.create import safetensors_dir_files

    shown = str(src)
    try:
        if src.is_dir():
            return safetensors_dir_files(src, shown)
    except InvalidRequest as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot read {shown}: {exc.strerror or exc}") from None
    if not src.is_file():
        raise CLIError(f"FROM {shown}: no such file")
    return {src.name: src}


def _upload(client: DaemonClient, fn: str, path: Path) -> str:
    """sha256 of the file (a progress bar), then the upload unless the daemon has it (another bar)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from localrun.library.blobs import sha256_file

    try:
        size = path.stat().st_size
        bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True, highlight=False))
        with bars:
            task = bars.add_task(f"hashing {fn}", total=size)
            digest, _ = sha256_file(path, progress=lambda n: bars.update(task, completed=n))
            if client.has_blob(digest):
                return digest
            task = bars.add_task(f"uploading {fn}", total=size)
            client.upload_blob(digest, path, on_bytes=lambda n: bars.advance(task, n))
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
    return digest


def cmd_launch(args, client: DaemonClient) -> int:
    from localrun.launch import LaunchError, run

    try:
        return run(args, client)
    except LaunchError as exc:
        raise CLIError(str(exc)) from None


def cmd_version(args, client: DaemonClient) -> int:
    print(f"localrun version {__version__}")
    if client.is_up():
        try:
            v = client.version()
            print(f"daemon version {v.get('localrun_version') or v.get('version', '?')} at {client.base_url}")
        except APIError as exc:
            print(f"daemon at {client.base_url}: {exc.message}")
    else:
        print(f"no daemon is running at {client.base_url}")
    return 0


def cmd_serve(args) -> int:
    if args.host:
        os.environ["LOCALRUN_HOST"] = args.host  # settings() reads it; the server sees the flag
    from localrun.server import serve

    s = settings()
    with DaemonClient(s.base_url, api_key=s.api_key) as probe:
        if probe.is_up():
            raise CLIError(f"a localrun daemon is already running at {s.base_url} (stop it first, or pick another "
                           "address with --host or LOCALRUN_HOST)")
    return serve(s)


def _serve_epilog() -> str:
    try:
        current = dict(settings().describe())
    except ValueError as exc:
        current = {}
        bad = str(exc)
    else:
        bad = ""
    lines = ["environment variables (default -> current value):"]
    for name, (default, help_text) in ENV_VARS.items():
        lines.append(f"  {name}")
        lines.append(f"      {help_text}")
        lines.append(f"      default: {default}    current: {current.get(name, '(invalid)')}")
    if bad:
        lines.append(f"\nError in the environment: {bad}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Parser and main
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run language models locally: a daemon with a model library and an "
        "OpenAI-compatible + Ollama-shaped API, and this CLI as its client.")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("--host", metavar="HOST:PORT", help="daemon address (default: LOCALRUN_HOST)")
    p.add_argument("--no-autostart", action="store_true",
                   help="fail instead of starting the daemon in the background when none answers")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.set_defaults(verb_parsers=sub.choices)  # each verb's own parser, for its usage errors

    def add(name, help_text, **kw):
        return sub.add_parser(name, help=help_text, description=help_text, **kw)

    s = add("serve", "run the daemon in the foreground", epilog=_serve_epilog(),
            formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--host", dest="serve_host", metavar="HOST:PORT", help="address to bind (sets LOCALRUN_HOST)")

    s = add("pull", "download a model into the library")
    s.add_argument("model")

    s = add("run", "run a model: answer PROMPT, or chat when none is given")
    s.add_argument("model")
    s.add_argument("prompt", nargs="*", help="the prompt (piped stdin is appended)")
    s.add_argument("--verbose", action="store_true", help="print timing stats (TTFT, tok/s, token counts)")
    s.add_argument("--format", metavar="json|SCHEMA",
                   help="constrain the answer to JSON: 'json', or a JSON schema (inline or a .json file)")
    s.add_argument("--keepalive", metavar="DURATION", help="how long the model stays loaded (e.g. 5m, 0, -1)")
    s.add_argument("-o", "--option", action="append", metavar="NAME=VALUE",
                   help="a generation option, e.g. -o temperature=0 -o num_predict=64 (repeatable)")
    s.add_argument("--nowordwrap", action="store_true", help="don't break lines between words on a terminal")
    s.add_argument("--think", nargs="?", const="true", metavar="true|false|low|medium|high",
                   help="ask a thinking model to think (the default is its template's), or not (--think=false)")
    s.add_argument("--hidethinking", action="store_true", help="don't print a thinking model's thoughts")
    s.add_argument("--plain", action="store_true",
                   help="chat in a plain line REPL instead of the TUI (with piped stdin: one message per line)")
    s.add_argument("--image", action="append", metavar="PATH",
                   help="attach an image file to the prompt (repeatable; for vision models). An image file's "
                        "path written inside the prompt is attached too")
    s.add_argument("--truncate", nargs="?", const="true", metavar="true|false",
                   help="embedding models: cut an input longer than the context (the default), or with "
                        "--truncate=false fail instead")
    s.add_argument("--dimensions", type=int, metavar="N",
                   help="embedding models: keep the embedding's first N dimensions (normalized again)")

    s = add("chat", "open the chat TUI")
    s.add_argument("model", nargs="?")

    s = add("list", "list the models in the library", aliases=["ls"])

    s = add("show", "show a model's details, Modelfile and weights path")
    s.add_argument("model")
    g = s.add_mutually_exclusive_group()
    for field in ("modelfile", "parameters", "system", "template", "license"):
        g.add_argument(f"--{field}", action="store_true", help=f"print only the {field}")
    s.add_argument("--verbose", action="store_true", help="also print all model metadata")

    s = add("ps", "list the loaded models")
    s.add_argument("-v", "--verbose", action="store_true", help="also show context, slots and why this backend")

    s = add("stop", "unload a running model")
    s.add_argument("model")

    s = add("rm", "remove models from the library")
    s.add_argument("models", nargs="+", metavar="MODEL")

    s = add("cp", "copy a model under a new name")
    s.add_argument("source")
    s.add_argument("destination")

    s = add("create", "create a model from a Modelfile")
    s.add_argument("name")
    s.add_argument("-f", "--file", default="Modelfile", help="path to the Modelfile (default: ./Modelfile)")
    s.add_argument("-q", "--quantize", metavar="TYPE",
                   help="store the GGUF model quantized to TYPE by llama.cpp (e.g. q4_K_M, q8_0; the model must be "
                        "F16, BF16 or F32), as `ollama create --quantize` does")

    s = add("launch", "start a coding agent (Claude Code or Codex CLI) pointed at the daemon, with the model's "
            "full trained context")
    s.add_argument("agent", choices=["claude", "codex"])
    s.add_argument("--model", help="the model the agent uses (default: the library's only model)")
    # the agent's own arguments come after `--` (main() splits them off before parsing: an argparse
    # REMAINDER positional would swallow `--model M` too)
    s.set_defaults(agent_args=[])
    s.epilog = "arguments for the agent go after --, e.g. -- -p 'Say hello' or -- exec 'Say hello'"

    add("bench", "benchmarks (see `localrun bench --help`)")
    add("ray-serve", "serve a model with replicas on a Ray cluster (see `localrun ray-serve --help`)")
    add("version", "print the client and daemon versions")
    return p


VERBS = {"run": cmd_run, "chat": cmd_chat, "pull": cmd_pull, "list": cmd_list, "ls": cmd_list, "ps": cmd_ps,
         "show": cmd_show, "stop": cmd_stop, "rm": cmd_rm, "cp": cmd_cp, "create": cmd_create,
         "version": cmd_version, "launch": cmd_launch}


def _split_bench(argv: list[str], verb: str = "bench") -> list[str] | None:
    """`localrun [globals] bench ARGS...` -> ARGS, passed untouched to the bench CLI (or another `verb`'s)."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--host":
            i += 2
        elif tok.startswith("-"):
            i += 1
        else:
            return argv[i + 1:] if tok == verb else None
    return None


def _bench(rest: list[str]) -> int:
    try:
        from localrun.bench.cli import main as bench_main
    except ImportError as exc:
        raise CLIError(f"`localrun bench` is not available in this install ({exc})") from None
    result = bench_main(rest)
    return result if isinstance(result, int) else 0


def _dispatch(argv: list[str]) -> int:
    rest = _split_bench(argv)
    if rest is not None:
        return _bench(rest)
    rest = _split_bench(argv, "ray-serve")
    if rest is not None:  # runs without the daemon; imports Ray only here
        from localrun.cluster.ray_serve import main as ray_serve_main

        return ray_serve_main(rest)
    parser = build_parser()
    agent_args = None  # `launch AGENT ... -- ARGS`: ARGS go to the agent verbatim, in order
    if "--" in argv and "launch" in argv[:argv.index("--")]:
        agent_args, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    try:
        args, extra = parser.parse_known_args(argv)
        if agent_args is not None and args.command == "launch":
            args.agent_args = agent_args
        # `run MODEL --verbose PROMPT`: argparse stops filling `prompt` at the first option,
        # so words after an option arrive here; they belong to the prompt, as in Ollama.
        if extra and args.command == "launch":
            parser.error(f"unrecognized arguments: {' '.join(extra)} (arguments for the agent go after --)")
        elif extra and args.command == "run" and not any(e.startswith("-") for e in extra):
            args.prompt += extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse already printed
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None and not args.version:
        parser.print_help()
        return 0
    if args.command == "serve":
        args.host = args.serve_host or args.host
    if args.host:
        try:
            parse_hostport(args.host)
        except ValueError as exc:  # its message names LOCALRUN_HOST; the value came from the flag
            raise CLIError(f"--host: {str(exc).removeprefix('LOCALRUN_HOST: ')}") from None
    if args.command == "run":  # before any daemon is asked: a misspelled option is a usage error
        try:
            args.options = run_options(args.option)
        except UnknownOption as exc:
            try:
                args.verb_parsers["run"].error(f"argument -o/--option: {exc}")
            except SystemExit as stop:
                return stop.code if isinstance(stop.code, int) else 2
    if getattr(args, "keepalive", None) is not None:
        try:
            parse_duration(args.keepalive)
        except ValueError as exc:
            raise CLIError(f"--keepalive: {exc}") from None
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "run":  # a bad image file is the user's to fix before any daemon is asked
        args.prompt_text, args.attachments = run_images(args, " ".join(args.prompt))
    with DaemonClient(base_url_for(args.host)) as client:
        if args.version or args.command == "version":
            return cmd_version(args, client)
        client.ensure_running(autostart=not args.no_autostart)
        if client.started_pid:
            print(f"{PROG}: started the daemon at {client.base_url} (pid {client.started_pid})", file=sys.stderr)
        elif client.started_elsewhere:
            print(f"{PROG}: a daemon started meanwhile at {client.base_url} (by another command); using it",
                  file=sys.stderr)
        return VERBS[args.command](args, client)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `localrun list | head -1`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    except (DaemonUnavailable, APIError) as exc:
        _err(exc.message)
        return 1
    except LocalrunError as exc:
        _err(exc.message)
        return 1
    except (CLIError, ValueError, OSError) as exc:
        _err(str(exc))
        return 1
    except Exception as exc:  # a bug: still one line, with a pointer for a report
        _err(f"unexpected {type(exc).__name__}: {exc} (please report this)")
        return 1
