"""gpt-oss's harmony format: its output read into reasoning, content and tool calls; its chats made renderable.

The model writes messages on channels (the openai-harmony spec; the generation prompt ends with
``<|start|>assistant``, so the output usually starts at ``<|channel|>``)::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary<|message|>a preamble the user sees<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the recipient ``to=...`` may also come before ``<|channel|>``: ``<|start|>assistant to=functions.f<|channel|>...``).
:class:`HarmonyParser` maps analysis to reasoning, final and recipient-less commentary to content,
and a message to ``functions.NAME`` (a tool the request offers) to a tool call, its JSON body held to
the end. The markers are special tokens: the backends keep their text in the output for a harmony
chat (``prompt.preserved_specials``), so none is ever sent as content.

:func:`harmony_messages` shapes a chat for gpt-oss's template, which reads only an assistant turn's
first tool call, refuses a turn with both content and thinking beside calls, and cannot read a
``None`` content: a turn with several calls becomes one turn per call, each followed by its result.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from localrun.server.tool_formats import call_arguments

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]
_HARMONY_END = ("<|end|>", "<|return|>", "<|call|>")  # end a message (consumed)
_HARMONY_NEXT = ("<|start|>", "<|channel|>")  # a new header in a message that never ended: its end
_HARMONY_TO = re.compile(r"to=(?:functions\.)?([A-Za-z0-9_][A-Za-z0-9_.\-]*)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")
MAX_HEADER = 512  # characters a header may run to without its <|message|>; then it is not a header
_SEPARATOR = "\n\n"  # between two messages of one kind (two analysis messages, a preamble and the answer)


def is_harmony(template: str | None) -> bool:
    """gpt-oss's harmony format: messages on channels (analysis, commentary, final)."""
    return bool(template) and "<|channel|>" in template and "<|message|>" in template  # type: ignore[operator]


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _may_be_header(buf: str) -> bool:
    """`buf` is (or may become) a harmony message header: a token, or the recipient first."""
    s = buf.lstrip()
    return any(t.startswith(s[:len(t)]) for t in [*HARMONY_TOKENS, "to="])


class HarmonyParser:
    """One choice's harmony text -> (reasoning, content) pieces as they stream, then tool calls.
    Text that is not harmony-framed at all (no header first) is content, as written."""

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names or set()
        self.buf = ""
        self.state = "start"  # start | header | body | plain
        self.channel, self.recipient = "", ""
        self.call_body = ""
        self.calls: list[dict] = []
        self.sent = {"reasoning": False, "content": False}  # a message of that kind went out before
        self.fresh = False  # the message being read has sent nothing yet (a separator goes first)

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (reasoning, content) that may be sent now."""
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state in ("start", "header"):
                i = self.buf.find("<|message|>")
                if i < 0:
                    if not _may_be_header(self.buf) or len(self.buf) > MAX_HEADER:
                        self.state = "plain"  # not a header: as written
                        continue
                    return reasoning, content
                self._header(self.buf[:i])
                self.buf = self.buf[i + len("<|message|>"):]
                continue
            if self.state == "plain":  # not harmony-framed: as written
                content, self.buf = content + self.buf, ""
                return reasoning, content
            ends = [(k, e) for e in (*_HARMONY_END, *_HARMONY_NEXT) if (k := self.buf.find(e)) >= 0]
            if ends:
                k, e = min(ends)
                piece, self.buf = self.buf[:k], self.buf[k + (len(e) if e in _HARMONY_END else 0):]
            else:
                keep = max(_partial(self.buf, e) for e in (*_HARMONY_END, *_HARMONY_NEXT))
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            r, c = self._route(piece)
            reasoning, content = reasoning + r, content + c
            if not ends:
                return reasoning, content
            self._close()
            self.state = "header"
            if self.buf and not _may_be_header(self.buf):  # text after a message, not a header: as written
                self.state = "plain"

    def _header(self, header: str) -> None:
        m = _CHANNEL.search(header)
        self.channel = m.group(1) if m else "final"
        to = _HARMONY_TO.search(header)
        self.recipient = to.group(1) if to else ""
        self.state, self.fresh = "body", True

    def _route(self, piece: str) -> tuple[str, str]:
        if self.recipient:  # a message to a tool: its body is the call's arguments
            self.call_body += piece
            return "", ""
        if not piece:
            return "", ""
        kind = "reasoning" if self.channel == "analysis" else "content"
        if self.fresh:
            self.fresh = False
            if self.sent[kind]:
                piece = _SEPARATOR + piece
            self.sent[kind] = True
        return (piece, "") if kind == "reasoning" else ("", piece)

    def _close(self) -> None:
        if self.recipient:
            name, body = self.recipient, self.call_body.strip()
            self.recipient, self.call_body = "", ""
            if name in self.tool_names:
                try:
                    args = json.loads(body, strict=False) if body else {}
                except (ValueError, RecursionError):
                    args = None
                if isinstance(args, dict):
                    self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
                                       "arguments": call_arguments(args)})

    def finish(self) -> tuple[str, str, list[dict]]:
        """At the end: (reasoning, content, tool calls) still to send. An output cut short (max_tokens)
        keeps what its open message said; a marker cut in half is dropped."""
        reasoning, content = "", ""
        if self.state == "body":
            rest = self.buf[:len(self.buf) - max(_partial(self.buf, t) for t in HARMONY_TOKENS)]
            reasoning, content = self._route(rest)
            self._close()
        elif self.state == "plain" or not _may_be_header(self.buf):  # (a header cut short: dropped)
            content = self.buf
        self.buf = ""
        return reasoning, content, self.calls


def harmony_tools(tools: list[dict] | None) -> list[dict] | None:
    """`tools` with an empty description where a function has none (gpt-oss's template writes
    ``"// " + tool.description`` unconditionally; OpenAI and Anthropic make the description optional)."""
    if not tools:
        return tools
    return [{**t, "function": {"description": "", **t["function"]}}
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("description") is None
            else t for t in tools]


def harmony_messages(messages: list[dict]) -> list[dict]:
    """`messages` as gpt-oss's template can render them: an assistant turn with several tool calls
    becomes one turn per call, each followed by its result (matched by tool_call_id, else in order);
    a turn with calls keeps its reasoning (the template renders it as the analysis before the call)
    or, without any, its text; an absent content is empty."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = {**m, "content": m.get("content") or ""}
        calls = m.get("tool_calls") or []
        if not calls:
            out.append(m)
            continue
        thought = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k)), "")
        if thought and m["content"]:  # the template refuses both: the reasoning is what precedes a call
            m["content"] = ""
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        if len(calls) == 1:
            out.append(m)
            out.extend(results)
            continue
        ids = {c.get("id") for c in calls if c.get("id")}
        by_id = {r["tool_call_id"]: r for r in results if r.get("tool_call_id") in ids}
        rest = [r for r in results if r.get("tool_call_id") not in by_id]
        for n, call in enumerate(calls):
            turn = dict(m) if n == 0 else {"role": "assistant", "content": ""}
            out.append({**turn, "tool_calls": [call]})
            result = by_id[call["id"]] if call.get("id") in by_id else (rest.pop(0) if rest else None)
            if result is not None:
                out.append(result)
        out.extend(rest)
    return out


__all__ = ["HarmonyParser", "HARMONY_TOKENS", "is_harmony", "harmony_messages", "harmony_tools", "MAX_HEADER"]
