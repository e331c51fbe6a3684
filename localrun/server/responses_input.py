"""The Responses API's request, read: its input items (stored with ids), the chat they render as, and its options.

A request's `input` becomes stored items (:func:`input_items`); with `previous_response_id`, the
stored conversation's items go first, and :func:`chat_messages` turns them all into the messages a
chat template renders. Tools (function, namespace, custom; hosted ones noted and left out),
tool_choice, text.format, reasoning and metadata are read here, each with the 400 that names what
is wrong; the routes, the output items and the stream events are :mod:`localrun.server.routes_responses`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from localrun.backends.base import MEDIA_MARKER
from localrun.errors import InvalidRequest
from localrun.server import params as p
from localrun.server.images import from_url

_TEXT_PARTS = ("input_text", "output_text", "text")
HOSTED_CALLS = ("web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                "computer_call", "computer_call_output", "mcp_list_tools", "mcp_call", "tool_search_call",
                "tool_search_output")
MAX_METADATA = 16


def new_item_id(prefix: str) -> str:
    """A new item's id: `prefix`_ and 32 hex digits (msg_..., fc_..., rs_...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items -------------------------------------------------------------------------------
def _parts_text(content: Any, where: str) -> str:
    """The text of a string or a list of text parts; anything else (images, files, audio) is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: 'content' must be a string or a list of content parts")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("text" if kind != "refusal" else "refusal")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}.content[{k}]: a {kind} part needs a string")
            out.append(text)
        elif kind == "input_image":
            raise InvalidRequest(f"{where}.content[{k}]: input_image is not supported here (only in user messages)")
        elif kind in ("input_file", "input_audio"):
            raise InvalidRequest(f"{where}.content[{k}]: {kind} is not supported; send text or input_image")
        else:
            raise InvalidRequest(f"{where}.content[{k}]: content parts must be input_text (or output_text)")
    return "".join(out)


def _message_parts(content: Any, where: str, role: str) -> list[dict]:
    """A message's stored content parts: its text as one part, or (a user or system message with
    input_image parts) text and image parts in their order."""
    if role != "assistant" and isinstance(content, list) and any(
            isinstance(x, dict) and x.get("type") == "input_image" for x in content):
        parts: list[dict] = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":
                w = f"{where}.content[{k}]"
                if part.get("file_id") is not None and part.get("image_url") is None:
                    raise InvalidRequest(f"{w}: input_image by file_id is not supported; send image_url "
                                         "(a data URL)")
                from_url(part.get("image_url"), w)  # its shape, now; the bytes when the request runs
                parts.append({"type": "input_image", "image_url": part["image_url"],
                              "detail": part.get("detail") if part.get("detail") in ("low", "high") else "auto"})
            else:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"{where}.content[{k}]: content parts must be input_text or input_image")
                text = part["text"]
                if parts and parts[-1]["type"] == "input_text":
                    parts[-1]["text"] += text
                else:
                    parts.append({"type": "input_text", "text": text})
        return parts
    text = _parts_text(content, where)
    return [{"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text}]


def _str_field(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise InvalidRequest(f"{where}: '{key}' must be a string")
    return v


def input_items(value: Any) -> list[dict]:
    """A request's `input` as stored items, each with an id."""
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRequest("'input' must not be empty")
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string or a non-empty list of items")
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        rid = item.get("id") if isinstance(item.get("id"), str) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{where}.role must be user, assistant, system or developer")
            items.append({"type": "message", "id": rid or new_item_id("msg"), "role": role, "status": "completed",
                          "content": _message_parts(item.get("content"), where, role)})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": rid or new_item_id("fc"), "call_id": _str_field(item, "call_id", where),
                          "name": _str_field(item, "name", where), "arguments": _str_field(item, "arguments", where),
                          "status": "completed",
                          **({"namespace": item["namespace"]} if isinstance(item.get("namespace"), str) else {})})
        elif kind == "custom_tool_call":
            items.append({"type": "custom_tool_call", "id": rid or new_item_id("ctc"), "call_id": _str_field(item, "call_id", where),
                          "name": _str_field(item, "name", where), "input": _str_field(item, "input", where),
                          "status": "completed"})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = item.get("output")
            items.append({"type": kind, "id": rid or new_item_id("fco" if kind == "function_call_output" else "ctco"),
                          "call_id": _str_field(item, "call_id", where),
                          "output": out if isinstance(out, str) else _parts_text(out, where + ".output"),
                          "status": "completed"})
        elif kind == "reasoning":
            texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequest(f"{where}: reasoning content must be reasoning_text parts")
            items.append({"type": "reasoning", "id": rid or new_item_id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": t} for t in texts]})
        elif kind in HOSTED_CALLS:
            continue  # a hosted tool's call (from a response elsewhere): nothing the model here can use
        elif kind == "item_reference":
            raise InvalidRequest(f"{where}: item_reference is not supported; use previous_response_id or send the item")
        else:
            raise InvalidRequest(f"{where}: items of type {json.dumps(kind)[:40]} are not supported (message, "
                                 "function_call, function_call_output, custom_tool_call, custom_tool_call_output, "
                                 "reasoning)")
    return items


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return text  # as the model wrote it; the template shows it as is


def chat_messages(items: list[dict], instructions: str | None, first_input: int = 0) -> list[dict]:
    """Stored items -> the chat messages a template renders (items from `first_input` on are this
    request's input; images carry their place for errors). An input_image part becomes MEDIA_MARKER
    in the text and an ImageInput on the message's "images"."""
    msgs: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for n, it in enumerate(items):
        kind = it.get("type")
        last = msgs[-1] if msgs else None
        if kind == "reasoning":
            thought += "".join(c.get("text", "") for c in it.get("content") or [])
        elif kind == "message":
            role = "system" if it.get("role") in ("developer", "system") else it.get("role")
            images = []
            text = ""
            for k, c in enumerate(it.get("content") or []):
                if c.get("type") == "input_image":
                    where = (f"input[{n - first_input}].content[{k}]" if n >= first_input
                             else f"previous input item {it.get('id')} content[{k}]")
                    images.append(from_url(c.get("image_url"), where))
                    text += MEDIA_MARKER
                else:
                    text += c.get("text") or c.get("refusal") or ""
            msg: dict[str, Any] = {"role": role, "content": text, **({"images": images} if images else {})}
            if role == "system" and not images and msgs and all(m["role"] == "system" for m in msgs):
                # instructions and developer messages before the conversation: one system message
                # (most chat templates take one, first)
                msgs[-1]["content"] += "\n\n" + msg["content"]
                continue
            if role == "assistant" and thought:
                msg["reasoning_content"] = thought
            thought = "" if role in ("assistant", "user") else thought
            msgs.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            names[it["call_id"]] = it["name"]
            args = _arguments(it["arguments"]) if kind == "function_call" else {CUSTOM_INPUT: it["input"]}
            call = {"type": "function", "id": it["call_id"], "function": {"name": it["name"], "arguments": args}}
            if last is not None and last["role"] == "assistant":  # the same turn: text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call],
                             **({"reasoning_content": thought} if thought else {})})
            thought = ""
        elif kind in ("function_call_output", "custom_tool_call_output"):
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"],
                         **({"name": names[it["call_id"]]} if it["call_id"] in names else {})})
    return msgs


