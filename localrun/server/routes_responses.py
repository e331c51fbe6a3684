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

Reading the request (input items, the chat they render as, tools and options):
:mod:`localrun.server.responses_input`; here, the routes, the output items and the stream events.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.errors import InvalidRequest, NotFound
from localrun.server import params as p
from localrun.server.images import take_images
from localrun.server.disconnect import until_disconnected
from localrun.server.job import Delta, Done, Event, Job, ToolCalls
from localrun.server.response_store import ResponseStore, check_id, new_response_id
from localrun.server.responses_input import (CUSTOM_INPUT, chat_messages, input_items, new_item_id, parse_metadata,
                                             parse_reasoning, parse_text_format, parse_tool_choice, parse_tools,
                                             refuse_unsupported)
from localrun.server.routes_openai import stream_error
from localrun.server.state import State, generation_response, json_body

router = APIRouter(prefix="/v1")
log = logging.getLogger("localrun.server")


def responses_store(request: Request) -> ResponseStore:
    """The app's response store (made on first use, under LOCALRUN_HOME)."""
    app_state = request.app.state
    store = getattr(app_state, "responses", None)
    if store is None:
        store = app_state.responses = ResponseStore(app_state.lr.settings.responses_dir)
    return store


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
            item = {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part: dict = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_item_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
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
                item = {"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"], "name": call["name"],
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
        item = {"type": "custom_tool_call", "id": new_item_id("ctc"), "call_id": call["id"], "name": call["name"],
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
    refuse_unsupported(body)
    model = p.get_str(body, "model", required=True)
    stream = p.get_bool(body, "stream")
    keep = p.get_bool(body, "store", default=True)
    parallel = p.get_bool(body, "parallel_tool_calls", default=True)
    max_calls = p.get_int(body, "max_tool_calls", 1)
    instructions = p.get_str(body, "instructions")
    previous = p.get_str(body, "previous_response_id")
    items = input_items(body.get("input"))
    metadata = parse_metadata(body.get("metadata"))
    think, effort, reasoning = parse_reasoning(body.get("reasoning"))
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
    text = parse_text_format(body.get("text"), opts)
    tools, tools_echo, request_tools = parse_tools(body.get("tools"), resolved.template)
    choice, choice_echo = parse_tool_choice(body.get("tool_choice"), tools)
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
