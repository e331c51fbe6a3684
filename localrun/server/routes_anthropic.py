"""Anthropic Messages API under /v1 (what Claude Code and the `anthropic` SDK speak):
``POST /v1/messages`` and ``POST /v1/messages/count_tokens``. A translator only: JSON -> Job,
the generation service's events -> Anthropic's SSE events or one message object.

- ``system`` (a string or text blocks) -> a system message; a ``system`` message inside
  ``messages`` (Claude Code sends them) joins the user turn before it as a system note (most
  templates take one system message, first). A system line that is only Claude Code's
  ``x-anthropic-billing-header: ...`` (attribution for Anthropic's billing, different from prompt
  to prompt) is left out, so every session's prompt shares its prefix and the caches hit. Content blocks: text -> content,
  ``tool_use`` (assistant) -> tool calls, ``tool_result`` (user) -> tool messages (``is_error``
  results are marked "Error: "), ``thinking`` blocks of earlier turns are the assistant message's
  reasoning (the template decides: most drop old reasoning, gpt-oss keeps it before a tool call);
  ``image`` blocks (``base64`` or ``url`` source, also inside a tool_result) go where they stand
  (server/images.py); documents are a 400. A final assistant turn (a prefill) is continued, as
  Anthropic does: the answer goes on from its text.
- ``tools`` ({name, description, input_schema}) -> function tools; ``tool_choice`` auto / any /
  tool / none -> auto / required / that tool / none.
- ``thinking`` enabled / disabled / adaptive -> think on / off / as the template does; the
  reasoning comes back as thinking blocks with an empty signature. ``budget_tokens`` is not
  enforced on its own: thinking counts against ``max_tokens``, as on Anthropic.
- ``output_config.format`` (a JSON schema: structured outputs) constrains the text.
- ``stop_sequences`` are added to the model's own stop strings; ``stop_reason`` is
  "stop_sequence" (with the string) only when the backend reports that one of the request's
  stop sequences ended the output.
- usage: ``input_tokens`` counts the prompt tokens not read from the prefix cache,
  ``cache_read_input_tokens`` those that were (Anthropic's split: they sum to the prompt).
- Streaming: message_start, a ping, then each block (content_block_start, its deltas,
  content_block_stop), message_delta (stop reason and the final usage), message_stop, as
  Anthropic sends them; a ping goes out whenever PING_EVERY seconds pass without an event, so
  proxies and clients with idle timeouts keep the connection. A prefill longer than PING_EVERY
  starts the stream first and sends an SSE comment (``: ping``, which clients skip) every
  PING_EVERY seconds until message_start, whose usage counts the prompt as the backend took it.
- Errors are Anthropic-shaped (app.py); a full queue is 529 overloaded_error, as Anthropic
  answers (the SDK retries it); an error mid-stream is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.backends.base import MEDIA_MARKER, SamplingOptions, Usage
from localrun.errors import Busy, InvalidRequest, LocalrunError
from localrun.library.modelfile import PARAMETERS
from localrun.server import params as p
from localrun.server.error_shapes import anthropic_error
from localrun.server.images import ImageInput, from_base64, from_url, take_images
from localrun.server.disconnect import until_disconnected
from localrun.server.generation import Generation
from localrun.server.job import Delta, Done, FinishedChoice, Job, ToolCalls
from localrun.server.state import State, generation_response, json_body

router = APIRouter(prefix="/v1")
log = logging.getLogger("localrun.server")

MAX_TOKENS = 1 << 20
PING_EVERY = 10.0  # seconds without an event (a long prefill) before a keep-alive ping
KEEPALIVE = b": ping\n\n"  # an SSE comment (clients skip it): keeps a long prefill's stream alive before message_start
_THINK = {"enabled": True, "disabled": False, "adaptive": None}


class Overloaded(Busy):
    """The queue is full: Anthropic's 529 overloaded_error."""

    status = 529


