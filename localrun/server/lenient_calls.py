"""Tool calls in the shapes small models actually write, not only in their template's markers.

Asked with tools, a small model often answers with the call as JSON outside the template's own
markers: in a fenced ```json block (text before and after it), as bare JSON, as a list of calls,
with "arguments" as a JSON string or named "parameters". :class:`LenientCalls` takes the content
as it streams and pulls such calls out of it:

- Where a call may start (a ```, ```json, ```tool_call or ```tool_code fence at a line's start; a
  ``{`` followed by ``"``; a ``[`` followed by ``{"``) the text is held until it is decided: the
  fence closes, or the brackets balance.
- It is a call when the JSON (an object, a list of objects, or several objects in one fence)
  names an offered tool and each object's arguments fit that tool's JSON schema (the schema is
  checked with ``jsonschema``, as the request's own schemas are). Accepted object shapes:
  ``{"name": N, "arguments": {..}}``, ``"arguments"`` as a JSON string, ``"parameters"`` for
  ``"arguments"``, OpenAI's ``{"type": "function", "function": {"name": N, "arguments": ..}}``;
  an object with any other key (a tool's definition echoed back) is not a call.
- Before the check, an argument the schema types as integer, number or boolean that the model
  wrote as a string reading exactly as one (``"0"``, ``"-12"``, ``"2.5"``, ``"true"``) is taken as
  that value (:func:`coerce`, as a tolerant client would); the call goes out with the typed
  value. Nothing else is loosened.
- Anything else (an unknown name, arguments that do not parse or do not fit, other JSON) is
  released as content, unchanged. A held piece over :data:`HOLD_MAX` characters is released as
  content without waiting for its end.

The content keeps the text around a call. ``LOCALRUN_TOOL_CALL_SHAPES=template`` turns this off
(only the template's own markers, and the bare JSON a forced call is written as).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

HOLD_MAX = 65536  # characters held while deciding whether a piece is a call; past this it is content
SHAPES = ("lenient", "template")
_FENCE_INFOS = ("", "json", "jsonc", "json5", "tool_call", "tool_calls", "tool_code", "tool", "function_call")
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}
_START = re.compile(r"[`{\[]")
_SEP = re.compile(r"[\s,]*")
_VALIDATORS: OrderedDict[str, Any] = OrderedDict()


def enabled() -> bool:
    """LOCALRUN_TOOL_CALL_SHAPES is lenient (the default)."""
    from localrun.config import settings

    try:
        return settings().tool_call_shapes == "lenient"
    except ValueError:
        return True


def _validator(schema: dict) -> Any:
    key = json.dumps(schema, sort_keys=True)
    v = _VALIDATORS.get(key)
    if v is None:
        import jsonschema

        cls = jsonschema.validators.validator_for(schema) if "$schema" in schema else jsonschema.Draft7Validator
        v = _VALIDATORS[key] = cls(schema)
        while len(_VALIDATORS) > 256:
            _VALIDATORS.popitem(last=False)
    else:
        _VALIDATORS.move_to_end(key)
    return v


_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def _scalar(value: str, kinds: list) -> Any:
    """`value` as the first of the schema's types it reads exactly as; itself when none."""
    if "string" in kinds:
        return value
    for kind in kinds:
        if kind == "integer" and _INT.fullmatch(value):
            return int(value)
        if kind == "number" and _NUM.fullmatch(value):
            f = float(value)
            return int(value) if _INT.fullmatch(value) else f
        if kind == "boolean" and value in ("true", "false"):
            return value == "true"
    return value


def coerce(args: dict, schema: Any) -> dict:
    """`args` with each string the schema types as integer, number or boolean (and reads exactly as
    one) turned into that value; nested objects' properties too. A new dict; nothing else changes."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(args, dict) or not isinstance(props, dict):
        return args
    out = dict(args)
    for key, value in args.items():
        sub = props.get(key)
        if not isinstance(sub, dict):
            continue
        kind = sub.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if isinstance(value, str):
            out[key] = _scalar(value, kinds)
        elif isinstance(value, dict) and "object" in kinds:
            out[key] = coerce(value, sub)
    return out


def fits(args: dict, schema: Any) -> bool:
    """`args` fit the tool's parameter schema (no schema: any object does)."""
    if not isinstance(schema, dict) or not schema:
        return True
    try:
        return bool(_validator(schema).is_valid(args))
    except Exception:  # noqa: BLE001 - a schema the validator cannot evaluate (an unresolvable $ref, ...)
        required = schema.get("required")
        return not isinstance(required, list) or all(k in args for k in required)


