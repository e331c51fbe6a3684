"""The line REPL: `run MODEL` without a prompt when the TUI is unavailable, or with --plain."""

from __future__ import annotations

import sys

from localrun.attachments import AttachmentError, read_images, split_image_paths
from localrun.cli.common import CLIError, parse_think, print_error, set_option
from localrun.cli.models import render_show
from localrun.cli.progress import ensure_model
from localrun.cli.stream import RunSettings, stream_chat
from localrun.client import APIError, DaemonClient


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
                    print_error(str(exc))
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
                print_error(exc.message)
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
            print_error(str(exc))
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
