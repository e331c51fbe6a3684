"""The functions a Go template can call: Go's built-ins (printf, index, slice, eq, ...) and Ollama's.

Ollama adds ``json``, ``currentDate``, ``yesterdayDate`` and ``toTypeScriptType``.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import re
import urllib.parse
from typing import Any

from localrun.templates.go.parser import GoTemplateError
from localrun.templates.go.values import MISSING, GoStruct, fmt_float, go_json, go_str, truth


def _compare(a: Any, b: Any, op: str) -> bool:
    a = None if a is MISSING else a
    b = None if b is MISSING else b
    if op == "eq":
        return a == b
    if op == "ne":
        return a != b
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    if isinstance(a, bool) or isinstance(b, bool) or not (numbers or (isinstance(a, str) and isinstance(b, str))):
        raise GoTemplateError(f"Go template: incompatible types for comparison ({op})")
    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]


_VERB = re.compile(r"%([-+# 0]*)(\d+|\*)?(?:\.(\d+|\*))?([a-zA-Z%])")


def _printf(fmt: str, args: list) -> str:
    out, pos, k = [], 0, 0
    for m in _VERB.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        flags, width, prec, verb = m.group(1), m.group(2), m.group(3), m.group(4)
        if verb == "%":
            out.append("%")
            continue
        if k >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        a = args[k]
        k += 1
        if verb in ("s", "v"):
            s = go_str(a)
            if prec is not None and prec != "*":
                s = s[:int(prec)]
        elif verb == "q":
            s = json.dumps(go_str(a), ensure_ascii=False)
        elif verb == "d" and isinstance(a, int) and not isinstance(a, bool):
            s = str(a)
        elif verb in "fFeEgG" and isinstance(a, (int, float)) and not isinstance(a, bool):
            s = format(float(a), f".{prec or 6}{verb}") if verb in "fFeE" else fmt_float(float(a))
        elif verb == "t" and isinstance(a, bool):
            s = go_str(a)
        elif verb in "xX" and isinstance(a, (int, str)):
            s = format(a, verb) if isinstance(a, int) else a.encode().hex()
        else:
            s = f"%!{verb}({type(a).__name__}={go_str(a)})"
        if width and width != "*" and int(width) > 10_000:
            raise GoTemplateError(f"Go template: printf width {width} is over 10000")
        if width and width != "*" and len(s) < int(width):
            s = s.ljust(int(width)) if "-" in flags else s.rjust(int(width), "0" if "0" in flags and verb in "dfFeE"
                                                                  else " ")
        out.append(s)
    out.append(fmt[pos:])
    if k < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{type(a).__name__}={go_str(a)}" for a in args[k:]) + ")")
    return "".join(out)


def _sprint(args: list, ln: bool = False) -> str:
    if ln:
        return " ".join(go_str(a) for a in args) + "\n"
    out = []
    for i, a in enumerate(args):  # a space between operands when neither is a string
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(go_str(a))
    return "".join(out)


def _len(v: Any) -> int:
    if isinstance(v, (str, list, tuple, dict)):
        return len(v.encode("utf-8")) if isinstance(v, str) else len(v)
    raise GoTemplateError(f"Go template: len of {go_str(v)!r}")


def _index(v: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(v, dict):
            v = v.get(k, MISSING)
        elif isinstance(v, (list, tuple, str)) and isinstance(k, int) and not isinstance(k, bool):
            if not 0 <= k < len(v):
                raise GoTemplateError(f"Go template: index out of range: {k}")
            v = v[k]
        else:
            raise GoTemplateError(f"Go template: can't index {go_str(v)!r} with {go_str(k)!r}")
    return v


def _slice(v: Any, *ix: Any) -> Any:
    if not isinstance(v, (str, list, tuple)) or len(ix) > 2 or not all(isinstance(i, int) for i in ix):
        raise GoTemplateError("Go template: slice takes a string or list and up to two integer indexes")
    lo = ix[0] if ix else 0
    hi = ix[1] if len(ix) > 1 else len(v)
    if not 0 <= lo <= hi <= len(v):
        raise GoTemplateError(f"Go template: slice index out of range: [{lo}:{hi}]")
    return v[lo:hi]


def _ts_type(v: Any) -> str:
    """Ollama's ToolProperty.ToTypeScriptType."""
    if not isinstance(v, GoStruct) or "Type" not in v.fields:
        return "any"
    any_of = v.fields.get("AnyOf") or []
    if any_of:
        return " | ".join(_ts_type(a) for a in any_of)
    names = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
             "array": "any[]", "object": "Record<string, any>", "null": "null"}
    types = list(v.fields["Type"] or [])
    return " | ".join(names.get(t, "any") for t in types) if types else "any"


def _date(days: int = 0) -> str:
    return (_dt.date.today() - _dt.timedelta(days=days)).isoformat()


FUNCS = {
    "not": lambda x: not truth(x),
    "len": _len,
    "index": _index,
    "slice": _slice,
    "print": lambda *a: _sprint(list(a)),
    "println": lambda *a: _sprint(list(a), ln=True),
    "printf": lambda f, *a: _printf(go_str(f), list(a)),
    "html": lambda *a: html.escape(_sprint(list(a)), quote=True).replace("&#x27;", "&#39;").replace("&quot;", "&#34;"),
    "js": lambda *a: json.dumps(_sprint(list(a)))[1:-1].replace("'", "\\'").replace("<", "\\u003C")
    .replace(">", "\\u003E"),
    "urlquery": lambda *a: urllib.parse.quote_plus(_sprint(list(a))),
    "json": go_json,
    "currentDate": lambda *a: _date(),
    "yesterdayDate": lambda *a: _date(1),
    "toTypeScriptType": _ts_type,
}
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    FUNCS[_op] = (lambda op: lambda a, *b: (any(_compare(a, x, op) for x in b) if op == "eq" else
                                             _compare(a, b[0], op)) if b else arity_error(op))(_op)


def arity_error(name: str):
    raise GoTemplateError(f"Go template: wrong number of arguments for {name}")