def _one(obj: Any, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) when `obj` is a call of an offered tool whose arguments fit."""
    if not isinstance(obj, dict):
        return None
    if "name" not in obj and isinstance(obj.get("function"), dict) and set(obj) <= {"type", "function", "id"}:
        obj = obj["function"]  # OpenAI's tool_calls entry
    name = obj.get("name")
    if not isinstance(name, str) or name not in tools or not set(obj) <= _CALL_KEYS:
        return None
    if "arguments" in obj and "parameters" in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments written as a JSON string
        try:
            args = json.loads(args, strict=False) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    schema = (tools.get(name) or {}).get("parameters")
    if not isinstance(args, dict):
        return None
    args = coerce(args, schema)
    if not fits(args, schema):
        return None
    return name, args


def calls_in(text: str, tools: dict[str, dict]) -> list[tuple[str, dict]] | None:
    """The calls `text` is made of: one JSON value (an object or a list of objects), or several
    separated by whitespace or commas; every one a call, else None."""
    found: list[tuple[str, dict]] = []
    dec = json.JSONDecoder(strict=False)  # models write code arguments with raw newlines in strings
    i = _SEP.match(text).end()
    while i < len(text):
        try:
            value, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        for obj in value if isinstance(value, list) and value else [value]:
            call = _one(obj, tools)
            if call is None:
                return None
            found.append(call)
        i = _SEP.match(text, i).end()
    return found or None


class _Brackets:
    """Where the bracket that opens a text balances, read as the text grows (JSON strings skipped)."""

    def __init__(self) -> None:
        self.depth, self.quoted, self.escaped, self.pos = 0, False, False, 0

    def close(self, text: str) -> int:
        """The index just past the balancing bracket, or -1 (not yet written)."""
        depth, quoted, escaped = self.depth, self.quoted, self.escaped
        for i in range(self.pos, len(text)):
            c = text[i]
            if quoted:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    self.__init__()
                    return i + 1
        self.depth, self.quoted, self.escaped, self.pos = depth, quoted, escaped, len(text)
        return -1

    def shift(self, n: int) -> None:
        """The text lost its first n characters."""
        self.pos -= n


class LenientCalls:
    """One choice's content -> the content to send now; the calls, at the end."""

    def __init__(self, tools: dict[str, dict], hold_max: int = HOLD_MAX) -> None:
        self.tools = tools
        self.hold_max = hold_max
        self.buf = ""  # text not yet released (from a possible call's start on)
        self.ws = ""  # whitespace released text ended with: sent with what follows (dropped after a last call)
        self.mode = "text"  # text | json | fence | spill_json | spill_fence
        self.body = 0  # fence: where its body starts in buf
        self.looked = 0  # fence: where the search for its closing ``` goes on
        self.scan = _Brackets()  # json: the brackets read so far
        self.line_blank = True  # only spaces since the last newline before buf
        self.sent = False  # something other than whitespace went out
        self.calls: list[tuple[str, dict]] = []

    @classmethod
    def run(cls, text: str, tools: dict[str, dict]) -> tuple[str, list[tuple[str, dict]]]:
        """The whole text at once: (content, calls)."""
        p = cls(tools)
        content = p.feed(text)
        rest, calls = p.finish()
        return content + rest, calls

    # -- releasing ------------------------------------------------------------------------------
    def _release(self, text: str) -> str:
        if not text:
            return ""
        self._consumed(text)
        body = text.rstrip()
        if not body:
            self.ws += text
            return ""
        out, self.ws = self.ws + body, text[len(body):]
        self.sent = True
        return out

    def _consumed(self, text: str) -> None:
        nl = text.rfind("\n")
        tail = text[nl + 1:] if nl >= 0 else text
        self.line_blank = (nl >= 0 or self.line_blank) and not tail.strip(" \t")

    def _blank_before(self, k: int) -> bool:
        """Only spaces and tabs between the last newline (or the output's start) and buf[k]."""
        nl = self.buf.rfind("\n", 0, k)
        return not self.buf[nl + 1:k].strip(" \t") and (nl >= 0 or self.line_blank)

    def _took(self, end: int, calls: list[tuple[str, dict]]) -> None:
        """buf[:end] was the calls: dropped."""
        self.calls.extend(calls)
        self.buf = self.buf[end:]
        self.line_blank, self.mode = False, "text"
        self.scan = _Brackets()

    # -- feeding --------------------------------------------------------------------------------
    def feed(self, text: str) -> str:
        self.buf += text
        out: list[str] = []
        while True:
            step = getattr(self, "_" + self.mode)()
            if step is None:
                return "".join(out)
            out.append(step)

    def _text(self) -> str | None:
        """Release the text up to where a call may start; None: wait for more."""
        pos = 0
        while True:
            m = _START.search(self.buf, pos)
            if m is None:
                if not self.buf:
                    return None
                piece, self.buf = self.buf, ""
                return self._release(piece)
            k = m.start()
            verdict = self._starts(k)
            if verdict == "no":
                pos = k + 1
                continue
            if k:  # the text before the candidate goes out now
                piece, self.buf = self.buf[:k], self.buf[k:]
                return self._release(piece)
            if verdict == "wait":
                return None
            self.mode, self.scan = verdict, _Brackets()
            return ""

    def _starts(self, k: int) -> str:
        """What buf[k] starts: "json", "fence" (body from self.body), "no", or "wait" (not known yet)."""
        s = self.buf
        c = s[k]
        if c == "`":
            if not self._blank_before(k):
                return "no"
            if not s.startswith("```", k):
                return "wait" if "```".startswith(s[k:]) else "no"
            nl = s.find("\n", k + 3)
            info = (s[k + 3:] if nl < 0 else s[k + 3:nl]).strip().lower()
            if nl < 0:  # the info string is still being written
                if len(info) > 20 or not any(f.startswith(info) for f in _FENCE_INFOS if f):
                    return "wait" if not info else "no"
                return "wait"
            if info not in _FENCE_INFOS:
                return "no"
            self.body, self.looked = nl + 1 - k, 0
            return "fence"
        want = ['"'] if c == "{" else ["{", '"']
        i = k + 1
        for w in want:
            while i < len(s) and s[i].isspace():
                i += 1
            if i >= len(s):
                return "wait"
            if s[i] != w:
                return "no"
            i += 1
        return "json"

    def _json(self) -> str | None:
        end = self.scan.close(self.buf)
        if end < 0:
            if len(self.buf) > self.hold_max:  # too long to hold: content, to its balancing bracket
                self.mode = "spill_json"
                return self._spill_json()
            return None
        return self._decide(self.buf[:end], end)

    def _decide(self, body: str, end: int) -> str | None:
        """buf[:end] is whole (a balanced JSON value or a closed fence around `body`): the calls it holds, or
        content released as it was."""
        calls = calls_in(body, self.tools)
        if calls:
            self._took(end, calls)
            return ""
        piece, self.buf = self.buf[:end], self.buf[end:]
        self.mode = "text"
        return self._release(piece)

    def _spill_json(self) -> str | None:
        if not self.buf:
            return None
        end = self.scan.close(self.buf)
        if end >= 0:
            self.mode = "text"
        piece, self.buf = (self.buf, "") if end < 0 else (self.buf[:end], self.buf[end:])
        if end < 0:
            self.scan.shift(len(piece))
        return self._release(piece)

    def _find_close(self) -> int:
        """The closing ``` of the fence in buf (searched from where the last look ended), or -1."""
        close = self.buf.find("```", max(self.body, self.looked))
        self.looked = max(self.body, len(self.buf) - 2) if close < 0 else 0
        return close

    def _fence(self) -> str | None:
        close = self._find_close()
        if close < 0:
            if len(self.buf) > self.hold_max:  # too long to hold: content, to the fence's close
                self.mode = "spill_fence"
                return self._spill_fence()
            return None
        return self._decide(self.buf[self.body:close], close + 3)

    def _spill_fence(self) -> str | None:
        if not self.buf:
            return None
        close = self._find_close()
        if close < 0:
            keep = len(self.buf) - max(self.looked, self.body)  # a ``` may be coming
            piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            self.body, self.looked = 0, 0
            return self._release(piece) if piece else None
        piece, self.buf = self.buf[:close + 3], self.buf[close + 3:]
        self.mode, self.body = "text", 0
        return self._release(piece)

    def finish(self) -> tuple[str, list[tuple[str, dict]]]:
        """(the content still to send, every call found). An unclosed fence whose body is whole
        calls (the model stopped before the closing ```) is still a call."""
        out = []
        if self.mode == "fence":
            calls = calls_in(self.buf[self.body:], self.tools)
            if calls:
                self._took(len(self.buf), calls)
        elif self.mode in ("text", "json") and self.buf:  # a candidate still undecided (or cut short)
            calls = calls_in(self.buf, self.tools)
            if calls:
                self._took(len(self.buf), calls)
        if self.buf:
            out.append(self.ws + self.buf)
        elif not self.calls:
            out.append(self.ws)  # text untouched when no call was taken from it
        self.buf, self.ws, self.mode = "", "", "text"
        return "".join(out), self.calls


__all__ = ["LenientCalls", "calls_in", "coerce", "fits", "enabled", "HOLD_MAX", "SHAPES"]
