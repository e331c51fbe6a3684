"""Ollama's chat templates: Go's text/template language, rendered as Ollama renders them.

An Ollama Modelfile's TEMPLATE (and the `template` of Ollama's /api/create and /api/generate) is a Go
template: ``{{ .System }}``, ``{{ .Prompt }}``, ``{{ range .Messages }}{{ .Role }}...{{ end }}``,
``{{- if .Tools }}...{{ json .Function.Arguments }}``. This module parses that language (actions with
``{{-`` / ``-}}`` trim markers, comments, pipelines with ``|``, parenthesized pipelines, variables
declared with ``:=`` and set with ``=``, if / else if / else, range (over lists, maps in key order,
integers; ``$i, $x :=``; break and continue), with, and Go's built-in functions plus Ollama's
``json``, ``currentDate``, ``yesterdayDate`` and ``toTypeScriptType``) and renders a chat the way
Ollama's ``template.Execute`` does:

- a template that reads ``.Messages`` gets every message (consecutive ones of the same role merged,
  tool results kept apart), ``.System`` (the system messages joined), ``.Tools``, ``.Think``,
  ``.ThinkLevel`` and ``.IsThinkSet``;
- an older template (``.System`` / ``.Prompt`` / ``.Response`` only) is rendered once per turn and
  the last turn is cut after ``{{ .Response }}``, so the prompt ends where the answer begins (a
  template without ``.Response`` gets one appended, as Ollama does).

Values print as Go prints them: lists of tools, tool-call arguments and tool properties as JSON
(Go's encoding: keys of maps sorted, ``<``, ``>`` and ``&`` escaped), booleans as true / false, a
missing map key as ``<no value>``. ``define``, ``template`` and ``block`` are refused (400): Ollama's
templates do not use them. Nothing here runs code a template names: the language has no access to
Python objects, only to the values given to it; the caller bounds time and output size.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from localrun.errors import InvalidRequest

# a Go template's marks: an action that starts with a field, a variable, a comment or a Go keyword
_GO_ACTION = re.compile(r"\{\{-?\s*(?:\.|\$|/\*|(?:range|if|with|else|end|define|template|block)\b)")


class GoTemplateError(InvalidRequest):
    """The template does not parse, or failed while rendering."""


def is_go_template(text: str | None) -> bool:
    """Whether `text` is written in Go's template language (Ollama's) rather than Jinja."""
    return bool(text) and "{%" not in text and _GO_ACTION.search(text) is not None


# -- values ------------------------------------------------------------------------------------------
@dataclass
class GoStruct:
    """A Go struct: fields by their Go names; `as_json` (when set) is its JSON form, which it prints
    as (Ollama's tool types have String() methods that marshal them)."""

    fields: dict[str, Any]
    as_json: Any = None


class GoJSONMap(dict):
    """A map whose String() is its JSON (Ollama's tool-call arguments and tool properties)."""


class GoJSONList(list):
    """A slice whose String() is its JSON (Ollama's list of tools)."""


class Ordered(dict):
    """A struct's JSON form: its fields in declaration order (encoding/json keeps them so; maps it sorts)."""


class PropertyType(list):
    """Ollama's PropertyType ([]string): prints as its one type, or as [a b]; JSON: a string, or a list."""


class _Missing:
    """A key a map does not have (missingkey=zero on map[string]any: a nil interface)."""

    def __repr__(self) -> str:
        return "<no value>"


MISSING = _Missing()


def go_json(v: Any) -> str:
    """encoding/json's Marshal: maps with sorted keys, no spaces, <, > and & escaped."""
    s = json.dumps(_plain(v), ensure_ascii=False, separators=(",", ":"), sort_keys=False)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _plain(v: Any) -> Any:
    if isinstance(v, GoStruct):
        return _plain(v.as_json) if v.as_json is not None else {k: _plain(x) for k, x in v.fields.items()}
    if isinstance(v, PropertyType):
        return v[0] if len(v) == 1 else list(v)
    if isinstance(v, Ordered):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, dict):
        return {str(k): _plain(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is MISSING:
        return None
    return v


def _fmt_float(f: float) -> str:
    """Go's %v of a float64 (strconv 'g' with the shortest repr, exponent from 1e21)."""
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if math.isnan(f):
        return "NaN"
    if f == int(f) and abs(f) < 1e21:
        return str(int(f))
    r = repr(f)
    if "e" in r:
        mant, exp = r.split("e")
        return f"{mant}e{int(exp):+03d}"
    return r


def go_str(v: Any) -> str:
    """fmt.Sprint of one value, as text/template prints an action's result."""
    if isinstance(v, str):
        return v
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None or v is MISSING:
        return "<no value>" if v is MISSING else "<nil>"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _fmt_float(v)
    if isinstance(v, PropertyType):
        return "" if not v else v[0] if len(v) == 1 else "[" + " ".join(v) + "]"
    if isinstance(v, (GoJSONMap, GoJSONList)):
        return go_json(v)
    if isinstance(v, GoStruct):
        if v.as_json is not None:
            return go_json(v)
        return "{" + " ".join(go_str(x) for x in v.fields.values()) + "}"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{go_str(k)}:{go_str(v[k])}" for k in sorted(v, key=str)) + "]"
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(go_str(x) for x in v) + "]"
    return str(v)


def truth(v: Any) -> bool:
    """text/template's truth: false, 0, nil and empty strings, slices and maps are false; structs are true."""
    if v is None or v is MISSING:
        return False
    if isinstance(v, GoStruct):
        return True
    if isinstance(v, (bool, int, float)):
        return bool(v)
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True


# -- lexing and parsing ----------------------------------------------------------------------------
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<decl>:=)
  | (?P<assign>=)
  | (?P<pipe>\|)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<comma>,)
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<num>[-+]?(?:0[xX][0-9a-fA-F_]+|(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))
  | (?P<var>\$[A-Za-z0-9_]*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
""", re.X)
_KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block", "break", "continue"}


@dataclass
class _Pipe:
    decl: list[str] = field(default_factory=list)  # variables declared (:=) or assigned (=)
    assign: bool = False
    cmds: list[list[tuple]] = field(default_factory=list)  # each command: its operands


def _unquote(tok: str, kind: str) -> str:
    if kind == "raw":
        return tok[1:-1]
    try:
        return json.loads(tok) if kind == "str" else json.loads('"' + tok[1:-1].replace('"', '\\"') + '"')
    except ValueError:
        return tok[1:-1].encode("utf-8").decode("unicode_escape", "replace")


class _Parser:
    """Go's text/template grammar (the part Ollama's templates use) into nested tuples:
    ("text", s), ("action", pipe), ("if" | "with", pipe, body, else), ("range", pipe, body, else),
    ("break",), ("continue",)."""

    def __init__(self, src: str) -> None:
        self.items = self._split(src)
        self.i = 0

    def _split(self, src: str) -> list[tuple[str, str]]:
        """("text", s) and ("act", inner) items, trim markers applied."""
        out: list[tuple[str, str]] = []
        pos, trim_next = 0, False
        while True:
            j = src.find("{{", pos)
            text = src[pos:] if j < 0 else src[pos:j]
            if trim_next:
                text = text.lstrip(" \t\r\n")
            if j < 0:
                if text:
                    out.append(("text", text))
                return out
            k = j + 2
            trim_prev = src.startswith("-", k) and k + 1 < len(src) and src[k + 1] in " \t\r\n"
            if trim_prev:
                text = text.rstrip(" \t\r\n")
                k += 1
            if text:
                out.append(("text", text))
            # the action ends at the first }} outside a string (a comment ends at */}})
            body_start = k
            stripped = src[k:].lstrip(" \t\r\n")
            if stripped.startswith("/*"):
                end = src.find("*/", k)
                if end < 0:
                    raise GoTemplateError("Go template: unclosed comment")
                close = src.find("}}", end + 2)
                if close < 0:
                    raise GoTemplateError("Go template: unclosed action")
                inner, kind = src[end + 2:close], "comment"
            else:
                close, kind = self._find_close(src, k), "act"
                inner = src[body_start:close]
            trim_next = False
            if inner.endswith("-") and len(inner) >= 2 and inner[-2] in " \t\r\n":
                trim_next, inner = True, inner[:-1]
            elif kind == "comment" and inner.strip() not in ("", "-"):
                raise GoTemplateError("Go template: comment ends with */ not followed by }}")
            if kind == "comment" and inner.strip() == "-":
                trim_next = True
            if kind == "act":
                out.append(("act", inner))
            pos = close + 2

    @staticmethod
    def _find_close(src: str, k: int) -> int:
        i, n = k, len(src)
        while i < n:
            c = src[i]
            if c in "\"'`":
                end = src.find(c, i + 1) if c == "`" else _string_end(src, i)
                if end < 0:
                    raise GoTemplateError("Go template: unterminated string in an action")
                i = end + 1
                continue
            if src.startswith("}}", i):
                return i
            i += 1
        raise GoTemplateError("Go template: unclosed action (no }})")

    # -- structure
    def parse(self) -> list:
        body, stop = self._list(top=True)
        if stop is not None:
            raise GoTemplateError(f"Go template: unexpected {{{{ {stop[0]} }}}}")
        return body

    def _list(self, top: bool = False) -> tuple[list, tuple | None]:
        """Nodes until an {{ else ... }} or {{ end }} (returned as the stop: (keyword, rest))."""
        nodes: list = []
        while self.i < len(self.items):
            kind, s = self.items[self.i]
            self.i += 1
            if kind == "text":
                nodes.append(("text", s))
                continue
            toks = _lex(s)
            if not toks:
                raise GoTemplateError("Go template: empty action {{ }}")
            head = toks[0]
            if head == ("ident", "end") or head == ("ident", "else"):
                if top:
                    raise GoTemplateError(f"Go template: unexpected {{{{ {head[1]} }}}}")
                return nodes, (head[1], toks[1:])
            if head[0] == "ident" and head[1] in ("if", "with", "range"):
                nodes.append(self._branch(head[1], toks[1:]))
            elif head[0] == "ident" and head[1] in ("define", "template", "block"):
                raise GoTemplateError(f"Go template: {{{{ {head[1]} }}}} is not supported")
            elif head[0] == "ident" and head[1] in ("break", "continue"):
                nodes.append((head[1],))
            else:
                nodes.append(("action", _pipeline(toks, allow_decl=True)))
        if top:
            return nodes, None
        raise GoTemplateError("Go template: missing {{ end }}")

    def _branch(self, kw: str, toks: list) -> tuple:
        pipe = _pipeline(toks, allow_decl=True, range_decl=kw == "range")
        body, stop = self._list()
        else_body = None
        if stop[0] == "else":
            rest = stop[1]
            if rest and rest[0] == ("ident", kw) and kw in ("if", "with"):  # else if / else with: a chain
                else_body = [self._branch(kw, rest[1:])]
                return (kw, pipe, body, else_body)
            if rest:
                raise GoTemplateError(f"Go template: unexpected {{{{ else {' '.join(str(t[1]) for t in rest)} }}}}")
            else_body, stop = self._list()
            if stop[0] != "end":
                raise GoTemplateError("Go template: {{ else }} after {{ else }}")
        if stop[1]:
            raise GoTemplateError("Go template: {{ end }} takes no arguments")
        return (kw, pipe, body, else_body)


def _string_end(src: str, i: int) -> int:
    q, j = src[i], i + 1
    while j < len(src):
        if src[j] == "\\":
            j += 2
            continue
        if src[j] == q:
            return j
        if src[j] == "\n":
            return -1
        j += 1
    return -1


def _lex(s: str) -> list[tuple[str, Any]]:
    out, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:
            raise GoTemplateError(f"Go template: unexpected {s[pos:pos + 10]!r} in an action")
        kind = m.lastgroup
        tok = m.group()
        pos = m.end()
        if kind == "ws":
            continue
        if kind == "field" and out and out[-1][0] in ("rparen", "var") and not s[m.start() - 1].isspace():
            # (pipe).Field and $x.Field: fields of the value before
            out.append(("chain", tok[1:].split(".")))
            continue
        if kind in ("str", "raw", "char"):
            out.append(("str", _unquote(tok, kind)))
        elif kind == "num":
            t = tok.replace("_", "")
            try:
                out.append(("num", int(t, 0) if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+|\d+)", t) else float(t)))
            except ValueError:
                raise GoTemplateError(f"Go template: bad number {tok!r}") from None
        elif kind == "field":
            out.append(("field", [] if tok == "." else tok[1:].split(".")))
        else:
            out.append((kind, tok))
    return out


def _pipeline(toks: list, allow_decl: bool = False, range_decl: bool = False) -> _Pipe:
    pipe = _Pipe()
    i = 0
    if allow_decl:  # $x := / $x = / $i, $e :=
        j, names = 0, []
        while j < len(toks) and toks[j][0] == "var":
            names.append(toks[j][1])
            if j + 1 < len(toks) and toks[j + 1][0] == "comma" and range_decl and len(names) < 2:
                j += 2
                continue
            break
        if names and j + 1 < len(toks) and toks[j + 1][0] in ("decl", "assign"):
            pipe.decl, pipe.assign, i = names, toks[j + 1][0] == "assign", j + 2
    cmd: list[tuple] = []
    while i < len(toks):
        kind, v = toks[i]
        if kind == "pipe":
            if not cmd:
                raise GoTemplateError("Go template: missing command before |")
            pipe.cmds.append(cmd)
            cmd = []
            i += 1
            continue
        if kind == "lparen":
            depth, j = 1, i + 1
            while j < len(toks) and depth:
                depth += {"lparen": 1, "rparen": -1}.get(toks[j][0], 0)
                j += 1
            if depth:
                raise GoTemplateError("Go template: unclosed (")
            operand: tuple = ("pipe", _pipeline(toks[i + 1:j - 1]), [])
            i = j
        elif kind == "rparen":
            raise GoTemplateError("Go template: unexpected )")
        elif kind == "field":
            operand, i = ("field", v), i + 1
        elif kind == "var":
            operand, i = ("var", v, []), i + 1
        elif kind in ("str", "num"):
            operand, i = ("lit", v), i + 1
        elif kind == "ident":
            if v in ("true", "false"):
                operand = ("lit", v == "true")
            elif v == "nil":
                operand = ("lit", None)
            elif v in _KEYWORDS:
                raise GoTemplateError(f"Go template: unexpected {v!r} in a pipeline")
            else:
                operand = ("func", v)
            i += 1
        else:
            raise GoTemplateError(f"Go template: unexpected {v!r} in a pipeline")
        while i < len(toks) and toks[i][0] == "chain":  # $x.A.B, (pipe).A
            if operand[0] not in ("var", "pipe"):
                raise GoTemplateError("Go template: a field can follow only a variable or ( )")
            operand = (operand[0], operand[1], operand[2] + toks[i][1])
            i += 1
        cmd.append(operand)
    if cmd:
        pipe.cmds.append(cmd)
    elif pipe.cmds:
        raise GoTemplateError("Go template: missing command after |")
    if not pipe.cmds:
        raise GoTemplateError("Go template: missing value in an action")
    return pipe


def parse(text: str) -> list:
    """The template's tree; GoTemplateError (a 400) naming what does not parse."""
    try:
        return _Parser(text).parse()
    except RecursionError:
        raise GoTemplateError("Go template: nested too deeply") from None


