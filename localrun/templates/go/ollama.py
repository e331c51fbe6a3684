"""Ollama's template.Execute: the values a chat gives an Ollama template, and its two ways of rendering.

- a template that reads ``.Messages`` gets every message (consecutive ones of the same role merged,
  tool results kept apart), ``.System`` (the system messages joined), ``.Tools``, ``.Think``,
  ``.ThinkLevel`` and ``.IsThinkSet``;
- an older template (``.System`` / ``.Prompt`` / ``.Response`` only) is rendered once per turn and
  the last turn is cut after ``{{ .Response }}``, so the prompt ends where the answer begins (a
  template without ``.Response`` gets one appended, as Ollama does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from localrun.templates.go.executor import execute
from localrun.templates.go.parser import GoPipe, parse
from localrun.templates.go.values import GoJSONList, GoJSONMap, GoStruct, Ordered, PropertyType


def _identifiers(nodes: list) -> set[str]:
    """Ollama's Vars(): the field and variable names the template uses, lower-cased."""
    names: set[str] = set()

    def pipe(p: GoPipe) -> None:
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

    def has_response(p: GoPipe) -> bool:
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


_RESPONSE = ("action", GoPipe(cmds=[[("field", ["Response"])]]))


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