# -- request -> job ------------------------------------------------------------------------------
def _unsupported(block: Any, where: str) -> InvalidRequest:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "document":
        return InvalidRequest(f"{where}: document content blocks are not supported (send the text, or images)")
    return InvalidRequest(f"{where}: content blocks of type {json.dumps(kind)} are not supported here")


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{where}: a text block needs a 'text' string")
    return block["text"]


def _texts(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, b in enumerate(value):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _unsupported(b, f"{where}[{j}]")
        parts.append(_text(b, f"{where}[{j}]"))
    return "\n".join(parts)


_BILLING = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE | re.IGNORECASE)


def _system_text(value: Any, where: str) -> str:
    """System text without Claude Code's billing-header line (metadata, not an instruction)."""
    text, n = _BILLING.subn("", _texts(value, where))
    return text.strip("\n") if n else text


def _image(b: dict, where: str) -> ImageInput:
    """An image block's source: base64 data, or a URL (fetched only when the daemon allows it)."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        media = src.get("media_type")
        if media is not None and (not isinstance(media, str) or not media.startswith("image/")):
            raise InvalidRequest(f"{where}: an image's media_type must be image/..., got {json.dumps(media)[:40]}")
        return from_base64(src.get("data"), where)
    if kind == "url":
        return from_url(src.get("url"), where)
    raise InvalidRequest(f"{where}: an image block needs a source of type base64 or url")


class _Content:
    """A message's text pieces (joined by newlines) with MEDIA_MARKER where its images stand."""

    def __init__(self) -> None:
        self.text, self.images, self._after_text = "", [], False
        self.blocks = 0

    def __bool__(self) -> bool:  # any block at all (an empty text block too, as before)
        return self.blocks > 0

    def add_text(self, t: str) -> None:
        self.text += ("\n" if self._after_text else "") + t
        self.blocks += 1
        self._after_text = True

    def add_image(self, image: ImageInput) -> None:
        self.text += MEDIA_MARKER
        self.blocks += 1
        self.images.append(image)
        self._after_text = False

    def message(self, role: str) -> dict:
        return {"role": role, "content": self.text, **({"images": self.images} if self.images else {})}


def _tool_result(b: dict, where: str) -> dict:
    if not isinstance(b.get("tool_use_id"), str):
        raise InvalidRequest(f"{where}: a tool_result block needs a 'tool_use_id' string")
    value = b.get("content") or ""
    body = _Content()
    if isinstance(value, list):
        for j, x in enumerate(value):
            w = f"{where}.content[{j}]"
            kind = x.get("type") if isinstance(x, dict) else None
            if kind == "image":
                body.add_image(_image(x, w))
            elif kind == "text":
                body.add_text(_text(x, w))
            else:
                raise _unsupported(x, w)
    else:
        body.add_text(_texts(value, f"{where}.content"))
    msg = body.message("tool")
    if b.get("is_error"):
        msg["content"] = "Error: " + msg["content"]
    msg["tool_call_id"] = b["tool_use_id"]
    return msg


def _tool_use(b: dict, where: str) -> dict:
    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
        raise InvalidRequest(f"{where}: a tool_use block needs 'id' and 'name' strings")
    if not isinstance(b.get("input", {}), dict):
        raise InvalidRequest(f"{where}: a tool_use block's 'input' must be an object")
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}}


