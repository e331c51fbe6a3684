"""What the model wrote, split into what the APIs send: reasoning, content, tool calls.

:class:`OutputParser` takes one choice's streamed text piece by piece and returns the
pieces of reasoning and of content that may go out now; at the end it returns the tool
calls it found. Text is held back only while it could still turn into a marker
(``</think>``) or a tool call, so answers without either stream untouched.

- Reasoning: models whose template thinks in ``<think>…</think>`` (Qwen3, DeepSeek-R1
  distills, or a model's own markers). When the rendered prompt already opened the think
  block (the template appended ``<think>``), the output starts inside it.
- Tool calls: Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks anywhere in the output,
  or an output that is one JSON object (or list) naming a known tool (what a forced call
  produces); Qwen3-Coder's ``<function=NAME><parameter=K>V</parameter></function>``, GLM's
  ``<arg_key>``/``<arg_value>``, Mistral's ``[TOOL_CALLS]NAME[ARGS]{json}``, functionary's
  ``<function=NAME>{json}</function>``, gpt-oss's ``to=functions.NAME<|channel|>commentary ...
  <|message|>{json}``, and JSON calls after a model's own marker (``<tool_calls>``,
  ``<|START_ACTION|>``, ...). The marker a template writes before a call is learned from the
  template (:func:`call_markers`: render a known call, take what precedes it). Content before
  a marker streams; the call itself is held to the end.
- The generic tool format (server/generic_tools.py): the output is one JSON object; the
  answer's string streams as it is written, calls are parsed whole.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN = "<tool_call>"
_RESPONSE_OPEN = re.compile(r'\{\s*"response"\s*:\s*"')  # the generic format's answer begins
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


# Other models' call syntax (each regex: one call; the name and the arguments' JSON, or its
# key/value pairs). Content before the first marker streams; from a marker on, text is held.
TOOL_MARKERS = (TOOL_OPEN, "[TOOL_CALLS]", "<function=", "<|channel|>commentary", "to=functions.")
_XML_CALL_RE = re.compile(r"<function=([\w.\-]+)>\s*(.*?)\s*</function>", re.S)  # Qwen3-Coder, Nemotron, Seed-OSS
_XML_PARAM_RE = re.compile(r"<parameter=([\w.\-]+)>\n?(.*?)\n?</parameter>", re.S)
_GLM_CALL_RE = re.compile(r"<tool_call>\s*([\w.\-]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)</tool_call>",
                          re.S)  # GLM 4.5+, and templates after it
_GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_MISTRAL_RE = re.compile(r"\[TOOL_CALLS\]\s*([\w.\-]+)\s*\[ARGS\]\s*")  # Mistral / Devstral (v11+ tokenizers)
_FUNCTIONARY_RE = re.compile(r"<function=([\w.\-]+)>\s*(\{.*?\})\s*</function>", re.S)
_HARMONY_RE = re.compile(r"to=functions\.([\w.\-]+)\s*<\|channel\|>\s*commentary[^<]*<\|message\|>(.*?)(?:<\|call\|>|$)",
                         re.S)  # gpt-oss


def _value(text: str):
    """A parameter's value as written between tags: JSON when it is JSON, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _first_json(text: str) -> tuple[object, int] | None:
    try:
        return json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None


_PROBE_TOOLS = [{"type": "function", "function": {"name": "localrun_probe", "description": "probe", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
_PROBE_USER = [{"role": "user", "content": "probe"}]
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "localrun_probe", "arguments": {"q": "x"}}}]}


