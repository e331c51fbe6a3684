"""Slash commands and the editable generation parameters (no Textual here).

``/set temperature 0.2``, ``/set system You are terse.``, ``/set num_ctx 4096``,
``/unset seed``, ``/clear``, ``/new``, ``/model NAME``, ``/models``, ``/chats``,
``/copy``, ``/image PATH``, ``/detach``, ``/save NAME``, ``/help``, ``/bye``.  Parsing raises :class:`CommandError` with a message a
user can act on; the app shows it and carries on.
"""

from __future__ import annotations

from dataclasses import dataclass


class CommandError(ValueError):
    pass


@dataclass(frozen=True)
class Param:
    name: str  # Ollama option name sent in "options"
    kind: type  # int | float
    minimum: float | None
    maximum: float | None
    help: str


PARAMS: dict[str, Param] = {
    p.name: p
    for p in (
        Param("temperature", float, 0.0, 5.0, "randomness; 0 = greedy"),
        Param("top_p", float, 0.0, 1.0, "nucleus sampling mass"),
        Param("num_predict", int, -1, None, "max tokens in a reply (-1 = until the model stops)"),
        Param("num_ctx", int, 16, None, "context window in tokens"),
        Param("seed", int, None, None, "random seed for reproducible replies"),
    )
}
ALIASES = {"max_tokens": "num_predict", "maxtokens": "num_predict", "ctx": "num_ctx", "top-p": "top_p", "temp": "temperature"}


def canonical_param(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PARAMS:
        raise CommandError(f"unknown parameter {name!r}; one of: {', '.join(PARAMS)} (or system)")
    return key


def parse_param(name: str, text: str) -> int | float | None:
    """Validate one parameter value; '' or 'default' means unset (None)."""
    p = PARAMS[canonical_param(name)]
    t = text.strip()
    if t == "" or t.lower() in ("default", "none", "unset"):
        return None
    try:
        value: int | float = int(t) if p.kind is int else float(t)
    except ValueError:
        kind = "a whole number" if p.kind is int else "a number"
        raise CommandError(f"{p.name} must be {kind}, got {t!r}") from None
    if p.kind is float and value != value:  # NaN
        raise CommandError(f"{p.name} must be a number, got {t!r}")
    if p.minimum is not None and value < p.minimum:
        raise CommandError(f"{p.name} must be ≥ {p.minimum:g}, got {t}")
    if p.maximum is not None and value > p.maximum:
        raise CommandError(f"{p.name} must be ≤ {p.maximum:g}, got {t}")
    if p.name == "num_predict" and value == 0:
        raise CommandError("num_predict must be -1 (no limit) or at least 1")
    return value


def parse_think(text: str) -> bool | str:
    """/set think's value: on (the default) / off, true / false, or an effort level."""
    from localrun.client import parse_think as parse

    try:
        return parse(text)
    except ValueError:
        raise CommandError("usage: /set think [on|off|low|medium|high] (or /set nothink, /unset think)") from None


@dataclass(frozen=True)
class Command:
    name: str  # set | unset | clear | new | model | models | chats | copy | help | bye | stop | image | detach
    key: str | None = None  # for set/unset: a PARAMS name or "system"
    value: object = None  # parsed value (None = unset) or text argument


HELP = """\
**Commands**

- `/set temperature 0.2` — also top_p, num_predict (max_tokens), num_ctx, seed
- `/set system TEXT` — the system prompt; `/unset NAME` back to the model's default
- `/set think` · `/set nothink` — ask a thinking model to think (or `/set think high`), or not
- `/model NAME` — switch model (pulled first when not in the library); `/models` picker
- `/new` · `/clear` — new conversation (the old one stays saved) · clear this one
- `/chats` — resume a saved conversation · `/copy` the last reply · `/bye` quit
- `/save NAME` — a new model from this chat: its model, system prompt, parameters and messages
- `/image PATH` — attach an image to your next message (vision models; or paste/drop the
  file's path as the whole message) · `/detach` drops the attached images

**Keys**: Enter sends · Ctrl+J (or Shift+Enter / Alt+Enter where the terminal reports
them) newline · Esc or Ctrl+C stops a reply · Ctrl+N new · Ctrl+L clear · Ctrl+O models ·
Ctrl+R saved chats · F3 copy last reply · F2 settings · F1 help · Ctrl+Q quit
"""

_SIMPLE = {
    "clear": "clear",
    "new": "new",
    "models": "models",
    "chats": "chats",
    "history": "chats",
    "copy": "copy",
    "help": "help",
    "?": "help",
    "bye": "bye",
    "exit": "bye",
    "quit": "bye",
    "stop": "stop",
    "detach": "detach",
}


def parse_command(line: str) -> Command:
    """Parse one line that starts with '/'."""
    text = line.strip()
    if not text.startswith("/"):
        raise CommandError("commands start with '/'")
    head, _, rest = text[1:].partition(" ")
    head = head.lower()
    rest = rest.strip()
    if head in _SIMPLE:
        if rest and head not in ("help", "?"):
            raise CommandError(f"/{head} takes no argument")
        return Command(_SIMPLE[head])
    if head == "save":
        if len(rest.split()) != 1:
            raise CommandError("usage: /save NAME (a new model: this chat's model, system prompt, parameters and "
                               "messages)")
        return Command("save", value=rest)
    if head == "model":
        if not rest:
            return Command("models")
        if len(rest.split()) != 1:
            raise CommandError("usage: /model NAME (e.g. /model smollm2:135m)")
        return Command("model", value=rest)
    if head in ("image", "img", "attach"):
        path = rest
        if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":  # a quoted path (spaces)
            path = path[1:-1]
        elif "\\ " in path:  # spaces escaped the shell's way (a dropped file)
            path = path.replace("\\ ", " ")
        if not path.strip():
            raise CommandError("usage: /image PATH (a PNG, JPEG, WebP, GIF or BMP file for the next message)")
        return Command("image", value=path)
    if head == "set":
        if not rest:
            raise CommandError("usage: /set NAME VALUE, e.g. /set temperature 0.2 or /set system You are terse.")
        key, _, value = rest.partition(" ")
        if key.lower() == "parameter":  # Ollama's spelling: /set parameter temperature 0.2
            key, _, value = value.strip().partition(" ")
        if key.lower() == "system":
            if not value.strip():
                raise CommandError("usage: /set system TEXT (or /unset system)")
            return Command("set", "system", value.strip())
        if key.lower() == "think":
            return Command("set", "think", parse_think(value))
        if key.lower() == "nothink":
            return Command("set", "think", False)
        name = canonical_param(key)
        if not value.strip():
            raise CommandError(f"usage: /set {name} VALUE ({PARAMS[name].help})")
        return Command("set", name, parse_param(name, value))
    if head == "unset":
        if not rest:
            raise CommandError("usage: /unset NAME")
        if rest.lower() in ("system", "think"):
            return Command("unset", rest.lower())
        return Command("unset", canonical_param(rest))
    raise CommandError(f"unknown command /{head}; /help lists them")