def _messages(body: dict) -> list[dict]:
    """system + messages -> the service's (OpenAI-shaped) chat messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    out: list[dict] = []
    if body.get("system") is not None:
        system = _system_text(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest(f"{where} must be an object with role 'user', 'assistant' or 'system'")
        role, content = m["role"], m.get("content")
        if role == "system":  # a system message inside the conversation (Claude Code sends them)
            _system_in_conversation(out, _system_text(content, f"{where}.content"))
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"{where}.content must be a string or a list of content blocks")
        texts = _Content()
        calls: list[dict] = []
        thought = ""
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.add_text(_text(b, w))
            elif kind == "image" and role == "user":
                texts.add_image(_image(b, w))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(b, w))
            elif kind == "tool_result" and role == "user":
                if texts:  # keep the order: text that came before the result goes first
                    out.append(texts.message("user"))
                    texts = _Content()
                out.append(_tool_result(b, w))
            elif kind == "thinking" and role == "assistant":  # earlier turns' reasoning: the template
                thought += b.get("thinking") if isinstance(b.get("thinking"), str) else ""  # decides (gpt-oss
            elif kind == "redacted_thinking" and role == "assistant":  # keeps what came before a tool call)
                continue
            else:
                raise _unsupported(b, w)
        if texts or calls:
            msg: dict[str, Any] = texts.message(role)
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning_content"] = thought
            out.append(msg)
    if all(m.get("role") == "system" for m in messages if isinstance(m, dict)):
        raise InvalidRequest("'messages' has no user or assistant message")
    return p.normalize_messages(out)


def _system_in_conversation(out: list[dict], text: str) -> None:
    """A system message after the conversation began: most chat templates take a system
    message only first, so its text joins the user turn before it (as a system note), or is
    a system message of its own when nothing but system text came before."""
    if not text.strip():
        return
    if not out or out[-1]["role"] == "system":
        if out:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": "system", "content": text})
        return
    note = f"<system>\n{text}\n</system>"
    if out[-1]["role"] == "user" and not out[-1].get("tool_call_id"):
        out[-1] = {**out[-1], "content": (out[-1]["content"] + "\n\n" + note).strip()}
    else:
        out.append({"role": "user", "content": note})


def _tool_choice(value: Any, names: list[str]) -> Any:
    """Anthropic's tool_choice -> the service's "auto" | "none" | "required" | {"name": N}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
    if kind == "tool":
        if value.get("name") not in names:
            raise InvalidRequest(f"'tool_choice' names the tool {json.dumps(value.get('name'))}, which is not in 'tools'")
        return {"name": value["name"]}
    return "required" if kind == "any" else kind


def _tools(body: dict, resolved: Any) -> tuple[list[dict] | None, dict | None]:
    """(OpenAI-shaped tools to render, a JSON schema that forces a call or None)."""
    tools = body.get("tools")
    if tools is None:
        return None, None
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    fns = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise InvalidRequest(f"tools[{i}] must be an object")
        if t.get("type") not in (None, "custom"):
            raise InvalidRequest(f"tools[{i}]: Anthropic-defined tools ({json.dumps(t.get('type'))}) are not supported; "
                                 "define the tool with a 'name' and an 'input_schema'")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise InvalidRequest(f"tools[{i}].name must be a non-empty string")
        if not isinstance(t.get("input_schema"), dict):
            raise InvalidRequest(f"tools[{i}].input_schema must be a JSON schema object")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise InvalidRequest(f"tools[{i}].description must be a string")
            fn["description"] = t["description"]
        fns.append({"type": "function", "function": fn})
    checked = p.check_tools(fns, resolved.template)
    choice = _tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in fns])
    if not checked:
        return None, None
    return p.tool_choice_schema(checked, choice)


def _think(body: dict) -> bool | None:
    t = body.get("thinking")
    if t is None:
        return None
    if not isinstance(t, dict) or t.get("type") not in _THINK:
        raise InvalidRequest("'thinking' must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'disabled'} "
                             "or {'type': 'adaptive'}")
    p.get_int(t, "budget_tokens", 1)
    return _THINK[t["type"]]


