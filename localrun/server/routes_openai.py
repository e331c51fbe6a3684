"""OpenAI-compatible routes under /v1."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import common as c
from localrun.server.state import State, json_body, sse_response

router = APIRouter(prefix="/v1")
log = logging.getLogger("localrun.server")


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _model_obj(name: str, created: float) -> dict:
    return {"id": name, "object": "model", "created": int(created), "owned_by": "localrun"}


@router.get("/models")
async def list_models(request: Request):
    st: State = request.app.state.lr
    models = await st.list_models()
    return {"object": "list", "data": [_model_obj(m.name, m.modified_at.timestamp()) for m in models]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    st: State = request.app.state.lr
    r = await st.resolve(model_id)
    return _model_obj(r.name, r.modified_at.timestamp())


def _common_options(body: dict, resolved: Any, chat: bool):
    opts, num_ctx = c.base_options(resolved)
    mt = c.get_int(body, "max_completion_tokens", 1, 1 << 20) if chat else None
    mt = mt if mt is not None else c.get_int(body, "max_tokens", 1, 1 << 20)
    if mt is not None:
        opts.max_tokens = mt
    for key, attr, lo, hi in (("temperature", "temperature", 0.0, 2.0), ("top_p", "top_p", 0.0, 1.0),
                              ("min_p", "min_p", 0.0, 1.0), ("presence_penalty", "presence_penalty", -2.0, 2.0),
                              ("frequency_penalty", "frequency_penalty", -2.0, 2.0),
                              ("repeat_penalty", "repeat_penalty", 0.0, 10.0)):
        v = c.get_float(body, key, lo, hi)
        if v is not None:
            setattr(opts, attr, v)
    if (v := c.get_int(body, "top_k", 0, 100_000)) is not None:
        opts.top_k = v
    if (v := c.get_int(body, "seed")) is not None:
        opts.seed = v
    if "stop" in body and body["stop"] is not None:
        opts.stop = c.get_stop(body["stop"])
    n = c.get_int(body, "n", 1, c.MAX_N, default=1)
    if (v := c.get_int(body, "num_ctx", 16, 1 << 20)) is not None:  # localrun extension
        num_ctx = v
    opts.ignore_eos = c.get_bool(body, "ignore_eos")  # vLLM/SGLang extension, for benchmarks
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("'best_of' is not supported")
    if body.get("logit_bias"):
        raise InvalidRequest("'logit_bias' is not supported")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequest("'response_format.type' must be text, json_object or json_schema")
        if rf["type"] == "json_object":
            opts.json_mode = True
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise InvalidRequest("'response_format.json_schema' must be {'name': ..., 'schema': {...}}")
            opts.json_schema = c.check_json_schema(js["schema"])
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object")
    return opts, num_ctx, n


def _seeded(opts, i: int):
    if opts.seed is not None and i:
        from dataclasses import replace

        return replace(opts, seed=opts.seed + i)
    return opts


def _chat_logprobs(lps: list) -> dict:
    def tok(t, lp):
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**tok(x.token, x.logprob), "top_logprobs": [tok(t, lp) for t, lp in x.top]} for x in lps]}


def _completion_logprobs(lps: list, offset0: int = 0) -> dict:
    offsets, pos = [], offset0
    for x in lps:
        offsets.append(pos)
        pos += len(x.token)
    return {"tokens": [x.token for x in lps], "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{t: lp for t, lp in x.top} for x in lps], "text_offset": offsets}


def stream_error(exc: BaseException) -> dict:
    """An error inside a stream, in OpenAI's error shape (the HTTP status was already 200)."""
    if not isinstance(exc, LocalrunError):
        log.exception("stream failed")
        exc = LocalrunError(f"internal error: {type(exc).__name__}")
    etype = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.public_message, "type": etype, "param": None, "code": exc.code}}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _lease_requests(st: State, resolved: Any, body: dict, num_ctx: int, prompt: str, opts, n: int):
    """Lease the model for a streamed answer and prepare its n requests; errors (queue full,
    load failure, prompt too long) raise here, before the 200, and release the lease."""
    lease, release = await st.lease(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body))
    try:
        first = await c.prepare_request(lease, prompt, opts, add_special=True)
        reqs = [first] + [await c.prepare_request(lease, prompt, _seeded(opts, i), add_special=True,
                                                  ids=first.prompt_token_ids) for i in range(1, n)]
    except BaseException:
        await release()
        raise
    return lease, release, reqs


