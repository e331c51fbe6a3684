"""Go's text/template language, the part Ollama's templates use: recognised, lexed and parsed to tuples.

Actions with ``{{-`` / ``-}}`` trim markers, comments, pipelines with ``|``, parenthesized pipelines,
variables declared with ``:=`` and set with ``=``, if / else if / else, range (``$i, $x :=``; break and
continue) and with. ``define``, ``template`` and ``block`` are refused (400): Ollama's templates do not
use them.
"""

from __future__ import annotations

import json
import re
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
class GoPipe:
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


def _pipeline(toks: list, allow_decl: bool = False, range_decl: bool = False) -> GoPipe:
    pipe = GoPipe()
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