def _options(body: dict, resolved: Any) -> tuple[SamplingOptions, int | None, list[str]]:
    """Sampling options over the model's Modelfile PARAMETERs; returns (options, num_ctx, the
    request's stop sequences)."""
    opts, num_ctx = p.base_options(resolved)
    opts.max_tokens = p.get_int(body, "max_tokens", 1, MAX_TOKENS)
    if opts.max_tokens is None:
        raise InvalidRequest("'max_tokens' is required")
    for key in ("temperature", "top_p"):  # Anthropic's range for both: 0..1
        if (v := p.get_float(body, key, 0.0, 1.0)) is not None:
            setattr(opts, key, v)
    if (v := p.get_int(body, "top_k", 0, 100_000)) is not None:
        opts.top_k = v
    if (v := p.get_int(body, "num_ctx", *PARAMETERS["num_ctx"][1:])) is not None:  # localrun extension, as on /v1
        num_ctx = v
    stops = p.get_stop(body.get("stop_sequences"), "stop_sequences")
    opts.stop = opts.stop + [s for s in stops if s not in opts.stop]  # the model's own stop strings stay
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise InvalidRequest("'metadata' must be an object")
    oc = body.get("output_config")
    if oc is not None and not isinstance(oc, dict):
        raise InvalidRequest("'output_config' must be an object")
    fmt = (oc or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise InvalidRequest("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}")
        opts.json_schema = p.check_json_schema(fmt["schema"])
    return opts, num_ctx, stops


# -- events -> response ----------------------------------------------------------------------------
def _usage(u: Usage) -> dict:
    return {"input_tokens": max(u.prompt_tokens - u.cached_tokens, 0), "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _stop_reason(done: Done | FinishedChoice, stops: list[str], max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how the service says the output ended."""
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "length":  # short of max_tokens: the context window ran out first
        return ("max_tokens" if done.usage.completion_tokens >= max_tokens else "model_context_window_exceeded"), None
    if done.stop_sequence is not None and done.stop_sequence in stops:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None  # the model ended its turn (or one of its template's stop strings did)


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_block(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": _input(call["arguments"])}


def _message(mid: str, model: str, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def sse_event(data: dict) -> bytes:
    """One server-sent event as Anthropic sends it: `event: <type>` then its JSON."""
    return (f"event: {data['type']}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


async def _with_pings(events: AsyncIterator[Any], every: float) -> AsyncIterator[Any]:
    """`events`, with None in between whenever `every` seconds pass without one (a ping is due).
    The pending event is waited for, never cancelled, so no event is lost; when the consumer
    goes away the wait is cancelled (as the stream itself would be)."""
    it = events.__aiter__()
    nxt: asyncio.Future | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            fut, nxt = nxt, None
            try:
                ev = fut.result()
            except StopAsyncIteration:
                return
            yield ev
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


class _Blocks:
    """Content blocks as they stream: one open text or thinking block at a time; a tool call
    comes whole (start, its input JSON in one delta, stop)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def piece(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self.open != kind:
            out += self.close()
            self.index, self.open = self.index + 1, kind
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def tool_use(self, call: dict) -> list[bytes]:
        block = _tool_use_block(call)
        out = self.close()
        self.index += 1
        out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}}))
        out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.append(sse_event({"type": "content_block_stop", "index": self.index}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event({"type": "content_block_stop", "index": self.index})]


def _stream_error(exc: BaseException) -> dict:
    if not isinstance(exc, LocalrunError):
        log.error("stream failed: %s: %s", type(exc).__name__, exc)
        exc = LocalrunError(f"internal error: {type(exc).__name__}")
    return anthropic_error(exc.status, exc.public_message, exc.code)


async def _service(coro):
    """Await a generation-service call, answering a full queue as Anthropic does (529)."""
    try:
        return await coro
    except Busy as exc:
        raise Overloaded(exc.message, retry_after=exc.retry_after) from None


# -- routes ----------------------------------------------------------------------------------------
def _job(st: State, body: dict, resolved: Any, opts: SamplingOptions, num_ctx: int | None, api: str) -> Job:
    messages = _messages(body)
    tools, forced = _tools(body, resolved)
    if forced is not None:
        if opts.json_schema is not None:
            raise InvalidRequest("a forced tool call ('tool_choice' any or tool) and 'output_config.format' "
                                 "cannot be asked for together")
        opts.json_schema = forced
    # a final assistant turn is a prefill: the answer continues it (its text is not repeated)
    return Job(resolved, opts, messages=messages, tools=tools, think=_think(body), num_ctx=num_ctx,
               keep_alive=st.keep_alive(body), api=api, images=take_images(messages),
               continue_final=messages[-1]["role"] == "assistant")


@router.post("/messages")
async def messages(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    stream = p.get_bool(body, "stream")
    resolved = await st.resolve(p.get_str(body, "model", required=True))
    opts, num_ctx, stops = _options(body, resolved)
    job = _job(st, body, resolved, opts, num_ctx, "anthropic.messages")
    max_tokens = opts.max_tokens

    if not stream:
        async def run():
            gen = await _service(st.generation.start(job))
            try:
                return gen, (await gen.collect())[0]
            finally:
                await gen.release()

        gen, ch = await until_disconnected(request, run())
        content: list[dict] = []
        if ch.reasoning:
            content.append({"type": "thinking", "thinking": ch.reasoning, "signature": ""})
        if ch.content:
            content.append({"type": "text", "text": ch.content})
        content += [_tool_use_block(c) for c in ch.tool_calls]
        return _message(f"msg_{gen.id[:24]}", gen.model, content, _stop_reason(ch, stops, max_tokens),
                        _usage(gen.usage))

    # the client going away while the request queues, loads or prefills cancels it (an agent's Esc)
    gen: Generation = await until_disconnected(request, _service(st.generation.start(job, prime=False)))
    # the prefill: errors within PING_EVERY are a status (4xx) as before; a longer one starts the stream,
    # kept alive by SSE comments until message_start, whose usage needs the first chunk (a runner that
    # tokenizes the prompt itself counts it there)
    primed = gen.prime_soon()
    try:
        await until_disconnected(request, asyncio.wait({primed}, timeout=PING_EVERY))
    except BaseException:
        await gen.release()
        raise
    if primed.done():
        primed.result()  # (a failure has given the lease back)
    blocks = _Blocks()

    async def produce() -> AsyncIterator[bytes]:
        if not primed.done():
            yield KEEPALIVE
            while not (await asyncio.wait({primed}, timeout=PING_EVERY))[0]:
                yield KEEPALIVE
        primed.result()  # a failure now goes out as the stream's error event
        # the prompt's split between the cache and the rest as the backend knows it at the first token (as
        # message_delta's usage will say it; a backend that does not say it counts the whole prompt here)
        start = _message(f"msg_{gen.id[:24]}", gen.model, [], (None, None), _usage(gen.usage))
        yield sse_event({"type": "message_start", "message": start})
        yield sse_event({"type": "ping"})  # as Anthropic: one at once, more while nothing else is sent
        done: Done | None = None
        async for ev in _with_pings(gen.events(), PING_EVERY):
            out: list[bytes] = []
            if ev is None:
                out.append(sse_event({"type": "ping"}))
            elif isinstance(ev, Delta):
                if ev.reasoning:
                    out += blocks.piece("thinking", ev.reasoning)
                if ev.content:
                    out += blocks.piece("text", ev.content)
            elif isinstance(ev, ToolCalls):
                for call in ev.calls:
                    out += blocks.tool_use(call)
            elif isinstance(ev, Done):
                done = ev
            for data in out:
                yield data
        for data in blocks.close():
            yield data
        reason, seq = _stop_reason(done or Done(0, "stop", gen.usage), stops, max_tokens)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": _usage(gen.usage)})
        yield sse_event({"type": "message_stop"})

    return generation_response(gen, produce, lambda exc: [sse_event(_stream_error(exc))])


@router.post("/messages/count_tokens")
async def count_tokens(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(p.get_str(body, "model", required=True))
    job = _job(st, body, resolved, SamplingOptions(), None, "anthropic.count_tokens")
    n = await until_disconnected(request, _service(st.generation.count_tokens(job)))
    return {"input_tokens": n}
