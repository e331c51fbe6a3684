"""What the model wrote, split into what the APIs send: reasoning, content, tool calls.

:class:`OutputParser` takes one choice's streamed text piece by piece and returns the
pieces of reasoning and of content that may go out now; at the end it returns the tool
calls it found. Text is held back only while it could still turn into a marker
(``</think>``) or a tool call, so answers without either stream untouched.

- Reasoning: models whose template thinks in ``<think>…</think>`` (Qwen3, DeepSeek-R1
  distills, or a model's own markers). When the rendered prompt already opened the think
  block (the template appended ``<think>``), the output starts inside it.
- Tool calls: in the syntax the model's own template writes them (learned from the template by
  :mod:`localrun.server.tool_formats`: Mistral ``[TOOL_CALLS]``, Qwen3-Coder XML, GLM, DeepSeek,
  Kimi, gpt-oss, Gemma 4, LFM2, ...); else Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks
  anywhere in the output, or an output that is one JSON object (or list) naming a known tool
  (what a forced call produces). Content before a call's opening marker streams; the call
  itself is held to the end.
- gpt-oss (harmony): :class:`HarmonyParser` reads the channels instead.
- The generic tool format (server/generic_tools.py, a template that cannot render tools): the
  output is one JSON object; the answer's string streams as it is written, calls are parsed whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localrun.server.lenient_calls import LenientCalls
from localrun.server.tool_formats import ToolFormat, call_arguments

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN = "<tool_call>"
_RESPONSE_OPEN = re.compile(r'\{\s*"response"\s*:\s*"')  # the generic format's answer begins
_CALLS_OPEN = re.compile(r'\s*\{\s*"tool_calls"\s*:')  # the generic format's calls begin
_RESPONSE_KEY = '{"response":"'
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class Reasoning:
    """How a model marks its thinking, and whether the prompt already opened it."""

    open: str = THINK_OPEN
    close: str = THINK_CLOSE
    started: bool = False  # the rendered prompt ends inside an open think block


def reasoning_for(template: str | None, prompt: str) -> Reasoning | None:
    """A Reasoning spec when the model's template thinks in <think> blocks, else None."""
    if not template or THINK_OPEN not in template:
        return None
    tail = prompt.rstrip()
    opened = tail.rfind(THINK_OPEN)
    return Reasoning(started=opened >= 0 and tail.find(THINK_CLOSE, opened) < 0 and tail.endswith(THINK_OPEN))


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[dict]]:
    """(content without the calls, [{"id", "name", "arguments" (a JSON string)}])."""
    candidates = _TOOL_CALL_RE.findall(text)
    content = _TOOL_CALL_RE.sub("", text).strip() if candidates else ""
    if not candidates:
        candidates = [text.strip()]
    calls = []
    for c in candidates:
        try:  # strict=False: models write code arguments with raw newlines in the strings; the
            obj = json.loads(c, strict=False)  # arguments go out re-encoded, as valid JSON
        except (ValueError, RecursionError):
            continue
        for o in obj if isinstance(obj, list) else [obj]:
            if isinstance(o, dict) and o.get("name") in names:
                args = o.get("arguments", o.get("parameters", {}))
                calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": o["name"],
                              "arguments": call_arguments(args)})
    if not calls:
        return text, []
    return content, calls


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]
_HARMONY_END = ("<|end|>", "<|return|>", "<|call|>")
_HARMONY_TO = re.compile(r"to=(?:functions\.)?([A-Za-z0-9_][A-Za-z0-9_.\-]*)")


def is_harmony(template: str | None) -> bool:
    """gpt-oss's harmony format: messages on channels (analysis, commentary, final)."""
    return bool(template) and "<|channel|>" in template and "<|message|>" in template  # type: ignore[operator]


def _harmony_head(buf: str) -> bool:
    """`buf` is (or may become) a harmony message header: a channel token, or the recipient first."""
    s = buf.lstrip()
    return any(t.startswith(s[:len(t)]) for t in [*HARMONY_TOKENS, "to="])


