"""The OpenAI Responses API under /v1/responses: JSON -> Job, events -> a response object or
its semantic SSE events (a translator only; generation is the service's).

- Input: a string, or items: messages (easy {"role", "content"} or typed; text parts, and
  input_image parts in user/system messages: image_url a data URL, or http(s) when allowed),
  function_call and function_call_output items, reasoning items (kept, not re-rendered).
  `instructions` become the system message of this request only.
- Output items: a reasoning item when the model thought (its text as reasoning_text
  content), a message with output_text, function_call items.
- Tools: function tools, and namespace tools (a group of function tools, as Codex sends them)
  flattened into the function tools the model sees; a call of one comes back with its
  `namespace` and its name there. Hosted tools the daemon cannot run (web_search, file_search,
  ...) are left out of the prompt and named in the response's `notes` rather than refused;
  custom tools (freeform input, such as Codex's apply_patch with a grammar) are shown to the
  model as a function taking one string (the grammar in its description), and its calls come
  back as custom_tool_call items with that raw input;
  their call items in the input are skipped. Developer messages (and instructions) before the
  conversation become one system message.
- Stateful: with `store` (the default) the response and the items it saw are kept
  (:mod:`localrun.server.response_store`); `previous_response_id` puts that conversation
  (its items, then its output) before this request's input.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.errors import InvalidRequest, NotFound
from localrun.server import params as p
from localrun.backends.base import MEDIA_MARKER
from localrun.server.images import from_url, take_images
from localrun.server.disconnect import until_disconnected
from localrun.server.job import Delta, Done, Event, Job, ToolCalls
from localrun.server.response_store import ResponseStore, check_id, new_response_id
from localrun.server.routes_openai import stream_error
from localrun.server.state import State, generation_response, json_body

router = APIRouter(prefix="/v1")
log = logging.getLogger("localrun.server")

_TEXT_PARTS = ("input_text", "output_text", "text")
HOSTED_CALLS = ("web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                "computer_call", "computer_call_output", "mcp_list_tools", "mcp_call", "tool_search_call",
                "tool_search_output")
MAX_METADATA = 16


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_store(request: Request) -> ResponseStore:
    """The app's response store (made on first use, under LOCALRUN_HOME)."""
    app_state = request.app.state
    store = getattr(app_state, "responses", None)
    if store is None:
        store = app_state.responses = ResponseStore(app_state.lr.settings.responses_dir)
    return store


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
            items.append({"type": "message", "id": rid or _new("msg"), "role": role, "status": "completed",
                          "content": _message_parts(item.get("content"), where, role)})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": rid or _new("fc"), "call_id": _str_field(item, "call_id", where),
                          "name": _str_field(item, "name", where), "arguments": _str_field(item, "arguments", where),
                          "status": "completed",
                          **({"namespace": item["namespace"]} if isinstance(item.get("namespace"), str) else {})})
        elif kind == "custom_tool_call":
            items.append({"type": "custom_tool_call", "id": rid or _new("ctc"), "call_id": _str_field(item, "call_id", where),
                          "name": _str_field(item, "name", where), "input": _str_field(item, "input", where),
                          "status": "completed"})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = item.get("output")
            items.append({"type": kind, "id": rid or _new("fco" if kind == "function_call_output" else "ctco"),
                          "call_id": _str_field(item, "call_id", where),
                          "output": out if isinstance(out, str) else _parts_text(out, where + ".output"),
                          "status": "completed"})
        elif kind == "reasoning":
            texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequest(f"{where}: reasoning content must be reasoning_text parts")
            items.append({"type": "reasoning", "id": rid or _new("rs"), "summary": [],
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


class _Tools:
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


def _tools(value: Any, template: str | None) -> tuple[list[dict] | None, list[dict], _Tools]:
    """(chat-shaped tools for the job, Responses-shaped tools for the answer, the request's tools)."""
    tools = _Tools()
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


def _tool_choice(choice: Any, tools: list[dict] | None) -> tuple[Any, Any]:
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


def _text_format(value: Any, opts) -> dict:
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


def _reasoning(value: Any) -> tuple[bool | None, str | None, dict]:
    """(Job.think, Job.effort, the `reasoning` to echo): p.reasoning_effort reads the effort."""
    if value is None:
        return None, None, {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise InvalidRequest("'reasoning' must be an object")
    effort = value.get("effort")
    think, level = p.reasoning_effort(effort, "reasoning.effort")
    return think, level, {"effort": effort, "summary": value.get("summary")}


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise InvalidRequest(f"'metadata' must be an object of at most {MAX_METADATA} string values "
                             "(keys up to 64 characters, values up to 512)")
    return value


def _refuse_unsupported(body: dict) -> None:
    if body.get("background"):
        raise InvalidRequest("'background' responses are not supported; use 'stream' instead")
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise InvalidRequest(f"'{key}' is not supported; use previous_response_id and input")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidRequest("'truncation' must be 'disabled': localrun never drops input silently")


# -- output -----------------------------------------------------------------------------------
class _Builder:
    """Events -> the response's output items, and the semantic stream events on the way."""

    def __init__(self, response: dict, max_calls: int | None, namespace: dict | None = None,
                 custom: set | None = None) -> None:
        self.response = response
        self.namespace = namespace or {}  # flattened tool name -> (namespace, its name there)
        self.custom = custom or set()  # custom tools' names: their calls become custom_tool_call items
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.seq = 0
        self.open: dict | None = None  # the reasoning or message item being written
        self.texts: list[str] = []
        self.reasoning_tokens = 0
        self.finish = "stop"

    def event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def snapshot(self, kind: str) -> dict:
        return self.event(kind, response=copy.deepcopy(self.response))

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.response["output"]) - 1, "content_index": 0}

    def _start(self, kind: str) -> list[dict]:
        out = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new("rs"), "summary": [], "content": [], "status": "in_progress"}
            part: dict = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _new("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.response["output"].append(item)
        self.open, self.texts = item, []
        out.append(self.event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                              item=copy.deepcopy(item)))
        out.append(self.event("response.content_part.added", part=part, **self._where()))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out = [] if self.open is not None and self.open["type"] == kind else self._start(kind)
        self.texts.append(text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, delta=text, **self._where(), **extra))
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        item = self.open
        if item is None:
            return []
        text, where = "".join(self.texts), self._where()
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", text=text, **where)]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [self.event("response.output_text.done", text=text, logprobs=[], **where)]
        item["content"], item["status"] = [part], status
        out.append(self.event("response.content_part.done", part=copy.deepcopy(part), **where))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)))
        self.open = None
        return out

    def feed(self, ev: Event) -> list[dict]:
        out: list[dict] = []
        if isinstance(ev, Delta):
            if ev.reasoning:
                self.reasoning_tokens += len(ev.token_ids)
                out += self._text("reasoning", ev.reasoning)
            if ev.content:
                out += self._text("message", ev.content)
        elif isinstance(ev, ToolCalls):
            out += self._close()
            for call in ev.calls[:self.max_calls]:
                if call["name"] in self.custom:
                    out += self._custom_call(call)
                    continue
                item = {"type": "function_call", "id": _new("fc"), "call_id": call["id"], "name": call["name"],
                        "arguments": "", "status": "in_progress"}
                if call["name"] in self.namespace:  # a namespace's tool: named as the client defined it
                    item["namespace"], item["name"] = self.namespace[call["name"]]
                self.response["output"].append(item)
                at = {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}
                out.append(self.event("response.output_item.added", output_index=at["output_index"],
                                      item=copy.deepcopy(item)))
                out.append(self.event("response.function_call_arguments.delta", delta=call["arguments"], **at))
                out.append(self.event("response.function_call_arguments.done", arguments=call["arguments"], **at))
                item.update(arguments=call["arguments"], status="completed")
                out.append(self.event("response.output_item.done", output_index=at["output_index"],
                                      item=copy.deepcopy(item)))
        elif isinstance(ev, Done):
            self.finish = ev.finish_reason
            status = "incomplete" if ev.finish_reason == "length" else "completed"
            if self.open is None and not self.response["output"]:  # nothing written: an empty message
                out += self._start("message")
            out += self._close(status)
        return out

    def _custom_call(self, call: dict) -> list[dict]:
        """A custom tool's call: its raw input (the one string argument the model wrote)."""
        try:
            args = json.loads(call["arguments"])
        except (ValueError, RecursionError):
            args = call["arguments"]
        raw = args.get(CUSTOM_INPUT) if isinstance(args, dict) else args
        raw = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
        item = {"type": "custom_tool_call", "id": _new("ctc"), "call_id": call["id"], "name": call["name"],
                "input": "", "status": "in_progress"}
        self.response["output"].append(item)
        at = {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}
        out = [self.event("response.output_item.added", output_index=at["output_index"], item=copy.deepcopy(item)),
               self.event("response.custom_tool_call_input.delta", delta=raw, **at),
               self.event("response.custom_tool_call_input.done", input=raw, **at)]
        item.update(input=raw, status="completed")
        out.append(self.event("response.output_item.done", output_index=at["output_index"], item=copy.deepcopy(item)))
        return out

    def done(self, usage) -> dict:
        """The finished response object."""
        r = self.response
        r["status"] = "incomplete" if self.finish == "length" else "completed"
        r["incomplete_details"] = {"reason": "max_output_tokens"} if self.finish == "length" else None
        r["completed_at"] = int(time.time())
        r["usage"] = {"input_tokens": usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, usage.completion_tokens)},
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return r