# -- the rest of the request -----------------------------------------------------------------------
# tools OpenAI runs on its side: the daemon cannot, so they are left out of the prompt (with a note)
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "computer_use", "mcp", "local_shell", "tool_search")
MAX_TOOLS = 512
CUSTOM_INPUT = "input"  # a custom tool, as the model sees it: a function taking this one string
MAX_CUSTOM_FORMAT = 32 * 1024  # a custom tool's grammar, shown to the model (characters)


class RequestTools:
    """A request's tools: chat-shaped function tools for the job (namespace groups flattened),
    what to echo, where each flattened name came from, and notes on the tools left out."""

    def __init__(self) -> None:
        self.chat: list[dict] = []
        self.echo: list[dict] = []
        self.namespace: dict[str, tuple[str, str]] = {}  # flattened name -> (namespace, its name there)
        self.notes: list[str] = []
        self.custom: set[str] = set()  # custom (freeform) tools: their calls are custom_tool_call items

    def add_custom(self, t: dict, where: str) -> None:
        """A custom tool (freeform input, e.g. Codex's apply_patch with a Lark grammar): rendered as a
        function taking one string, its format's grammar in the description (the model writes the
        raw input; the grammar is shown, not enforced: llama.cpp's grammars are GBNF)."""
        fmt = t.get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise InvalidRequest(f"{where}: a custom tool's 'format' must be {{'type': 'text'}} or "
                                 "{'type': 'grammar', 'syntax', 'definition'}")
        how = "Its input is free-form text."
        if fmt["type"] == "grammar":
            definition = fmt.get("definition")
            if not isinstance(definition, str) or fmt.get("syntax") not in ("lark", "regex"):
                raise InvalidRequest(f"{where}: a grammar format needs 'syntax' (lark or regex) and a 'definition'")
            if len(definition) > MAX_CUSTOM_FORMAT:
                raise InvalidRequest(f"{where}: the grammar 'definition' is longer than {MAX_CUSTOM_FORMAT} characters")
            how = f"Its input follows this {fmt['syntax']} grammar:\n{definition}"
        desc = ((t.get("description") or "").strip() + "\n\n" + how).strip()
        self.add_function({"name": t.get("name"), "description": desc, "parameters": {
            "type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": "the tool's raw input"}},
            "required": [CUSTOM_INPUT], "additionalProperties": False}}, where)
        self.custom.add(t["name"])

    def add_function(self, t: dict, where: str, namespace: str | None = None) -> None:
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where} needs a 'name'")
        flat = name
        if namespace is not None:
            taken = {c["function"]["name"] for c in self.chat}
            flat = name if name not in taken else f"{namespace}__{name}"
            self.namespace[flat] = (namespace, name)
        fn = {"name": flat, "description": t.get("description"), "parameters": t.get("parameters")}
        self.chat.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
        if len(self.chat) > MAX_TOOLS:
            raise InvalidRequest(f"'tools' holds more than {MAX_TOOLS} function tools")


