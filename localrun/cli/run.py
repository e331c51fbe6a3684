"""`run` and `chat`: answer a prompt, embed it, or open a chat (the TUI, else the line REPL)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from localrun.attachments import Attachment, AttachmentError, read_images, split_image_paths
from localrun.cli.common import CLIError, parse_bool_flag, parse_think, set_option
from localrun.cli.progress import ensure_model
from localrun.cli.repl import Repl
from localrun.cli.stream import RunSettings, stream_chat
from localrun.client import DaemonClient


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