def _sse(ev: dict) -> bytes:
    return (b"event: " + ev["type"].encode() + b"\ndata: "
            + json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


# -- routes -----------------------------------------------------------------------------------------
@router.post("/responses")
async def create_response(request: Request):
    st: State = request.app.state.lr
    store = responses_store(request)
    body = await json_body(request)
    _refuse_unsupported(body)
    model = p.get_str(body, "model", required=True)
    stream = p.get_bool(body, "stream")
    keep = p.get_bool(body, "store", default=True)
    parallel = p.get_bool(body, "parallel_tool_calls", default=True)
    max_calls = p.get_int(body, "max_tool_calls", 1)
    instructions = p.get_str(body, "instructions")
    previous = p.get_str(body, "previous_response_id")
    items = input_items(body.get("input"))
    metadata = _metadata(body.get("metadata"))
    think, effort, reasoning = _reasoning(body.get("reasoning"))
    context: list[dict] = []
    if previous is not None:
        check_id(previous, "previous_response_id")
        record = await asyncio.to_thread(store.load, previous, "previous response")
        context = record["context"] + record["response"]["output"]
    context += items

    resolved = await st.resolve(model)
    opts, num_ctx = p.base_options(resolved)
    if (v := p.get_int(body, "max_output_tokens", 1, 1 << 20)) is not None:
        opts.max_tokens = v
    for key, hi in (("temperature", 2.0), ("top_p", 1.0)):
        if (v := p.get_float(body, key, 0.0, hi)) is not None:
            setattr(opts, key, v)
    text = _text_format(body.get("text"), opts)
    tools, tools_echo, request_tools = _tools(body.get("tools"), resolved.template)
    choice, choice_echo = _tool_choice(body.get("tool_choice"), tools)
    if tools:
        tools, forced = p.tool_choice_schema(tools, choice)
        if forced is not None:
            opts.json_schema = forced
    messages = chat_messages(context, instructions, len(context) - len(items))
    job = Job(resolved, opts, messages=messages, tools=tools, think=think, effort=effort,
              num_ctx=p.get_int(body, "num_ctx", 16, 1 << 20) or num_ctx, keep_alive=st.keep_alive(body),
              api="openai.responses", images=take_images(messages), cache_key=p.cache_key(body))
    response = {
        "id": new_response_id(), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": max_calls,
        "model": resolved.name, "output": [], "parallel_tool_calls": parallel, "previous_response_id": previous,
        "reasoning": reasoning, "store": keep, "temperature": opts.temperature, "text": text,
        "tool_choice": choice_echo, "tools": tools_echo, "top_p": opts.top_p, "truncation": "disabled",
        "usage": None, "user": p.get_str(body, "user"), "metadata": metadata, "prompt_cache_key": job.cache_key,
    }
    if request_tools.notes:
        response["notes"] = request_tools.notes  # what was left out, rather than a 400
        log.info("responses: %s", "; ".join(request_tools.notes))
    builder = _Builder(response, max_calls if parallel else 1, request_tools.namespace, request_tools.custom)

    async def finish(usage) -> dict:
        done = builder.done(usage)
        if keep:
            await asyncio.to_thread(store.save, {"response": done, "context": context})
        return done

    if not stream:
        async def run() -> dict:
            gen = await st.generation.start(job)
            try:
                async for ev in gen.events():
                    builder.feed(ev)
            finally:
                await gen.release()
            return await finish(gen.usage)

        return await until_disconnected(request, run())

    gen = await until_disconnected(request, st.generation.start(job))  # gone while it queues or prefills: cancelled

    async def produce() -> AsyncIterator[bytes]:
        yield _sse(builder.snapshot("response.created"))
        yield _sse(builder.snapshot("response.in_progress"))
        async for ev in gen.events():
            for out in builder.feed(ev):
                yield _sse(out)
        done = await finish(gen.usage)
        yield _sse(builder.snapshot("response.incomplete" if done["status"] == "incomplete" else "response.completed"))

    def failed(exc: Exception) -> list[bytes]:  # the status was sent: an error event, then response.failed
        err = stream_error(exc)["error"]
        response.update(status="failed", error={"code": "server_error", "message": err["message"]})
        return [_sse(builder.event("error", code=err["code"], message=err["message"], param=None)),
                _sse(builder.snapshot("response.failed"))]

    return generation_response(gen, produce, failed)


def _stored_id(response_id: str) -> str:
    """A path's response id: one that cannot be localrun's names no stored response (404, as OpenAI answers)."""
    try:
        return check_id(response_id)
    except InvalidRequest as exc:
        raise NotFound(exc.message.replace("is not a valid response id", "names no stored response")) from None


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    record = await asyncio.to_thread(responses_store(request).load, _stored_id(response_id))
    return record["response"]


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    await asyncio.to_thread(responses_store(request).delete, _stored_id(response_id))
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request):
    """The items the model saw before its output (the conversation it continued, then this
    request's input), paged as OpenAI does: limit, order (desc by default), after, before."""
    record = await asyncio.to_thread(responses_store(request).load, _stored_id(response_id))
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("'limit' must be an integer") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be between 1 and 100")
    items = record["context"] if order == "asc" else record["context"][::-1]
    ids = [it.get("id") for it in items]
    for key, cut in (("after", lambda i: items[i + 1:]), ("before", lambda i: items[:i])):
        if q.get(key) is not None:
            if q[key] not in ids:
                raise InvalidRequest(f"'{key}': no item '{q[key][:80]}' in this response's input")
            items = cut(ids.index(q[key]))
            ids = [it.get("id") for it in items]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
