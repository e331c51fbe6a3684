"""OpenAI-compatible routes under /v1: JSON -> Job, events -> SSE (a translator only)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.backends.base import Infill, Usage
from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import params as p
from localrun.server.images import take_images
from localrun.server.disconnect import until_disconnected
from localrun.server.generation import Generation
from localrun.server.job import Delta, Done, FinishedChoice, Job, ToolCalls
from localrun.server.state import State, generation_response, json_body

router = APIRouter(prefix="/v1")
log = logging.getLogger("localrun.server")


def usage_body(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _model_obj(st: State, r: Any) -> dict:
    """OpenAI's model object, with vLLM's max_model_len: the context a request gets by default (clients
    such as LiteLLM size prompts by it)."""
    return {"id": r.name, "object": "model", "created": int(r.modified_at.timestamp()), "owned_by": "localrun",
            "max_model_len": st.manager.window(r)}


@router.get("/models")
async def list_models(request: Request):
    st: State = request.app.state.lr
    data = []
    for m in await st.list_models():
        try:
            data.append(_model_obj(st, await st.resolve(m.name)))
        except LocalrunError:  # removed meanwhile, or unreadable: listed as the library lists it
            data.append({"id": m.name, "object": "model", "created": int(m.modified_at.timestamp()),
                         "owned_by": "localrun"})
    return {"object": "list", "data": data}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    st: State = request.app.state.lr
    return _model_obj(st, await st.resolve(model_id))


def openai_options(body: dict, resolved: Any, chat: bool):
    """Sampling options from an OpenAI body over the model's Modelfile PARAMETERs;
    returns (options, num_ctx, n)."""
    opts, num_ctx = p.base_options(resolved)
    mt = p.get_int(body, "max_completion_tokens", 1, 1 << 20) if chat else None
    mt = mt if mt is not None else p.get_int(body, "max_tokens", 1, 1 << 20)
    if mt is not None:
        opts.max_tokens = mt
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                        ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                        ("repeat_penalty", 0.0, 10.0)):
        v = p.get_float(body, key, lo, hi)
        if v is not None:
            setattr(opts, key, v)
    if (v := p.get_int(body, "top_k", 0, 100_000)) is not None:
        opts.top_k = v
    if (v := p.get_int(body, "seed")) is not None:
        opts.seed = v
    if "stop" in body and body["stop"] is not None:
        opts.stop = p.get_stop(body["stop"])
    n = p.get_int(body, "n", 1, p.MAX_N, default=1)
    if (v := p.get_int(body, "num_ctx", 16, 1 << 20)) is not None:  # localrun extension
        num_ctx = v
    opts.ignore_eos = p.get_bool(body, "ignore_eos")  # vLLM/SGLang extension, for benchmarks
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("'best_of' is not supported")
    opts.logit_bias = p.get_logit_bias(body)
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
            opts.json_schema = p.check_json_schema(js["schema"])
    p.apply_structured(opts, body)  # vLLM's structured_outputs / guided_*, SGLang's regex / ebnf, llama-server's grammar
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object")
    return opts, num_ctx, n


def thinking_switch(body: dict) -> bool | None:
    """vLLM/SGLang's switch: chat_template_kwargs.enable_thinking."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return None
    if not isinstance(kw, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object")
    v = kw.get("enable_thinking")
    if v is not None and not isinstance(v, bool):
        raise InvalidRequest("'chat_template_kwargs.enable_thinking' must be true or false")
    return v


def _finish(reason: str) -> str:
    return "stop" if reason == "abort" else reason


def token_logprobs(lps: list) -> list[dict]:
    """Each token's token, logprob, bytes and top_logprobs alternatives: OpenAI chat's `content` entries,
    and Ollama's `logprobs` as they are."""
    def tok(t, lp, raw: bytes):  # (raw: the token's own bytes, where the text shows U+FFFD for a part of a character)
        return {"token": t, "logprob": lp, "bytes": list(raw)}

    return [{**tok(x.token, x.logprob, x.token_bytes),
             "top_logprobs": [tok(t, lp, x.top_bytes(k)) for k, (t, lp) in enumerate(x.top)]} for x in lps]


def _chat_logprobs(lps: list) -> dict:
    return {"content": token_logprobs(lps)}


def _completion_logprobs(lps: list, offset0: int = 0) -> dict:
    """OpenAI's legacy logprobs object; a prompt's first token (echo) has null logprob and top_logprobs."""
    offsets, pos = [], offset0
    for x in lps:
        offsets.append(pos)
        pos += len(x.token)
    return {"tokens": [x.token for x in lps], "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [None if x.logprob is None else {t: lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def _tool_calls(calls: list[dict]) -> list[dict]:
    return [{"id": k["id"], "type": "function", "function": {"name": k["name"], "arguments": k["arguments"]}}
            for k in calls]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def stream_error(exc: BaseException) -> dict:
    """An error inside a stream, in OpenAI's error shape (the HTTP status was already 200)."""
    if not isinstance(exc, LocalrunError):
        log.error("stream failed: %s: %s", type(exc).__name__, exc)
        exc = LocalrunError(f"internal error: {type(exc).__name__}")
    etype = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.public_message, "type": etype, "param": None, "code": exc.code}}