# -- rendering -------------------------------------------------------------------------------------
class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _field(v: Any, name: str) -> Any:
    if isinstance(v, GoStruct):
        if name not in v.fields:
            raise GoTemplateError(f"Go template: can't evaluate field {name}")
        return v.fields[name]
    if isinstance(v, dict):
        return v.get(name, MISSING)
    if v is None or v is MISSING:
        raise GoTemplateError(f"Go template: nil pointer evaluating .{name}")
    raise GoTemplateError(f"Go template: can't evaluate field {name} in a {type(v).__name__}")


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
            s = format(float(a), f".{prec or 6}{verb}") if verb in "fFeE" else _fmt_float(float(a))
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


_FUNCS = {
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
    _FUNCS[_op] = (lambda op: lambda a, *b: (any(_compare(a, x, op) for x in b) if op == "eq" else
                                             _compare(a, b[0], op)) if b else _arity(op))(_op)


def _arity(name: str):
    raise GoTemplateError(f"Go template: wrong number of arguments for {name}")


class _Renderer:
    def __init__(self, root: Any, out_limit: int) -> None:
        self.root, self.out, self.size, self.limit = root, [], 0, out_limit
        self.scopes: list[dict[str, Any]] = [{"$": root}]

    def emit(self, s: str) -> None:
        self.size += len(s)
        if self.size > self.limit:
            raise GoTemplateError(f"the chat template produced a prompt over {self.limit} characters")
        self.out.append(s)

    def var(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise GoTemplateError(f"Go template: undefined variable {name}")

    def set_var(self, name: str, value: Any) -> None:
        for scope in reversed(self.scopes):
            if name in scope:
                scope[name] = value
                return
        raise GoTemplateError(f"Go template: undefined variable {name}")

    def run(self, nodes: list, dot: Any) -> None:
        for node in nodes:
            kind = node[0]
            if kind == "text":
                self.emit(node[1])
            elif kind == "action":
                pipe = node[1]
                v = self.pipe(pipe, dot)
                if not pipe.decl:
                    self.emit(go_str(v))
            elif kind in ("if", "with"):
                self.scopes.append({})
                try:
                    v = self.pipe(node[1], dot)
                    if truth(v):
                        self.run(node[2], v if kind == "with" else dot)
                    elif node[3] is not None:
                        self.run(node[3], dot)
                finally:
                    self.scopes.pop()
            elif kind == "range":
                self.range(node, dot)
            elif kind == "break":
                raise _Break()
            elif kind == "continue":
                raise _Continue()

    def range(self, node: tuple, dot: Any) -> None:
        pipe = node[1]
        self.scopes.append({})
        try:
            v = self.pipe(_Pipe(cmds=pipe.cmds), dot)
            if isinstance(v, dict):
                items: Any = [(k, v[k]) for k in sorted(v, key=str)]
            elif isinstance(v, (list, tuple)):
                items = list(enumerate(v))
            elif isinstance(v, int) and not isinstance(v, bool):
                items = ((i, i) for i in range(v)) if v > 0 else []  # lazily: the caller's deadline bounds it
            elif v is None or v is MISSING:
                items = []
            else:
                raise GoTemplateError(f"Go template: range can't iterate over {go_str(v)}")
            if isinstance(items, list) and not items:
                if node[3] is not None:
                    self.run(node[3], dot)
                return
            for k, x in items:
                scope = {}
                if len(pipe.decl) == 1:
                    scope[pipe.decl[0]] = x
                elif len(pipe.decl) == 2:
                    scope[pipe.decl[0]], scope[pipe.decl[1]] = k, x
                self.scopes.append(scope)
                try:
                    self.run(node[2], x)
                except _Continue:
                    pass
                except _Break:
                    break
                finally:
                    self.scopes.pop()
        finally:
            self.scopes.pop()

    def pipe(self, pipe: _Pipe, dot: Any) -> Any:
        v: Any = None
        for n, cmd in enumerate(pipe.cmds):
            v = self.command(cmd, dot, v if n else None, n > 0)
        for name in pipe.decl[:1]:
            if pipe.assign:
                self.set_var(name, v)
            else:
                self.scopes[-1][name] = v
        return v

    def command(self, cmd: list, dot: Any, piped: Any, has_piped: bool) -> Any:
        head = cmd[0]
        if head[0] == "func":
            name = head[1]
            if name in ("and", "or"):  # evaluated lazily, as Go does
                args = cmd[1:]
                if not args and not has_piped:
                    _arity(name)
                v = None
                for a in args:
                    v = self.operand(a, dot)
                    if truth(v) != (name == "and"):
                        return v
                return piped if has_piped else v
            fn = _FUNCS.get(name)
            if fn is None:
                raise GoTemplateError(f"Go template: function {name!r} not defined")
            args = [self.operand(a, dot) for a in cmd[1:]] + ([piped] if has_piped else [])
            try:
                v = fn(*args)
            except TypeError:
                raise GoTemplateError(f"Go template: wrong number of arguments for {name}") from None
            if isinstance(v, str) and len(v) > self.limit:  # a value doubled in a loop stops here
                raise GoTemplateError(f"the chat template built a value over {self.limit} characters")
            return v
        if len(cmd) > 1 or has_piped:
            raise GoTemplateError("Go template: can't give arguments to a value (methods are not supported)")
        return self.operand(head, dot)

    def operand(self, op: tuple, dot: Any) -> Any:
        kind = op[0]
        if kind == "lit":
            return op[1]
        if kind == "field":
            v = dot
            for name in op[1]:
                v = _field(v, name)
            return v
        if kind == "var":
            v = self.var(op[1])
            for name in op[2]:
                v = _field(v, name)
            return v
        if kind == "pipe":
            v = self.pipe(op[1], dot)
            for name in op[2]:
                v = _field(v, name)
            return v
        if kind == "func":
            return self.command([op], dot, None, False)
        raise GoTemplateError("Go template: bad operand")


def execute(tree: list, data: Any, out_limit: int) -> str:
    r = _Renderer(data, out_limit)
    try:
        r.run(tree, data)
    except (_Break, _Continue):
        raise GoTemplateError("Go template: break or continue outside a range") from None
    except RecursionError:
        raise GoTemplateError("Go template: nested too deeply") from None
    return "".join(r.out)


# -- Ollama's rendering ----------------------------------------------------------------------------
def _identifiers(nodes: list) -> set[str]:
    """Ollama's Vars(): the field and variable names the template uses, lower-cased."""
    names: set[str] = set()

    def pipe(p: _Pipe) -> None:
        for cmd in p.cmds:
            for op in cmd:
                if op[0] == "field":
                    names.update(x.lower() for x in op[1])
                elif op[0] == "var":
                    names.add(op[1].lower())
                    names.update(x.lower() for x in op[2])
                elif op[0] == "pipe":
                    pipe(op[1])
                    names.update(x.lower() for x in op[2])

    def walk(ns: list) -> None:
        for n in ns:
            if n[0] == "action":
                pipe(n[1])
            elif n[0] in ("if", "with", "range"):
                pipe(n[1])
                walk(n[2])
                if n[3] is not None:
                    walk(n[3])

    walk(nodes)
    return names


def _cut_at_response(nodes: list) -> list:
    """Ollama's deleteNode: everything after the first {{ .Response }} (in the order Ollama walks the
    tree: branch bodies, not their conditions) is dropped."""
    cut = False

    def has_response(p: _Pipe) -> bool:
        return any(op[0] == "field" and "Response" in op[1] for cmd in p.cmds for op in cmd)

    def walk(ns: list) -> list:
        nonlocal cut
        out = []
        for n in ns:
            if cut:
                continue
            if n[0] == "action":
                if has_response(n[1]):
                    cut = True
                out.append(n)
            elif n[0] in ("if", "with", "range"):
                body = walk(n[2])
                els = walk(n[3]) if n[3] is not None else None
                out.append((n[0], n[1], body, els))
            else:
                out.append(n)
        return out

    return walk(nodes)


_RESPONSE = ("action", _Pipe(cmds=[[("field", ["Response"])]]))


@dataclass
class OllamaTemplate:
    tree: list
    names: set[str]

    @property
    def uses_messages(self) -> bool:
        return "messages" in self.names


_CACHE: dict[str, OllamaTemplate] = {}


def compile_ollama(text: str) -> OllamaTemplate:
    """Parse as Ollama does: a template that reads neither .Messages nor .Response gets {{ .Response }}
    appended."""
    t = _CACHE.get(text)
    if t is None:
        tree = parse(text)
        names = _identifiers(tree)
        if "messages" not in names and "response" not in names:
            tree = tree + [_RESPONSE]
        if len(_CACHE) > 64:
            _CACHE.clear()
        t = _CACHE[text] = OllamaTemplate(tree, names)
    return t


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _arguments(v: Any) -> GoJSONMap:
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except ValueError:
            v = {}
    return GoJSONMap(v if isinstance(v, dict) else {})


def _message(m: dict) -> GoStruct:
    calls = []
    for i, tc in enumerate(m.get("tool_calls") or []):
        fn = tc.get("function") or {}
        calls.append(GoStruct({"ID": tc.get("id") or "", "Function": GoStruct(
            {"Index": fn.get("index", i) if isinstance(fn.get("index", i), int) else i, "Name": fn.get("name") or "",
             "Arguments": _arguments(fn.get("arguments"))})}))
    thinking = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k)), "")
    return GoStruct({"Role": m.get("role") or "", "Content": _text(m.get("content")), "Thinking": _text(thinking),
                     "Images": list(m.get("images") or []), "ToolCalls": calls,
                     "ToolName": m.get("tool_name") or m.get("name") or "", "ToolCallID": m.get("tool_call_id") or ""})