@functools.lru_cache(maxsize=64)
def call_markers(template: str | None) -> tuple[str, ...]:
    """The text a model's template writes before a tool call (learned by rendering a known call
    and taking what comes before its name or its JSON), so that streaming holds from there on.
    Runs the template twice: call it off the event loop."""
    if not template or "tools" not in template:
        return ()
    from localrun.chat_template import render_chat

    try:
        pre = render_chat(template, _PROBE_USER, add_generation_prompt=True, tools=_PROBE_TOOLS)
        full = render_chat(template, _PROBE_USER + [_PROBE_CALL], add_generation_prompt=False, tools=_PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - a template that cannot render a call teaches nothing
        return ()
    i = 0
    while i < min(len(pre), len(full)) and pre[i] == full[i]:
        i += 1
    out = full[i:]
    cut = [j for j in (out.find("localrun_probe"), out.find("{"), out.find("[")) if j >= 0]
    if not cut:
        return ()
    head = out[:min(cut)]
    for close in (THINK_CLOSE, "</mm:think>"):  # what ends an (empty) think block is not the call's marker
        if close in head:
            head = head[head.rindex(close) + len(close):]
    head = head.strip()
    # the marker proper: from its last line (a role line or blank lines can come before it)
    head = head.splitlines()[-1].strip() if head else ""
    return (head,) if len(head) >= 3 and head not in TOOL_MARKERS else ()


def _as_call(o: object, names: set[str]) -> tuple[str, object] | None:
    """One JSON call in the shapes templates write: {"name", "arguments"|"parameters"},
    {"tool_name", "parameters"} (Cohere), {"function": {...}}, or {NAME: {arguments}}."""
    if not isinstance(o, dict):
        return None
    if isinstance(o.get("function"), dict):
        o = o["function"]
    name = o.get("name", o.get("tool_name"))
    if isinstance(name, str) and name in names:
        return name, o.get("arguments", o.get("parameters", {}))
    if len(o) == 1:
        (k, v), = o.items()
        if k in names and isinstance(v, dict):
            return k, v
    return None


_TAG_TAIL = re.compile(r"(<[^<>\s]{1,40}>|\[[A-Z_]{2,20}\])$")


def _json_calls(text: str, names: set[str]) -> list[tuple[int, str, object]]:
    """Calls written as JSON (an object or a list of them) after a model's own marker
    (<tool_calls>, <|START_ACTION|>, <TOOLCALL>, <|function_call|>, ...): the first JSON value
    in the text that is calls to known tools."""
    dec = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch not in "[{":
            continue
        try:
            value, _ = dec.raw_decode(text, i)
        except ValueError:
            continue
        items = value if isinstance(value, list) else [value]
        calls = [_as_call(o, names) for o in items]
        if items and all(calls):
            head = text[:i].rstrip()
            while (m := _TAG_TAIL.search(head)) is not None:  # the model's marker is not content
                head = head[:m.start()].rstrip()
            return [(len(head), n, a) for n, a in calls]
    return []


def _other_formats(text: str, names: set[str]) -> tuple[str, list[tuple[str, object]]]:
    """(content before the first call, [(name, arguments)]) in the formats beside Hermes's JSON."""
    found: list[tuple[int, str, object]] = []
    for m in _GLM_CALL_RE.finditer(text):
        found.append((m.start(), m.group(1), {k.strip(): _value(v) for k, v in _GLM_ARG_RE.findall(m.group(2))}))
    if not found:
        for m in _FUNCTIONARY_RE.finditer(text):
            args = _first_json(m.group(2))
            if args is not None:
                found.append((m.start(), m.group(1), args[0]))
    if not found:
        for m in _XML_CALL_RE.finditer(text):
            start = text.rfind("<tool_call>", 0, m.start())
            found.append((start if start >= 0 else m.start(), m.group(1),
                          {k: _value(v) for k, v in _XML_PARAM_RE.findall(m.group(2))}))
    for m in _MISTRAL_RE.finditer(text):
        args = _first_json(text[m.end():])
        if args is not None:
            found.append((m.start(), m.group(1), args[0]))
    if not found and "[TOOL_CALLS]" in text:  # older Mistral: [TOOL_CALLS][{"name", "arguments"}, ...]
        i = text.index("[TOOL_CALLS]")
        arr = _first_json(text[i + len("[TOOL_CALLS]"):].lstrip())
        if arr is not None and isinstance(arr[0], list):
            found += [(i, c.get("name"), c.get("arguments", {})) for c in arr[0] if isinstance(c, dict)]
    for m in _HARMONY_RE.finditer(text):
        args = _first_json(m.group(2).strip())
        if args is not None:
            start = text.rfind("<|start|>", 0, m.start())
            found.append((start if start >= 0 else m.start(), m.group(1), args[0]))
    if not found:
        found = _json_calls(text, names)
    calls = [(n, a) for _, n, a in sorted(found, key=lambda f: f[0]) if n in names]
    if not calls:
        return text, []
    return text[:min(f[0] for f in found)].strip(), calls


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[dict]]:
    """(content without the calls, [{"id", "name", "arguments" (a JSON string)}])."""
    content, calls = _hermes_calls(text, names)
    if calls:
        return content, calls
    content, others = _other_formats(text, names)
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": n,
                      "arguments": a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)} for n, a in others]


def _hermes_calls(text: str, names: set[str]) -> tuple[str, list[dict]]:
    candidates = _TOOL_CALL_RE.findall(text)
    content = _TOOL_CALL_RE.sub("", text).strip() if candidates else ""
    if not candidates:
        candidates = [text.strip()]
    calls = []
    for c in candidates:
        try:
            obj = json.loads(c)
        except ValueError:
            continue
        for o in obj if isinstance(obj, list) else [obj]:
            if isinstance(o, dict) and o.get("name") in names:
                args = o.get("arguments", o.get("parameters", {}))
                calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": o["name"],
                              "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
    if not calls:
        return text, []
    return content, calls


class OutputParser:
    """One choice's text -> (reasoning, content) pieces as they stream, then tool calls."""

    def __init__(self, reasoning: Reasoning | None = None, tool_names: set[str] | None = None,
                 generic: bool = False, markers: tuple[str, ...] = ()) -> None:
        self.markers = TOOL_MARKERS + tuple(m for m in markers if m not in TOOL_MARKERS)
        self.reasoning = reasoning
        self.tool_names = tool_names or set()
        self.generic = generic  # the generic tool format: the output is one JSON object (server/generic_tools.py)
        self.g_mode: str | None = None  # generic: None (not yet known) | "string" (in the answer) | "done" | "json"
        self.g_raw = ""  # generic: the answer's JSON string not yet decoded
        # "think?": the output may open a think block; "think": inside one; "content": after
        self.state = "content" if reasoning is None else ("think" if reasoning.started else "think?")
        self.pending = ""  # text not yet classified (a possible marker)
        self.held = ""  # content held back because it may be a tool call
        self.holding = False
        self.content_sent = ""  # content given out so far (tool calls are parsed from it + held)
        self.after_think = False  # just left a think block: drop the whitespace that follows it

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
        if not self.tool_names or not text:
            self.content_sent += text
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
        if not self.content_sent.strip() and lead[:1] in ("{", "["):  # a bare JSON call
            self.holding, self.held = True, start
            return ""
        hits = [j for j in (start.find(mk) for mk in self.markers) if j >= 0]
        i = min(hits) if hits else -1
        if i < 0:
            i = len(start) - max(_partial(start, mk) for mk in self.markers)
            if i == len(start):
                self.content_sent += start
                return start
            self.held = start[i:]  # maybe the start of <tool_call>: wait for more
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
        content_left, calls = parse_tool_calls(rest, self.tool_names)
        return (reasoning, content_left, calls) if calls else (reasoning, rest, [])


__all__ = ["OutputParser", "Reasoning", "reasoning_for", "parse_tool_calls"]