async def _run_to_end(st: State, job: Job) -> tuple[Generation, list[FinishedChoice]]:
    gen = await st.generation.start(job)
    try:
        return gen, await gen.collect()
    finally:
        await gen.release()


async def _collect(request: Request, st: State, job: Job) -> tuple[Generation, list[FinishedChoice]]:
    return await until_disconnected(request, _run_to_end(st, job))


def _body(obj_type: str, cid: str, created: int, gen: Generation, choices: list) -> dict:
    u = gen.usage
    return {"id": cid, "object": obj_type, "created": created, "model": gen.model, "choices": choices,
            "usage": usage_body(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            "system_fingerprint": "localrun"}


def _sse_response(obj_type: str, cid: str, created: int, gen: Generation, include_usage: bool, render, cut):
    """SSE for chat and text completions: `render(event, chunk)` yields the choices' chunks;
    this adds the usage chunk and `data: [DONE]`, and gives the model back however the stream
    ends. An error mid-stream (a runner that died, the daemon stopping) ends the choice being
    streamed: a last chunk with finish_reason "abort" (`cut(index)`) and the error object, then
    [DONE]: SDKs raise instead of returning a silently cut answer."""

    def chunk(choices: list, usage: dict | None = None, **extra) -> bytes:
        obj = {"id": cid, "object": obj_type, "created": created, "model": gen.model, "choices": choices,
               "system_fingerprint": "localrun", **extra}
        if include_usage:
            obj["usage"] = usage
        return sse(obj)

    index = 0

    async def produce() -> AsyncIterator[bytes]:
        nonlocal index
        async for ev in gen.events():
            index = ev.index
            for data in render(ev, chunk):
                yield data
        if include_usage:
            u = gen.usage
            yield chunk([], usage_body(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
        yield b"data: [DONE]\n\n"

    return generation_response(gen, produce, lambda exc: [chunk([cut(index)], **stream_error(exc)), b"data: [DONE]\n\n"])


@router.post("/chat/completions")
async def chat_completions(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = p.get_str(body, "model", required=True)
    messages = p.normalize_messages(body.get("messages"))
    stream = p.get_bool(body, "stream")
    resolved = await st.resolve(model)
    opts, num_ctx, n = openai_options(body, resolved, chat=True)
    p.apply_logprobs(opts, body)
    tools = p.check_tools(body.get("tools"), resolved.template)
    if not tools and body.get("tool_choice") not in (None, "auto", "none"):
        # a call asked for and no tool to call: refused, as OpenAI does, not answered with text
        raise InvalidRequest("'tool_choice' asks for a tool call, which needs 'tools'")
    if tools:
        tools, forced = p.tool_choice_schema(tools, body.get("tool_choice"))
        if forced is not None:
            if opts.own_constraint():
                raise InvalidRequest("'tool_choice' forces a tool call, whose arguments are JSON: it cannot be "
                                     "combined with a regex, choice or grammar constraint")
            opts.json_schema = forced
    most = None if p.get_bool(body, "parallel_tool_calls", default=True) else 1  # false: one call at most
    think, effort = p.reasoning_effort(body.get("reasoning_effort"), "reasoning_effort")
    if (switch := thinking_switch(body)) is not None:  # chat_template_kwargs.enable_thinking says it outright
        think = switch
    # vLLM's continue_final_message: the answer goes on from the last (assistant) message's text
    cont = p.get_bool(body, "continue_final_message")
    if cont and p.get_bool(body, "add_generation_prompt", default=False):
        raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true")
    job = Job(resolved, opts, messages=messages, tools=tools, think=think, effort=effort, num_ctx=num_ctx,
              continue_final=cont,
              keep_alive=st.keep_alive(body), n=n, api="openai.chat", images=take_images(messages),
              cache_key=p.cache_key(body))
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    if not stream:
        gen, results = await _collect(request, st, job)
        choices = []
        for ch in results:
            msg: dict[str, Any] = {"role": "assistant", "content": ch.content if not ch.tool_calls else (ch.content or None)}
            if ch.reasoning:
                msg["reasoning_content"] = ch.reasoning
            if ch.tool_calls:
                msg["tool_calls"] = _tool_calls(ch.tool_calls[:most])
            choices.append({"index": ch.index, "message": msg, "finish_reason": _finish(ch.finish_reason),
                            "logprobs": _chat_logprobs(ch.logprobs) if opts.logprobs else None})
        return _body("chat.completion", cid, created, gen, choices)

    gen = await until_disconnected(request, st.generation.start(job))
    opened: set[int] = set()

    def render(ev, chunk):
        if ev.index not in opened:
            opened.add(ev.index)
            yield chunk([{"index": ev.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        if isinstance(ev, Delta):
            delta: dict[str, Any] = {}
            if ev.reasoning:
                delta["reasoning_content"] = ev.reasoning
            if ev.content or not ev.reasoning:
                delta["content"] = ev.content
            yield chunk([{"index": ev.index, "delta": delta, "finish_reason": None,
                          "logprobs": _chat_logprobs(ev.logprobs) if ev.logprobs else None}])
        elif isinstance(ev, ToolCalls):
            calls = [{"index": k, **tc} for k, tc in enumerate(_tool_calls(ev.calls[:most]))]
            yield chunk([{"index": ev.index, "delta": {"tool_calls": calls}, "finish_reason": None, "logprobs": None}])
        elif isinstance(ev, Done):
            yield chunk([{"index": ev.index, "delta": {}, "finish_reason": _finish(ev.finish_reason), "logprobs": None}])

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    cut = lambda i: {"index": i, "delta": {}, "finish_reason": "abort", "logprobs": None}  # noqa: E731
    return _sse_response("chat.completion.chunk", cid, created, gen, include_usage, render, cut)


MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch: lm-eval's batch_size, scoring scripts)
BATCH_CONCURRENCY = 16  # of a batch's prompts, this many are started at once (the rest wait their turn)


def _prompts(value: Any) -> list[str | list[int]]:
    """/v1/completions' `prompt`: a string, an array of token ids, or a batch (an array of either)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'prompt' must be a string, an array of token ids, or an array of those (a batch)")
    if not all(isinstance(x, (str, list)) for x in value):
        return [p.token_ids(value, "prompt", ", or a string")]
    if len(value) > MAX_PROMPTS:  # a batch
        raise InvalidRequest(f"'prompt' is a batch of {len(value)} prompts; at most {MAX_PROMPTS}")
    out: list[str | list[int]] = []
    for x in value:
        if isinstance(x, list):
            if not x:
                raise InvalidRequest("'prompt' must be a string, or a non-empty array of token ids (integers)")
            x = p.token_ids(x, "prompt", ", or a string")
        out.append(x)
    return out


@router.post("/completions")
async def completions(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = p.get_str(body, "model", required=True)
    prompts = _prompts(body.get("prompt"))
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string")
    echo = p.get_bool(body, "echo")
    # input_extra (llama-server's, a localrun extension here): other files of the project, laid out before the
    # prompt with the model's repository tokens; it makes the request a fill in the middle (the suffix may be empty)
    extra = p.infill_extra(body.get("input_extra"))
    if extra and not suffix:
        suffix = ""
    fim = bool(suffix) or bool(extra)
    if fim and (echo or len(prompts) > 1 or not isinstance(prompts[0], str)):
        raise InvalidRequest("'suffix' and 'input_extra' take one prompt, as text, and no 'echo'")
    for x in prompts:
        if isinstance(x, str) and not x.strip() and not fim:
            raise InvalidRequest("'prompt' must not be empty")
    stream = p.get_bool(body, "stream")
    if stream and len(prompts) > 1:
        raise InvalidRequest(f"a stream takes one prompt; this batch has {len(prompts)}: send them without "
                             "'stream', or as separate requests")
    max_tokens = body.get("max_tokens")
    score_only = max_tokens == 0 and not isinstance(max_tokens, bool)  # the prompt scored, nothing generated
    if score_only:
        if not echo:
            raise InvalidRequest("'max_tokens' must be at least 1 (0 only with 'echo': the prompt, scored with "
                                 "'logprobs', and nothing generated)")
        body = {**body, "max_tokens": None}
    resolved = await st.resolve(model)
    opts, num_ctx, n = openai_options(body, resolved, chat=False)
    if score_only:
        opts.max_tokens = 0
    elif opts.max_tokens is None and max_tokens is None:
        opts.max_tokens = 16 if not resolved.parameters.get("num_predict") else opts.max_tokens  # OpenAI's default
    lp = p.get_int(body, "logprobs", 0, p.MAX_TOP_LOGPROBS)  # (OpenAI: 5; vLLM: 20)
    if lp is not None:
        opts.logprobs, opts.top_logprobs = True, lp
        if echo:  # each prompt token's logprob too (lm-eval's loglikelihood: echo, logprobs, max_tokens 1)
            opts.prompt_logprobs = lp
    # a suffix: fill in the middle between prompt and suffix (the model's FIM tokens; 400 without them)
    infill = Infill(prefix=prompts[0], suffix=suffix or "", extra=extra) if fim else None

    def job_for(x: str | list[int]) -> Job:
        ids = x if isinstance(x, list) else None
        return Job(resolved, replace(opts), prompt="" if ids is not None or infill is not None else x, raw=True,
                   num_ctx=num_ctx, keep_alive=st.keep_alive(body), n=n, api="openai.completions", infill=infill,
                   token_prompt=ids)

    async def echoed(x: str | list[int]) -> str:
        """The text echoed for a prompt: token ids as detokenizing writes them (special tokens too)."""
        if not echo:
            return ""
        return x if isinstance(x, str) else await st.generation.detokenize(resolved, x, keep_alive=st.keep_alive(body))

    async def prompt_chars(x: str | list[int]) -> int:
        """Where the answer's text starts, for logprobs' text_offset (counted from the prompt's start, as
        OpenAI and vLLM count it, echoed or not)."""
        if not opts.logprobs:
            return 0
        return len(x) if isinstance(x, str) else len(await st.generation.detokenize(
            resolved, x, keep_alive=st.keep_alive(body)))

    def logprobs_of(ch, start: int) -> dict | None:
        if not opts.logprobs:
            return None
        if echo:  # the prompt's tokens from 0, the answer's after them
            return _completion_logprobs((ch.prompt_logprobs or []) + ch.logprobs)
        return _completion_logprobs(ch.logprobs, start)

    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    if not stream:
        if len(prompts) == 1:
            gen, results = await _collect(request, st, job_for(prompts[0]))
            text, start = await echoed(prompts[0]), await prompt_chars(prompts[0])
            choices = [{"index": ch.index, "text": text + ch.content, "finish_reason": _finish(ch.finish_reason),
                        "logprobs": logprobs_of(ch, start)} for ch in results]
            return _body("text_completion", cid, created, gen, choices)
        runs = await until_disconnected(request, _collect_batch(st, [job_for(x) for x in prompts]))
        choices, usage = [], Usage()
        for k, (x, (gen, results)) in enumerate(zip(prompts, runs)):
            text, start = await echoed(x), await prompt_chars(x)
            for ch in results:
                choices.append({"index": k * n + ch.index, "text": text + ch.content,
                                "finish_reason": _finish(ch.finish_reason), "logprobs": logprobs_of(ch, start)})
            usage.prompt_tokens += gen.usage.prompt_tokens
            usage.completion_tokens += gen.usage.completion_tokens
            usage.cached_tokens += gen.usage.cached_tokens
        return {"id": cid, "object": "text_completion", "created": created, "model": runs[0][0].model,
                "choices": choices, "usage": usage_body(usage.prompt_tokens, usage.completion_tokens,
                                                        usage.cached_tokens),
                "system_fingerprint": "localrun"}

    text0, start0 = await echoed(prompts[0]), await prompt_chars(prompts[0])
    gen = await until_disconnected(request, st.generation.start(job_for(prompts[0])))  # stale IDE completions
    sent: set[int] = set()
    offset: dict[int, int] = {}  # each choice's next token's text_offset: counted on from chunk to chunk

    def render(ev, chunk):
        if echo and ev.index not in sent:
            sent.add(ev.index)
            plps = ev.prompt_logprobs if isinstance(ev, Delta) else None
            lp = _completion_logprobs(plps) if opts.logprobs and plps else None
            if lp:
                offset[ev.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            yield chunk([{"index": ev.index, "text": text0, "finish_reason": None, "logprobs": lp}])
        if isinstance(ev, Delta) and (ev.content or ev.logprobs):
            lp = None
            if ev.logprobs:
                lp = _completion_logprobs(ev.logprobs, offset.get(ev.index, start0))
                offset[ev.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            yield chunk([{"index": ev.index, "text": ev.content, "finish_reason": None, "logprobs": lp}])
        elif isinstance(ev, Done):
            yield chunk([{"index": ev.index, "text": "", "finish_reason": _finish(ev.finish_reason), "logprobs": None}])

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    cut = lambda i: {"index": i, "text": "", "finish_reason": "abort", "logprobs": None}  # noqa: E731
    return _sse_response("text_completion", cid, created, gen, include_usage, render, cut)


async def _collect_batch(st: State, jobs: list[Job]) -> list[tuple[Generation, list[FinishedChoice]]]:
    """Every job run to its end, at most BATCH_CONCURRENCY at once; the first failure ends the rest
    (and is raised)."""
    return await gather_bounded([lambda job=job: _run_to_end(st, job) for job in jobs], BATCH_CONCURRENCY)


async def gather_bounded(calls: list, limit: int) -> list:
    """Each of `calls` (no-argument coroutine functions) awaited, at most `limit` at once, their results in
    order; the first failure cancels the rest (and is raised)."""
    gate = asyncio.Semaphore(limit)

    async def one(call):
        async with gate:
            return await call()

    tasks = [asyncio.ensure_future(one(c)) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@router.post("/embeddings")
async def embeddings(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    model = p.get_str(body, "model", required=True)
    texts = p.embed_inputs(body.get("input"), "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'")
    dims = p.get_int(body, "dimensions", 1)
    resolved = await st.resolve(model)
    vectors, n_tokens = await until_disconnected(request, st.generation.embed(  # (a client gone: the work stops)
        resolved, texts, keep_alive=st.keep_alive(body), dimensions=dims))
    if fmt == "base64":  # little-endian float32, as OpenAI sends it (the SDK's default)
        vectors = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]
    return {"object": "list", "model": resolved.name,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