class HarmonyParser:
    """gpt-oss output: ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
    <|message|>...``: analysis -> reasoning, final (and commentary without a recipient) -> content,
    a message to ``functions.NAME`` -> a tool call (its JSON body held to the end). Text before any
    channel header is content."""

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names or set()
        self.buf = ""
        self.state = "start"  # start | header | body
        self.channel, self.recipient = "", ""
        self.call_body = ""
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state in ("start", "header"):
                i = self.buf.find("<|message|>")
                if i < 0:
                    if self.state == "start" and not _harmony_head(self.buf):
                        self.state = "plain"
                        continue
                    return reasoning, content
                header = self.buf[:i]
                self.buf = self.buf[i + len("<|message|>"):]
                m = re.search(r"<\|channel\|>\s*([A-Za-z]+)", header)
                self.channel = m.group(1) if m else "final"
                to = _HARMONY_TO.search(header)
                self.recipient = to.group(1) if to else ""
                self.state = "body"
                continue
            if self.state == "plain":  # not harmony-framed at all
                content += self.buf
                self.buf = ""
                return reasoning, content
            ends = [(k, e) for e in _HARMONY_END if (k := self.buf.find(e)) >= 0]
            if ends:
                k, e = min(ends)
                piece, self.buf = self.buf[:k], self.buf[k + len(e):]
            else:
                keep = max(_partial(self.buf, e) for e in _HARMONY_END)
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            r, c = self._route(piece)
            reasoning, content = reasoning + r, content + c
            if not ends:
                return reasoning, content
            self._close()
            self.state = "header"
            start = self.buf.find("<|channel|>")
            if start < 0 and self.buf and not any(t.startswith(self.buf[:len(t)]) or self.buf.startswith(t)
                                                  for t in HARMONY_TOKENS):
                self.state = "plain"

    def _route(self, piece: str) -> tuple[str, str]:
        if self.recipient:
            self.call_body += piece
            return "", ""
        return (piece, "") if self.channel == "analysis" else ("", piece)

    def _close(self) -> None:
        if self.recipient:
            name, body = self.recipient, self.call_body.strip()
            self.recipient, self.call_body = "", ""
            if name in self.tool_names:
                try:
                    args = json.loads(body) if body else {}
                except (ValueError, RecursionError):
                    args = None
                if isinstance(args, dict):
                    self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
                                       "arguments": call_arguments(args)})

    def finish(self) -> tuple[str, str, list[dict]]:
        reasoning, content = "", ""
        if self.state == "body":
            r, c = self._route(self.buf)
            reasoning, content = r, c
            self._close()
        elif self.state == "plain" or (self.state == "start" and self.buf):
            content = self.buf
        self.buf = ""
        return reasoning, content, self.calls


