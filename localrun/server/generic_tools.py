"""The generic tool format: tools for a model whose chat template cannot render them.

Agents send tools with every request; a template that never mentions tools (SmolLM2's, most
base-instruct templates) would drop them. Instead, as llama.cpp's generic chat format does:

- the tool definitions (name, description, JSON schema of the arguments) go into the system
  message, with a note on how to answer;
- earlier assistant tool calls are shown as the JSON the model is asked to write, and tool
  results as user turns (templates without tools often know no "tool" role);
- the output is constrained by a JSON schema (a grammar on the backend) to either
  ``{"response": "..."}`` or ``{"tool_calls": [{"name": ..., "parameters": {...}}]}``;
- :func:`parse` turns that JSON back into content or tool calls.

``LOCALRUN_GENERIC_TOOLS=off`` turns it off (such a request is then a 400). A forced call
(tool_choice required / a named tool) keeps its own schema; a request's own JSON schema
(structured output) keeps the output to that schema, with the tools described.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from localrun.chat_template import template_supports_tools
from localrun.server.tool_formats import call_arguments, utf8_safe

log = logging.getLogger("localrun.server")

NAME = "generic"  # what `show` and the log call it
MAX_TOOL_SCHEMA_CHARS = 256 * 1024  # the JSON of every tool's arguments schema, in the grammar
_HEADER = ("# Tools\nAnswer with one JSON object and nothing else. To reply to the user: "
           '{"response": "<your reply>"}. Only when the request needs a tool: '
           '{"tool_calls": [{"name": "<tool name>", "parameters": {<its arguments>}}]} (the results come back as '
           "tool_response in the next user turn). The tools:")


def enabled() -> bool:
    from localrun.config import settings

    try:
        return settings().generic_tools
    except ValueError:
        return True


def needed(template: str | None, tools: list[dict] | None) -> bool:
    """True when `tools` must go through the generic format for this template."""
    return bool(tools) and not template_supports_tools(template)


def _strip(schema: Any) -> Any:
    """A tool's arguments schema as the grammar sees it (no `$schema` keyword: llama.cpp's
    converter takes it for a property)."""
    if not isinstance(schema, dict):
        return {"type": "object"}
    return {k: v for k, v in schema.items() if k != "$schema"}


def _type(s: Any, depth: int = 0) -> str:
    """A schema as a short type: string, integer[], "a"|"b", {key: type, optional?: type}."""
    if not isinstance(s, dict):
        return "any"
    if depth > 6:
        return "object"
    if "enum" in s and isinstance(s["enum"], list):
        return "|".join(json.dumps(e, ensure_ascii=False) for e in s["enum"][:32])
    if "const" in s:
        return json.dumps(s["const"], ensure_ascii=False)
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            return "|".join(_type(v, depth + 1) for v in s[key][:16])
    t = s.get("type", "any")
    if t == "array":
        return _type(s.get("items"), depth + 1) + "[]"
    if t == "object" and isinstance(s.get("properties"), dict) and s["properties"]:
        req = set(s.get("required") or [])
        return "{" + ", ".join(f"{k}{'' if k in req else '?'}: {_type(v, depth + 1)}"
                               for k, v in s["properties"].items()) + "}"
    return t if isinstance(t, str) else "|".join(map(str, t))


def _tool_text(tools: list[dict]) -> str:
    """One entry a tool: its name and description, then each argument (`?`: optional) with its
    type and description; shorter than the schemas' JSON (an agent's two dozen tools must leave
    room in the context), while the grammar holds the output to the full schemas."""
    out = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        req = set(params.get("required") or [])
        out.append(f"- {fn['name']}: {(fn.get('description') or '').strip()}")
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        for k, v in props.items():
            desc = v.get("description") if isinstance(v, dict) else None
            out.append(f"    {k}{'' if k in req else '?'}: {_type(v)}" + (f" - {desc.strip()}" if isinstance(desc, str) and desc.strip() else ""))
        if not props:
            out.append("    (no arguments: {})")
    return "\n".join(out)


def system_text(tools: list[dict]) -> str:
    return _HEADER + "\n" + _tool_text(tools)


def output_schema(tools: list[dict]) -> dict:
    """A JSON answer, or JSON tool calls naming these tools with their arguments' schemas."""
    args_size = sum(len(json.dumps(t["function"].get("parameters") or {})) for t in tools)
    loose = args_size > MAX_TOOL_SCHEMA_CHARS
    # "name" before "parameters": the grammar writes keys in sorted order, and the model must
    # choose the tool before its arguments (with "arguments" it wrote arguments first)
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": {"type": "object"} if loose else
                             _strip(t["function"].get("parameters") or {"type": "object"})},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"anyOf": [
        {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
         "additionalProperties": False},
        {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
         "required": ["tool_calls"], "additionalProperties": False},
    ]}


