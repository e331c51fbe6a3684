"""A model's tool-call syntax, learned from its own chat template.

The template is rendered (in the sandbox) twice with a known probe conversation: once with an
assistant turn that makes a probe tool call, once with an assistant turn that only answers. The text
the two differ by is the call as the template writes it; the probe's name, argument keys and values
are located in it, and what surrounds them becomes the pattern that parses the model's calls (the way
llama.cpp's common/chat-auto-parser learns a format). Two shapes are learned:

- ``json``: the arguments are one JSON object (Hermes ``<tool_call>{"name": .., "arguments": ..}``,
  Llama 3.x ``{"name": .., "parameters": ..}``, Mistral ``[TOOL_CALLS]name[ARGS]{..}``, Kimi, gpt-oss
  ``to=functions.name ... <|message|>{..}<|call|>``, functionary, Solar, Cohere, ...);
- ``kv``: each argument is written as key and value between markers (Qwen3-Coder
  ``<parameter=k>v</parameter>``, GLM ``<arg_key>k</arg_key><arg_value>v</arg_value>``, DeepSeek
  DSML, MiniMax, Seed, Hy, MiniCPM, ...); values are typed by the tool's JSON schema.

Several calls in one turn: a render of two probe calls teaches what joins one call to the next
(``</tool_call><tool_call>``, ``}, {`` inside a JSON list, Kimi's next ``<|tool_call_begin|>``, with a
call's index generalized). Hand-written where a format needs one: Gemma 4's ``<|"|>``-quoted
strings and the LFM2 pythonic list (``[name(k='v', n=2)]``, read with ``ast.literal_eval``).
A template that cannot render the probe (or whose call carries neither shape) learns nothing and
the generic Hermes/bare-JSON parsing applies. Learning is cached per template text and bounded
like any render (the sandbox's size, time and memory limits).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from localrun.server.lenient_calls import coerce

PROBE_NAME = "lr_probe_fn"
PROBE_ID = "a1b2c3d4e"  # Mistral's templates want 9 alphanumerics
PROBE_ARGS = {"lr_key_a": "lr value a", "lr_key_b": 17}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"lr_key_a": {"type": "string", "description": "a"},
                                                     "lr_key_b": {"type": "integer", "description": "b"}},
                   "required": ["lr_key_a"]}}}]
_USER = {"role": "user", "content": "lr probe question"}
_ANSWER = "lr probe answer"
_NAME_RE = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_PUNCT = set("{}[],:")
_PY_NEXT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)\(")


def _flex(literal: str) -> str:
    """A literal as a regex that tolerates other whitespace (and none) around JSON punctuation."""
    out, i = [], 0
    while i < len(literal):
        c = literal[i]
        if c.isspace():
            while i < len(literal) and literal[i].isspace():
                i += 1
            out.append(r"\s*")
            continue
        out.append(r"\s*" + re.escape(c) + r"\s*" if c in _PUNCT else re.escape(c))
        i += 1
    s = "".join(out)
    while r"\s*\s*" in s:
        s = s.replace(r"\s*\s*", r"\s*")
    return s


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    while n < min(len(a), len(b)) - limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


@dataclass(frozen=True)
class ToolFormat:
    """One template's call syntax: `head` finds a call's start and name, then the arguments."""

    kind: str  # "json" | "kv" | "pythonic"
    opener: str  # the text a call starts with (what streaming holds back on), stripped
    head: re.Pattern  # from the opener through the name (json: up to the arguments)
    tail: re.Pattern | None = None  # json: after the arguments; kv: after the last argument
    arg: re.Pattern | None = None  # kv: one argument (groups k, v)
    cont: re.Pattern | None = None  # from one call's arguments to the next call's (several calls in one block)
    specials: tuple[str, ...] = ()  # marker texts in the call (the backend keeps those that are special tokens)

    @property
    def marker(self) -> str | None:
        """The fixed text every call starts with (what streaming holds content back on), or None
        when a call starts as bare JSON (the parser's bare-JSON rule covers that)."""
        m = re.match(r"[^\s{\[]+(?:\[[A-Z_]+\])?", self.opener.split(PROBE_ID)[0])
        if self.opener.startswith("[") and not self.opener.startswith("[{"):  # [TOOL_CALLS], [get_weather(
            m = re.match(r"\[[A-Z_]+\]", self.opener)
        return m.group(0) if m else None

    def parse(self, text: str, tools: dict[str, dict]) -> tuple[str, list[tuple[str, dict]]]:
        """(text with the calls taken out, [(name, arguments)]) for every call found in `text`."""
        calls: list[tuple[str, dict]] = []
        kept: list[str] = []
        pos = 0
        while True:
            m = self.head.search(text, pos)
            if m is None:
                break
            got = self._one(text, m, tools)
            if got is None:
                kept.append(text[pos:m.start() + 1])
                pos = m.start() + 1
                continue
            end, found = got
            kept.append(text[pos:m.start()])
            calls.extend(found)
            pos = end
        kept.append(text[pos:])
        return "".join(kept), calls

    def _one(self, text: str, m: re.Match, tools: dict[str, dict]) -> tuple[int, list[tuple[str, dict]]] | None:
        """The call (or calls: a block may hold several) that `m` starts: (end, [(name, args)])."""
        name = m.group("name")
        if name not in tools:
            return None
        if self.kind == "pythonic":  # [a(k=1), b(k=2)]
            found: list[tuple[str, dict]] = []
            while m is not None and m.group("name") in tools:
                got = _pythonic(text, m, m.group("name"))
                if got is None:
                    break
                end = got[0]
                found.append((got[1], got[2]))
                m = _PY_NEXT.match(text, end)
            return (end, found) if found else None
        calls: list[tuple[str, dict]] = []
        i = m.end()
        while True:
            got = self._args(text, i, name, tools)
            if got is None:
                if not calls:
                    return None
                break
            i, args = got
            calls.append((name, args))
            c = self.cont.match(text, i) if self.cont is not None else None
            if c is None or c.group("name") not in tools:
                break
            name, before = c.group("name"), i
            i = c.end()
            if self._args(text, i, name, tools) is None:
                i = before
                break
        t = self.tail.match(text, i) if self.tail is not None else None
        return (t.end() if t else i), calls

    def _args(self, text: str, i: int, name: str, tools: dict[str, dict]) -> tuple[int, dict] | None:
        """A call's arguments at text[i:]: (end, arguments)."""
        if self.kind == "json":
            while i < len(text) and text[i].isspace():
                i += 1
            try:  # strict=False: a raw newline inside a string (code in an argument) is still read
                args, j = json.JSONDecoder(strict=False).raw_decode(text, i)
            except ValueError:
                return None
            if isinstance(args, str):  # arguments written as a JSON string
                try:
                    args = json.loads(args, strict=False)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(args, dict):
                return None
            return j, coerce(args, (tools.get(name) or {}).get("parameters"))  # "0" for an integer -> 0
        props = ((tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args: dict[str, Any] = {}
        while True:
            a = self.arg.match(text, i)
            if a is None:
                break
            key, quoted = a.group("k"), a.groupdict().get("q")
            args[key] = quoted if quoted is not None else _typed(a.group("v"), (props.get(key) or {}).get("type"))
            i = a.end()
        return i, args


def _typed(raw: str, kind: Any) -> Any:
    raw = raw.strip()
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def _pythonic(text: str, m: re.Match, name: str) -> tuple[int, str, dict] | None:
    """``name(k='v', n=2)`` at m.end() - 1 (the head ends at the open parenthesis)."""
    depth, i, quote = 0, m.end() - 1, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                break
        i += 1
    else:
        return None
    try:
        call = ast.parse(name + text[m.end() - 1:i + 1], mode="eval").body
        args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}  # literals only: never evaluated code
    except (SyntaxError, ValueError, AttributeError, TypeError, RecursionError):
        return None
    j = i + 1
    while j < len(text) and text[j] in " ,]":
        j += 1
    return j, name, args


def _region(template: str, n: int = 1) -> str | None:
    """The text `n` probe calls add to an assistant turn (the turn's framing removed)."""
    from localrun.templates.chat import render_chat

    try:
        plain = render_chat(template, [_USER, {"role": "assistant", "content": _ANSWER}],
                            add_generation_prompt=False, tools=_PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe teaches nothing
        return None
    with_call = None
    # arguments as an object (the transformers convention), else as a JSON string (some templates want that)
    for arguments in (dict(PROBE_ARGS), json.dumps(PROBE_ARGS)):
        call = {"id": PROBE_ID, "type": "function", "function": {"name": PROBE_NAME, "arguments": arguments}}
        try:
            with_call = render_chat(template, [_USER, {"role": "assistant", "content": "", "tool_calls": [call] * n}],
                                    add_generation_prompt=False, tools=_PROBE_TOOLS)
            break
        except Exception:  # noqa: BLE001
            continue
    if with_call is None:
        return None
    p = _common_prefix(with_call, plain)
    lt = with_call.rfind("<", 0, p)
    if lt > with_call.rfind(">", 0, p):  # the two differ inside a marker: start at the marker
        p = lt
    if with_call.startswith(PROBE_NAME, p):  # the text that introduces the name belongs to the call
        while p > 0 and not (with_call[p - 1].isspace() or with_call[p - 1] == ">"):
            p -= 1
    s = _common_suffix(with_call, plain, p)
    region = with_call[p:len(with_call) - s]
    return region if PROBE_NAME in region else None


def _opener(prefix: str) -> str:
    """The call's opening text: what precedes the name, less the turn framing before it (an
    emptied think block, blank lines)."""
    low = prefix.lower()
    for close in ("think>", "thinking|>"):
        k = low.rfind(close)
        if k >= 0:
            prefix, low = prefix[k + len(close):], low[k + len(close):]
    return prefix.lstrip()


def _literal(s: str, name_seen: bool) -> str:
    """A learned literal as a regex: the probe name (after its first use) and the probe id generalized."""
    parts = []
    for piece in re.split(f"({re.escape(PROBE_NAME)}|{re.escape(PROBE_ID)})", s):
        if piece == PROBE_NAME and name_seen:
            parts.append("(?P=name)")
        elif piece == PROBE_ID:
            parts.append(r"[A-Za-z0-9_\-]+")
        elif piece:  # a call's index in a block (Kimi's functions.name:0, Cohere's "tool_call_id": "0") counts up
            parts.extend(r"\d+" if k % 2 else _flex(x) for k, x in enumerate(re.split(r"(\d+)", piece)) if x)
    return "".join(parts)


# what a special token looks like: <|x|>, <｜x｜>, [TOOL_CALLS], <tool_call>, <|tool_call>, <TOOLCALL>
_SPECIAL_RE = re.compile(r"</?｜[^<>｜\s]{1,40}｜|<\|[^<>|\s]{1,40}\|>|<｜[^<>｜\s]{1,40}｜>|\[[A-Z_]{2,30}\]|</?[A-Za-z_|:.\-]{1,40}\|?>")


@lru_cache(maxsize=64)
def learn(template: str | None) -> ToolFormat | None:
    """The tool-call format `template` writes, or None (then the generic parsing applies)."""
    if not template or "tool" not in template:
        return None
    fmt = _learn(template)
    if fmt is None:
        return None
    region = _region(template, 2) or _region(template) or ""
    return dataclasses.replace(fmt, specials=tuple(sorted(set(_SPECIAL_RE.findall(region)))))


def _learn(template: str) -> ToolFormat | None:
    region = _region(template)
    if region is None:
        return None
    n = region.find(PROBE_NAME)
    opener = _opener(region[:n])
    after = region[n + len(PROBE_NAME):]
    head_re = _literal(opener, False) + f"(?P<name>{_NAME_RE})"
    # the arguments as one JSON object?
    for i in [k for k, c in enumerate(after) if c == "{"]:
        try:
            obj, j = json.JSONDecoder().raw_decode(after, i)
        except ValueError:
            continue
        if obj == PROBE_ARGS:
            between, rest = after[:i], after[j:]
            head = re.compile(head_re + _literal(between, True), re.S)
            fmt = ToolFormat("json", opener.strip(), head, re.compile(_literal(rest, True), re.S))
            return _with_cont(template, fmt, region, _literal(between, True))
    # pythonic: name(k='v', ...)
    if after.startswith("(") and "lr_key_a='lr value a'" in after or "lr_key_a=\"lr value a\"" in after:
        return ToolFormat("pythonic", opener.strip(), re.compile(head_re + r"\(", re.S))
    # Gemma 4: call:name{key:<|"|>string<|"|>,key:value}
    if after.startswith("{") and '<|"|>' in after:
        arg = re.compile(r'\s*,?\s*(?P<k>[A-Za-z0-9_\-]+)\s*:\s*(?:<\|"\|>(?P<q>.*?)<\|"\|>|(?P<v>[^,}]*))', re.S)
        return ToolFormat("kv", opener.strip(), re.compile(head_re + r"\s*\{", re.S), re.compile(r"\s*\}"), arg)
    # key/value markers
    ka, va = after.find("lr_key_a"), after.find("lr value a")
    kb = after.find("lr_key_b")
    vb = after.find("17", kb + 1) if kb >= 0 else -1
    if not (0 <= ka < va < kb < vb):
        return None
    name_to_key = after[:ka]
    mid_a, mid_b = after[ka + 8:va], after[kb + 8:vb]
    between = after[va + len("lr value a"):kb]
    post = after[vb + 2:]
    o = _common_suffix(name_to_key, between, 0)
    arg_open, name_tail, arg_close = between[len(between) - o:], name_to_key[:len(name_to_key) - o], between[:len(between) - o]
    if mid_a == mid_b:
        mid = _literal(mid_a, True)
    else:  # the marker between key and value carries the value's type: keep what both share
        cp = _common_prefix(mid_a, mid_b)
        cs = _common_suffix(mid_a, mid_b, cp)
        mid = _literal(mid_a[:cp], True) + r"[^\n]*?" + _literal(mid_a[len(mid_a) - cs:], True)
    close = _literal(arg_close, True).replace(re.escape("lr_key_a"), "(?P=k)")
    mid = mid.replace(re.escape("lr_key_a"), "(?P=k)")
    # a key in the closing marker (MiniMax's <city>v</city>) is the same key
    arg = re.compile(r"\s*" + _literal(arg_open, True) + r"(?P<k>[^\s<>=\"':]+?)" + mid + r"(?P<v>.*?)" + close, re.S)
    if post.startswith(arg_close):
        post = post[len(arg_close):]
    head = re.compile(head_re + _literal(name_tail, True), re.S)
    fmt = ToolFormat("kv", opener.strip(), head, re.compile(r"\s*" + _literal(post, True), re.S), arg)
    return _with_cont(template, fmt, region, _literal(name_tail, True))


def _with_cont(template: str, fmt: ToolFormat, region: str, after_name: str) -> ToolFormat:
    """`fmt`, with what joins one call to the next when the template writes two calls in one block
    (a JSON list, a section holding several calls), learned from a render of two probe calls."""
    two = _region(template, 2)
    per_call = region.count(PROBE_NAME)
    if two is None or two.count(PROBE_NAME) != 2 * per_call:
        return fmt
    m = fmt.head.search(two)
    tools = {PROBE_NAME: _PROBE_TOOLS[0]["function"]}
    got = fmt._args(two, m.end(), PROBE_NAME, tools) if m else None
    if got is None:
        return fmt
    second = m.start()
    for _ in range(per_call + 1):
        second = two.find(PROBE_NAME, second) + (0 if _ == per_call else len(PROBE_NAME))
    joint = two[got[0]:second]
    if not joint.strip() or PROBE_NAME in joint:
        return fmt
    cont = re.compile(_literal(joint, False) + f"(?P<name>{_NAME_RE})" + after_name, re.S)
    return ToolFormat(fmt.kind, fmt.opener, fmt.head, fmt.tail, fmt.arg, cont)


def utf8_safe(text: str) -> str:
    """`text` with any lone surrogate as U+FFFD. A model may write one as a JSON escape ("\\ud800",
    which the grammar allows and json.loads keeps); UTF-8 cannot encode it, so the response (or
    the stream) would fail on it."""
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def call_arguments(args: object) -> str:
    """A call's arguments as the JSON string the APIs send."""
    return utf8_safe(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


__all__ = ["ToolFormat", "learn", "PROBE_NAME", "PROBE_ARGS", "call_arguments", "utf8_safe"]