def _property(p: Any) -> GoStruct:
    """Ollama's api.ToolProperty (JSON: its fields in order, empty ones left out)."""
    p = p if isinstance(p, dict) else {}
    t = p.get("type")
    types = PropertyType([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list)
                         else [])
    props = p.get("properties")
    fields = {"AnyOf": [_property(a) for a in p.get("anyOf") or []], "Type": types, "Items": p.get("items"),
              "Description": p.get("description") or "", "Enum": list(p.get("enum") or []),
              "Properties": GoJSONMap({k: _property(v) for k, v in props.items()}) if isinstance(props, dict) else None,
              "Required": list(p.get("required") or [])}
    js = Ordered((k, fields[f]) for k, f in (("anyOf", "AnyOf"), ("type", "Type"), ("items", "Items"),
                                             ("description", "Description"), ("enum", "Enum"),
                                             ("properties", "Properties"), ("required", "Required")) if fields[f])
    return GoStruct(fields, as_json=js)


def _tool(t: dict) -> GoStruct:
    fn = t.get("function") or {}
    params = fn.get("parameters") or {}
    props = GoJSONMap({k: _property(v) for k, v in (params.get("properties") or {}).items()}
                      if isinstance(params.get("properties"), dict) else {})
    pj = Ordered(type=params.get("type") or "")
    for k in ("$defs", "items", "required"):
        if params.get(k):
            pj[k] = params[k]
    pj["properties"] = props
    fj = Ordered(name=fn.get("name") or "", description=fn.get("description") or "", parameters=pj)
    tj = Ordered(type=t.get("type") or "function")
    if t.get("items"):
        tj["items"] = t["items"]
    tj["function"] = fj
    parameters = GoStruct({"Type": params.get("type") or "", "Defs": params.get("$defs"), "Items": params.get("items"),
                           "Required": list(params.get("required") or []), "Properties": props}, as_json=pj)
    return GoStruct({"Type": tj["type"], "Items": t.get("items"), "Function": GoStruct(
        {"Name": fj["name"], "Description": fj["description"], "Parameters": parameters}, as_json=fj)}, as_json=tj)