def parse_tools(value: Any, template: str | None) -> tuple[list[dict] | None, list[dict], RequestTools]:
    """(chat-shaped tools for the job, Responses-shaped tools for the answer, the request's tools)."""
    tools = RequestTools()
    if value is None or value == []:
        return None, [], tools
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise InvalidRequest("'tools' must be a list of objects")
    for i, t in enumerate(value):
        kind = t.get("type")
        if kind == "function":
            tools.add_function(t, f"tools[{i}]")
            tools.echo.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                               "parameters": t.get("parameters"), "strict": t.get("strict")})
        elif kind == "namespace":  # a group of function tools: flattened, calls mapped back
            inner = t.get("tools")
            if not isinstance(t.get("name"), str) or not t["name"] or not isinstance(inner, list):
                raise InvalidRequest(f"tools[{i}]: a namespace tool needs a 'name' and a list of 'tools'")
            for j, f in enumerate(inner):
                if not isinstance(f, dict) or f.get("type", "function") != "function":
                    raise InvalidRequest(f"tools[{i}].tools[{j}] must be a function tool")
                tools.add_function(f, f"tools[{i}].tools[{j}]", namespace=t["name"])
            tools.echo.append(t)
        elif kind == "custom":
            tools.add_custom(t, f"tools[{i}]")
            tools.echo.append(t)
        elif kind in HOSTED_TOOLS:
            tools.notes.append(f"tools[{i}]: {kind} is a hosted tool, which localrun cannot run; it was left out "
                               "of the prompt")
            tools.echo.append(t)
        else:
            raise InvalidRequest(f"tools[{i}]: {json.dumps(kind)[:40]} tools are not supported; localrun "
                                 "runs function tools ({'type': 'function', 'name', 'parameters'}), namespaces of "
                                 "them and custom tools")
    return (p.check_tools(tools.chat, template) if tools.chat else None), tools.echo, tools


def parse_tool_choice(choice: Any, tools: list[dict] | None) -> tuple[Any, Any]:
    """(tool_choice for params.tool_choice_schema, the value to echo)."""
    if choice is None:
        return "auto", "auto"
    if choice in ("auto", "none", "required"):
        named: Any = choice
    elif isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        named = {"name": choice["name"]}
    else:
        raise InvalidRequest("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function' (or 'custom'), "
                             "'name': ...}")
    if named not in ("auto", "none") and not tools:
        raise InvalidRequest("'tool_choice' asks for a tool call but 'tools' is empty")
    return named, choice


def parse_text_format(value: Any, opts) -> dict:
    """`text.format` onto the sampling options; returns the `text` to echo."""
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise InvalidRequest("'text' must be an object")
    fmt = value.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'text.format.type' must be text, json_object or json_schema")
    if fmt["type"] == "json_object":
        opts.json_mode = True
    elif fmt["type"] == "json_schema":
        if not isinstance(fmt.get("name"), str) or "schema" not in fmt:
            raise InvalidRequest("'text.format' json_schema needs a 'name' and a 'schema'")
        opts.json_schema = p.check_json_schema(fmt["schema"])
    out = {"format": fmt}
    if value.get("verbosity") is not None:
        if value["verbosity"] not in ("low", "medium", "high"):
            raise InvalidRequest("'text.verbosity' must be low, medium or high")
        out["verbosity"] = value["verbosity"]
    return out


def parse_reasoning(value: Any) -> tuple[bool | None, str | None, dict]:
    """(Job.think, Job.effort, the `reasoning` to echo): p.reasoning_effort reads the effort."""
    if value is None:
        return None, None, {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise InvalidRequest("'reasoning' must be an object")
    effort = value.get("effort")
    think, level = p.reasoning_effort(effort, "reasoning.effort")
    return think, level, {"effort": effort, "summary": value.get("summary")}


def parse_metadata(value: Any) -> dict:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise InvalidRequest(f"'metadata' must be an object of at most {MAX_METADATA} string values "
                             "(keys up to 64 characters, values up to 512)")
    return value


def refuse_unsupported(body: dict) -> None:
    if body.get("background"):
        raise InvalidRequest("'background' responses are not supported; use 'stream' instead")
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise InvalidRequest(f"'{key}' is not supported; use previous_response_id and input")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidRequest("'truncation' must be 'disabled': localrun never drops input silently")


__all__ = ["input_items", "chat_messages", "new_item_id", "RequestTools", "parse_tools", "parse_tool_choice",
           "parse_text_format", "parse_reasoning", "parse_metadata", "refuse_unsupported", "CUSTOM_INPUT",
           "HOSTED_CALLS", "HOSTED_TOOLS"]
