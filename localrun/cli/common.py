"""What every command shares: the CLI's own errors, value parsing and the tables' formatting."""

from __future__ import annotations

import re
import sys
from datetime import datetime, timezone

from localrun.client import parse_think as client_parse_think


PROG = "localrun"


class CLIError(Exception):
    """A user mistake found by the CLI itself (missing file, bad value)."""


class UnknownOption(CLIError):
    """A generation option name that is no Modelfile PARAMETER (a typo like num_predcit): the daemon would
    ignore it, so the CLI refuses it (a usage error for `run -o`, a message in the REPL)."""


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


def parse_bool_flag(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise CLIError(f"{what} takes true or false, not {value!r}")


def parse_think(value: str, what: str = "--think") -> bool | str:
    try:
        return client_parse_think(value)
    except ValueError as exc:
        raise CLIError(f"{what} {exc}") from None


def print_error(msg: str) -> None:
    print(f"Error: {msg}", file=sys.stderr)