def _collate(messages: list[dict]) -> tuple[str, list[dict]]:
    """Ollama's collate: the system messages joined; consecutive messages of one role merged (not tool
    results)."""
    system: list[str] = []
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "system":
            system.append(_text(m.get("content")))
        if out and out[-1].get("role") == m.get("role") and m.get("role") != "tool":
            out[-1] = {**out[-1], "content": _text(out[-1].get("content")) + "\n\n" + _text(m.get("content"))}
        else:
            out.append(dict(m))
    return "\n\n".join(system), out


def render_ollama(text: str, messages: list[dict], *, tools: list[dict] | None = None, think: bool | None = None,
                  effort: str | None = None, out_limit: int = 4_000_000) -> str:
    """The prompt Ollama's template.Execute renders for a chat (see the module docstring)."""
    t = compile_ollama(text)
    system, msgs = _collate(messages)
    thinking = {"Think": bool(think), "ThinkLevel": effort or "" if think else "", "IsThinkSet": think is not None}
    if t.uses_messages:
        data = {"System": system, "Messages": [_message(m) for m in msgs],
                "Tools": GoJSONList(_tool(x) for x in tools) if tools else None, "Response": "", **thinking}
        return execute(t.tree, data, out_limit)
    out: list[str] = []
    size = 0
    sys_, prompt, response = "", "", ""

    def turn() -> None:
        nonlocal sys_, prompt, response, size
        piece = execute(t.tree, {"System": sys_, "Prompt": prompt, "Response": response, **thinking}, out_limit - size)
        out.append(piece)
        size += len(piece)
        sys_, prompt, response = "", "", ""

    for m in msgs:
        role = m.get("role")
        if role == "system":
            if prompt or response:
                turn()
            sys_ = _text(m.get("content"))
        elif role == "user":
            if response:
                turn()
            prompt = _text(m.get("content"))
        elif role == "assistant":
            response = _text(m.get("content"))
    out.append(execute(_cut_at_response(t.tree), {"System": sys_, "Prompt": prompt, "Response": response, **thinking},
                       out_limit - size))
    return "".join(out)