class OutputParser:
    """One choice's text -> (reasoning, content) pieces as they stream, then tool calls."""

    def __init__(self, reasoning: Reasoning | None = None, tool_names: set[str] | None = None,
                 tool_format: ToolFormat | None = None, tools: list[dict] | None = None, generic: bool = False,
                 forced: bool = False, lenient: bool = False) -> None:
        self.reasoning = reasoning
        self.forced = forced  # the output is a call the grammar forces (tool_choice required / any / a name)
        self.generic = generic  # the generic tool format: the output is one JSON object (server/generic_tools.py)
        self.g_mode: str | None = None  # generic: None (not yet known) | "string" (in the answer) | "done" | "json"
        self.g_raw = ""  # generic: the answer's JSON string not yet decoded
        self.tool_names = tool_names or set()
        self.tool_format = tool_format
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if isinstance(t.get("function"), dict)}
        for name in self.tool_names:
            self.tools.setdefault(name, {})
        self.markers = [TOOL_OPEN]  # a call may start at any of these
        if tool_format is not None and tool_format.marker and tool_format.marker != TOOL_OPEN:
            self.markers.insert(0, tool_format.marker)
        # "think?": the output may open a think block; "think": inside one; "content": after
        self.state = "content" if reasoning is None else ("think" if reasoning.started else "think?")
        self.pending = ""  # text not yet classified (a possible marker)
        self.held = ""  # content held back because it may be a tool call
        self.holding = False
        self.content_sent = ""  # content given out so far (tool calls are parsed from it + held)
        self.after_think = False  # just left a think block: drop the whitespace that follows it
        # calls outside the template's markers (fenced/bare JSON, lists): server/lenient_calls.py
        self.lenient = LenientCalls(self.tools) if lenient and self.tool_names and not generic else None

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (reasoning, content) that may be sent now."""
        self.pending += text
        reasoning, content = "", ""
        while True:
            if self.state == "think?":
                stripped = self.pending.lstrip()
                if stripped.startswith(self.reasoning.open):
                    self.pending = stripped[len(self.reasoning.open):]
                    self.state = "think"
                    continue
                if self.reasoning.open.startswith(stripped):  # maybe still coming
                    return reasoning, self._content(content)
                self.state = "content"
                continue
            if self.state == "think":
                close = self.reasoning.close
                i = self.pending.find(close)
                if i >= 0:
                    reasoning += self.pending[:i]
                    self.pending = self.pending[i + len(close):]
                    self.state, self.after_think = "content", True
                    continue
                keep = _partial(self.pending, close)
                reasoning += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, self._content(content)
            if self.after_think:  # the answer starts after the blank lines that follow </think>
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return reasoning, self._content(content)
                self.after_think = False
            content += self.pending
            self.pending = ""
            return reasoning, self._content(content)

    def _content(self, text: str) -> str:
        """Content that may go out now: all of it, unless it may be (part of) a tool call."""
        out = self._marked(text)
        return self.lenient.feed(out) if self.lenient is not None and out else out

    def _marked(self, text: str) -> str:
        """_content, for the template's markers (and a bare JSON output, when lenient shapes are off)."""
        if not self.tool_names or not text:  # (content_sent is read only when tools are on)
            return text
        if self.generic:  # one JSON object: an answer streams as its string is written; calls are held
            return self._generic(text)
        if self.holding:
            self.held += text
            return ""
        buf = text
        if not (self.content_sent + buf).strip():  # only whitespace so far: wait to see what starts
            self.held += buf
            return ""
        start = self.held + buf
        self.held = ""
        lead = (self.content_sent + start).lstrip()
        bare = self.lenient is None or (self.tool_format is not None and self.tool_format.marker is None)
        if bare and not self.content_sent.strip() and lead[:1] in ("{", "["):  # a bare JSON call (or pythonic list)
            self.holding, self.held = True, start
            return ""
        if not self.content_sent.strip() and self.tool_format is not None and not self.tool_format.opener:
            # the template writes a call as the tool's name first (functionary's `name\n{...}`)
            if any(lead.startswith(n) for n in self.tool_names):
                self.holding, self.held = True, start
                return ""
            if any(n.startswith(lead) for n in self.tool_names):  # maybe a name still coming
                self.held = start
                return ""
        found = [k for k in (start.find(m) for m in self.markers) if k >= 0]
        i = min(found) if found else -1
        if i < 0:
            i = len(start) - max(_partial(start, m) for m in self.markers)
            if i == len(start):
                self.content_sent += start
                return start
            self.held = start[i:]  # maybe the start of a call's marker: wait for more
            self.content_sent += start[:i]
            return start[:i]
        self.holding, self.held = True, start[i:]
        self.content_sent += start[:i]
        return start[:i]

    def _generic(self, text: str) -> str:
        if self.g_mode == "json":
            self.held += text
            return ""
        if self.g_mode is None:
            self.held += text
            compact = "".join(self.held.split())
            m = _RESPONSE_OPEN.match(self.held.lstrip())
            if m is None:
                if not _RESPONSE_KEY.startswith(compact):
                    self.g_mode = "json"  # tool calls (or something else): parsed whole at the end
                return ""
            self.g_mode, self.g_raw, self.held = "string", self.held.lstrip()[m.end():], ""
        elif self.g_mode == "string":
            self.g_raw += text
        else:  # "done": what follows the closing quote is the object's end
            return ""
        out, i, raw = [], 0, self.g_raw
        while i < len(raw):
            ch = raw[i]
            if ch == '"':
                self.g_mode = "done"
                i = len(raw)
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            size = 6 if raw[i + 1:i + 2] == "u" else 2
            if size == 6 and raw[i + 2:i + 3].lower() == "d" and raw[i + 3:i + 4].lower() in "89ab":
                size = 12  # a high surrogate: decoded with its pair
            if i + size > len(raw):
                break  # a half-written escape: wait for the rest
            try:
                out.append(json.loads('"' + raw[i:i + size] + '"').encode("utf-8", "replace").decode("utf-8"))
            except ValueError:  # not an escape JSON has (the grammar allows none): as written
                out.append(raw[i:i + size])
            i += size
        self.g_raw = raw[i:]
        piece = "".join(out)
        self.content_sent += piece
        return piece

    def finish(self) -> tuple[str, str, list[dict]]:
        """At the end: (reasoning, content, tool calls) still to send."""
        reasoning, content = "", ""
        if self.state == "think":
            reasoning, self.pending = self.pending, ""
        else:
            content, self.pending = ("" if self.after_think else self.pending), ""
        rest = self.held + content
        self.held = ""
        if not self.tool_names:
            return reasoning, rest, []
        if self.generic and self.g_mode in ("string", "done"):
            return reasoning, "", []  # the answer went out as it was written
        if self.generic:
            from localrun.server.generic_tools import parse

            parsed = parse(rest, self.tool_names)
            if parsed is not None:
                return reasoning, parsed[0], parsed[1]
            if _CALLS_OPEN.match(rest):  # a call cut short (max_tokens) before one was whole: no text
                return reasoning, "", []
        pre, early = "", []
        if self.lenient is not None:
            if not self.holding:  # rest is content (a marker's start at most): the lenient shapes read it
                pre, rest = self.lenient.feed(rest), ""
            tail, early = self.lenient.finish()
            pre += tail
        content_left, calls = self._marked_calls(rest)
        if self.lenient is not None and content_left:  # a fenced call after a template's call, ...
            content_left, more = LenientCalls.run(content_left, self.tools)
            calls += more
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": call_arguments(args)}
                 for name, args in early] + calls
        if calls:
            content = pre + content_left
            return reasoning, (content.strip() if not self.lenient or not self.lenient.sent else content.rstrip()), calls
        if self.forced:  # a forced call cut short (max_tokens): never its wrapper as text (no answer was asked)
            return reasoning, "", []
        return reasoning, pre + rest, []

    def _marked_calls(self, rest: str) -> tuple[str, list]:
        """(content left, calls) from text in the template's markers, or a bare JSON output."""
        if not rest:
            return "", []
        if self.tool_format is not None:
            left, found = self.tool_format.parse(rest, self.tools)
            if found:
                calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
                          "arguments": call_arguments(args)} for name, args in found]
                return left.strip(), calls
        content_left, calls = parse_tool_calls(rest, self.tool_names)
        return (content_left, calls) if calls else (rest, [])


def is_forced_call(schema: object) -> bool:
    """`schema` is the one params.tool_choice_schema makes for a forced call: {name (a const), arguments},
    or an anyOf of such objects."""
    variants = schema.get("anyOf", [schema]) if isinstance(schema, dict) else []
    return bool(variants) and all(
        isinstance(v, dict) and v.get("required") == ["name", "arguments"]
        and isinstance((v.get("properties") or {}).get("name"), dict) and "const" in v["properties"]["name"]
        for v in variants)


__all__ = ["OutputParser", "HarmonyParser", "is_forced_call", "HARMONY_TOKENS", "is_harmony", "Reasoning", "reasoning_for",
           "parse_tool_calls"]