def _completion_body(obj_type: str, cid: str, created: int, name: str, choices: list, results: list) -> dict:
    """A non-streamed answer: the n choices and their usage (the prompt counted once)."""
    u = results[0].usage
    return {"id": cid, "object": obj_type, "created": created, "model": name, "choices": choices,
            "usage": _usage(u.prompt_tokens, sum(r.usage.completion_tokens for r in results), u.cached_tokens),
            "system_fingerprint": "localrun"}


class _Totals:
    """Usage summed over the n choices of one streamed answer."""

    def __init__(self) -> None:
        self.prompt_tokens = self.cached = self.completion = 0

    def add(self, usage) -> None:
        self.prompt_tokens, self.cached = usage.prompt_tokens, usage.cached_tokens
        self.completion += usage.completion_tokens


def _sse_stream(obj_type: str, cid: str, created: int, name: str, include_usage: bool, release, produce):
    """The SSE response shared by chat and text completions: `produce(chunk, totals)` yields the
    choices' chunks; this adds the usage chunk, `data: [DONE]`, errors in OpenAI's shape, and
    releases the model lease however the stream ends."""

    def chunk(choices: list, usage: dict | None = None) -> bytes:
        obj = {"id": cid, "object": obj_type, "created": created, "model": name, "choices": choices,
               "system_fingerprint": "localrun"}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    async def events() -> AsyncIterator[bytes]:
        totals = _Totals()
        try:
            async for data in produce(chunk, totals):
                yield data
            if include_usage:
                yield chunk([], _usage(totals.prompt_tokens, totals.completion, totals.cached))
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - an error event, then a proper end (as vLLM does)
            yield _sse(stream_error(exc))
            yield b"data: [DONE]\n\n"
        finally:
            await release()

    return sse_response(events(), release)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = c.get_str(body, "model", required=True)
    messages = c.normalize_messages(body.get("messages"))
    stream = c.get_bool(body, "stream")
    resolved = await st.resolve(model)
    opts, num_ctx, n = _common_options(body, resolved, chat=True)
    if c.get_bool(body, "logprobs"):
        opts.logprobs = True
        opts.top_logprobs = c.get_int(body, "top_logprobs", 0, c.MAX_TOP_LOGPROBS, default=0)
    elif body.get("top_logprobs") is not None:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    tools = c.check_tools(body.get("tools"), resolved.template)
    forced = None
    if tools:
        tools, forced = c.tool_choice_schema(tools, body.get("tool_choice"))
        if forced is not None:
            opts.json_schema = forced
    prompt = c.chat_prompt(resolved, messages, tools)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    name = resolved.name

    def finish(res: c.Result) -> tuple[dict, str]:
        content, calls = c.parse_tool_calls(res.text, tools)
        msg: dict[str, Any] = {"role": "assistant", "content": content if not calls else (content or None)}
        reason = res.finish_reason if res.finish_reason != "abort" else "stop"
        if calls:
            msg["tool_calls"] = calls
            reason = "tool_calls"
        return msg, reason

    if not stream:
        async def run():
            async with st.manager.use(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body)) as lease:
                results, ids = [], None
                for i in range(n):
                    req = await c.prepare_request(lease, prompt, _seeded(opts, i), add_special=True, ids=ids)
                    ids = req.prompt_token_ids
                    results.append(await c.collect(lease, req))
                return results

        results = await c.until_disconnected(request, run())
        choices = []
        for i, res in enumerate(results):
            msg, reason = finish(res)
            ch = {"index": i, "message": msg, "finish_reason": reason, "logprobs": None}
            if opts.logprobs:
                ch["logprobs"] = _chat_logprobs(res.logprobs)
            choices.append(ch)
        return _completion_body("chat.completion", cid, created, name, choices, results)

    lease, release, reqs = await _lease_requests(st, resolved, body, num_ctx, prompt, opts, n)

    async def produce(chunk, totals: _Totals) -> AsyncIterator[bytes]:
        for i, req in enumerate(reqs):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            held: list[str] = []
            async for ch in c.stream(lease, req):
                if ch.text or ch.logprobs:
                    if tools:  # tool calls are parsed from the whole answer
                        held.append(ch.text)
                    else:
                        delta = {"index": i, "delta": {"content": ch.text}, "finish_reason": None,
                                 "logprobs": _chat_logprobs(ch.logprobs) if ch.logprobs else None}
                        yield chunk([delta])
                if ch.finish_reason:
                    totals.add(ch.usage)
                    res = c.Result(text="".join(held) + (ch.text if tools else ""), finish_reason=ch.finish_reason)
                    msg, reason = finish(res) if tools else ({}, res.finish_reason if res.finish_reason != "abort" else "stop")
                    delta: dict[str, Any] = {}
                    if tools:
                        if msg.get("content"):
                            delta["content"] = msg["content"]
                        if msg.get("tool_calls"):
                            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
                    yield chunk([{"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}])

    return _sse_stream("chat.completion.chunk", cid, created, name, include_usage, release, produce)


@router.post("/completions")
async def completions(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = c.get_str(body, "model", required=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string")
    if not prompt.strip():
        raise InvalidRequest("'prompt' must not be empty")
    stream = c.get_bool(body, "stream")
    resolved = await st.resolve(model)
    opts, num_ctx, n = _common_options(body, resolved, chat=False)
    if opts.max_tokens is None and body.get("max_tokens") is None:
        opts.max_tokens = 16 if not resolved.parameters.get("num_predict") else opts.max_tokens  # OpenAI's default
    lp = c.get_int(body, "logprobs", 0, 5)
    if lp is not None:
        opts.logprobs, opts.top_logprobs = True, lp
    if body.get("suffix"):
        raise InvalidRequest("'suffix' is not supported")
    echo = c.get_bool(body, "echo")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    name = resolved.name

    if not stream:
        async def run():
            async with st.manager.use(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body)) as lease:
                results, ids = [], None
                for i in range(n):
                    req = await c.prepare_request(lease, prompt, _seeded(opts, i), add_special=True, ids=ids)
                    ids = req.prompt_token_ids
                    results.append(await c.collect(lease, req))
                return results

        results = await c.until_disconnected(request, run())
        choices = [{"index": i, "text": (prompt if echo else "") + r.text,
                    "finish_reason": r.finish_reason if r.finish_reason != "abort" else "stop",
                    "logprobs": _completion_logprobs(r.logprobs) if opts.logprobs else None}
                   for i, r in enumerate(results)]
        return _completion_body("text_completion", cid, created, name, choices, results)

    lease, release, reqs = await _lease_requests(st, resolved, body, num_ctx, prompt, opts, n)

    async def produce(chunk, totals: _Totals) -> AsyncIterator[bytes]:
        for i, req in enumerate(reqs):
            if echo:
                yield chunk([{"index": i, "text": prompt, "finish_reason": None, "logprobs": None}])
            async for ch in c.stream(lease, req):
                if ch.text or ch.finish_reason:
                    reason = None
                    if ch.finish_reason:
                        reason = ch.finish_reason if ch.finish_reason != "abort" else "stop"
                        totals.add(ch.usage)
                    yield chunk([{"index": i, "text": ch.text, "finish_reason": reason,
                                  "logprobs": _completion_logprobs(ch.logprobs) if ch.logprobs else None}])

    return _sse_stream("text_completion", cid, created, name, include_usage, release, produce)


@router.post("/embeddings")
async def embeddings(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = c.get_str(body, "model", required=True)
    texts = _embed_inputs(body.get("input"), "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'")
    resolved = await st.resolve(model)
    async with st.manager.use(resolved, keep_alive=st.keep_alive(body)) as lease:
        vectors = await lease.backend.embed(texts)
        n_tokens = sum([len(await lease.backend.tokenize(t, add_special=True)) for t in texts])
    dims = c.get_int(body, "dimensions", 1)
    if dims is not None:
        vectors = [v[:dims] for v in vectors]
    if fmt == "base64":  # little-endian float32, as OpenAI sends it (the SDK's default)
        import base64
        import struct

        vectors = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]
    return {"object": "list", "model": resolved.name,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


MAX_EMBED_INPUTS = 256


def _embed_inputs(value: Any, key: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(f"'{key}' must be a non-empty string or a list of strings")
    if len(texts) > MAX_EMBED_INPUTS:
        raise InvalidRequest(f"'{key}' holds {len(texts)} strings; the limit is {MAX_EMBED_INPUTS}")
    if any(not t.strip() for t in texts):
        raise InvalidRequest(f"'{key}' must not contain empty strings")
    return texts