def loose_schema(tools: list[dict]) -> dict:
    """The same choice with any object as arguments (when the full schema makes no grammar)."""
    return output_schema([{"function": {"name": t["function"]["name"], "parameters": {"type": "object"}}}
                          for t in tools])


def rewrite_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation as a template without tools can render it: tool definitions in the
    system message, calls as the JSON the model writes, tool results as user turns."""
    out: list[dict] = []
    note = system_text(tools)
    names: dict[str, str] = {}
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m.pop("tool_calls"):
                fn = c.get("function", {})
                if c.get("id"):
                    names[c["id"]] = fn.get("name")
                calls.append({"name": fn.get("name"), "parameters": fn.get("arguments", {})})
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            m["content"] = (m.get("content") or "").strip()
            m["content"] = text if not m["content"] else m["content"] + "\n" + text
        if m.get("role") == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            m = {"role": "user", "content": json.dumps({"tool_response": {
                **({"name": name} if name else {}), "content": m.get("content") or ""}}, ensure_ascii=False)}
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + note}
    else:
        out.insert(0, {"role": "system", "content": note})
    # two user turns in a row (a tool result, then the user's text) stay two turns; templates
    # that insist on alternation are the ones that render tools, which never come here
    return out


def parse(text: str, names: set[str]) -> tuple[str, list[dict]] | None:
    """(content, tool calls) from the model's JSON; None when it is not the generic shape."""
    s = text.strip()
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):
        obj = _partial_response(s) or _partial_calls(s)
        if obj is None:
            return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("response"), str) and "tool_calls" not in obj:
        return utf8_safe(obj["response"]), []
    raw = obj.get("tool_calls")
    if raw is None and isinstance(obj.get("tool_call"), dict):
        raw = [obj["tool_call"]]
    if not isinstance(raw, list):
        return None
    calls = []
    for c in raw:
        if isinstance(c, dict) and c.get("name") in names:
            args = c.get("parameters", c.get("arguments", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": c["name"],
                          "arguments": call_arguments(args)})
    return ("", calls) if calls else None


def _partial_calls(s: str) -> dict | None:
    """Calls cut short (max_tokens) inside {"tool_calls": [...: the calls written whole so far."""
    m = re.match(r'\s*\{\s*"tool_calls"\s*:\s*\[', s)
    if m is None:
        return None
    dec, i, calls = json.JSONDecoder(), m.end(), []
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        try:
            value, i = dec.raw_decode(s, i)
        except ValueError:
            break
        calls.append(value)
    return {"tool_calls": calls} if calls else None


def _partial_response(s: str) -> dict | None:
    """An answer cut short (max_tokens) inside {"response": "...: what was written so far."""
    head = s.replace(" ", "").replace("\n", "")
    if not head.startswith('{"response":"'):
        return None
    body = s[s.index('"', s.index(":")) + 1:]
    for cut in range(len(body), max(len(body) - 8, -1), -1):  # drop a half-written escape
        try:
            return {"response": json.loads('"' + body[:cut] + '"')}
        except (ValueError, RecursionError):
            continue
    return None


def prepare(job: Any) -> None:
    """Turn `job` (its template cannot render its tools) into the generic format, in place:
    messages rewritten, the output schema set unless the request set its own."""
    tools = job.tools
    job.messages = rewrite_messages(job.messages or [], tools)
    job.tool_format = NAME
    if not job.options.constraints():
        job.options.json_schema = _buildable(output_schema(tools), tools)
    log.info("%s: its chat template cannot render tools; using the generic tool format (%d tools)",
             job.resolved.name, len(tools))


def _buildable(schema: dict, tools: list[dict]) -> dict:
    """`schema`, or the loose one when llama.cpp's converter cannot make (or bound) its grammar:
    some agents' argument schemas use keywords it lacks, and two dozen tools make a big one."""
    try:
        from localrun.structured.gbnf import json_schema_grammar

        json_schema_grammar(schema)
    except ImportError:
        return schema
    except Exception as exc:
        log.info("generic tool format: the tools' argument schemas make no grammar (%s); arguments are "
                 "constrained to JSON objects", getattr(exc, "message", type(exc).__name__))
        return loose_schema(tools)
    return schema


__all__ = ["NAME", "enabled", "needed", "prepare", "parse", "output_schema", "loose_schema", "rewrite_messages",
           "system_text"]
