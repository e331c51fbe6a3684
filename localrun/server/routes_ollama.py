"""Ollama-shaped generation under /api: generate, chat, embeddings (NDJSON streams; timing stats at the end).

Model management (tags, show, pull, create, blobs, ...): :mod:`localrun.server.routes_ollama_models`.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from localrun.backends.base import MEDIA_MARKER, Infill, SamplingOptions
from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import params as c
from localrun.server.disconnect import until_disconnected
from localrun.server.generation import Generation
from localrun.server.job import Delta, Done, Job, ToolCalls
from localrun.server.images import from_base64, take_images
from localrun.server.placement import with_load_options
from localrun.server.routes_ollama_models import model_name
from localrun.server.routes_openai import token_logprobs
from localrun.server.state import State, generation_response, json_body, ndjson

router = APIRouter(prefix="/api")
log = logging.getLogger("localrun.server")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _format(opts: SamplingOptions, fmt: Any) -> None:
    if fmt in (None, ""):
        return
    if fmt == "json":
        opts.json_mode = True
    elif isinstance(fmt, dict):
        opts.json_schema = c.check_json_schema(fmt)
    else:
        raise InvalidRequest("'format' must be \"json\" or a JSON schema object")


def _stats(gen: Generation, t0: int) -> dict:
    u = gen.usage
    return {
        "total_duration": time.perf_counter_ns() - t0,
        "load_duration": int(gen.load_seconds * 1e9),
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": int(u.prompt_eval_seconds * 1e9),
        "eval_count": u.completion_tokens,
        "eval_duration": int(u.eval_seconds * 1e9),
        "cached_tokens": u.cached_tokens,
    }


async def _load_only(st: State, resolved, body: dict, num_ctx: int | None, chat: bool) -> dict:
    ka = st.manager.keep_alive_seconds(st.keep_alive(body))
    if ka == 0:
        await st.manager.unload(resolved.name)
        reason = "unload"
    else:
        await st.manager.load(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body))
        reason = "load"
    out = {"model": resolved.name, "created_at": _now(), "done": True, "done_reason": reason}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


def _calls(calls: list[dict]) -> list[dict]:
    return [{"function": {"name": k["name"], "arguments": _loads(k["arguments"])}} for k in calls]


async def _run(request: Request, st: State, body: dict, job: Job, chat: bool):
    """Events -> Ollama's NDJSON (or one JSON object when stream is false)."""
    t0 = time.perf_counter_ns()
    stream = c.get_bool(body, "stream", True)
    name = job.resolved.name

    def piece(content: str = "", thinking: str = "", calls: list[dict] | None = None) -> dict:
        out: dict[str, Any] = {"model": name, "created_at": _now()}
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = _calls(calls)
            out["message"] = msg
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(gen: Generation, reason: str) -> dict:
        out = piece()
        out.update(done=True, done_reason="stop" if reason in ("abort", "tool_calls") else reason, **_stats(gen, t0))
        if not chat and gen.prompt_ids is not None and not body.get("raw"):
            # /api/generate: the prompt's and the answer's token ids (none in raw mode, as Ollama's)
            out["context"] = [*gen.prompt_ids, *gen.output_ids.get(0, [])]
        return out

    if not stream:
        async def run():
            gen = await st.generation.start(job)
            try:
                ch = (await gen.collect())[0]
            finally:
                await gen.release()
            out = final(gen, ch.finish_reason)
            if chat:
                out["message"] = piece(ch.content, ch.reasoning, ch.tool_calls)["message"]
            else:
                out["response"] = ch.content
                if ch.reasoning:
                    out["thinking"] = ch.reasoning
            if job.options.logprobs:
                out["logprobs"] = token_logprobs(ch.logprobs or [])
            return out

        return await until_disconnected(request, run())

    # a client that leaves while the prompt is prefilled (an IDE's stale completion) stops the work
    gen = await until_disconnected(request, st.generation.start(job))

    async def produce() -> AsyncIterator[bytes]:
        async for ev in gen.events():
            if isinstance(ev, Delta) and (ev.content or ev.reasoning or ev.logprobs):
                out = piece(ev.content, ev.reasoning)
                if ev.logprobs:
                    out["logprobs"] = token_logprobs(ev.logprobs)
                yield ndjson(out)
            elif isinstance(ev, ToolCalls):
                yield ndjson(piece(calls=ev.calls))
            elif isinstance(ev, Done):
                yield ndjson(final(gen, ev.finish_reason))

    def failed(exc: Exception) -> list[bytes]:  # a last line with done and the error (Ollama's clients raise)
        if not isinstance(exc, LocalrunError):
            log.error("stream failed: %s: %s", type(exc).__name__, exc)
            exc = LocalrunError(f"internal error: {type(exc).__name__}")
        out = piece()
        out.update(done=True, done_reason="abort", error=exc.public_message, status=exc.status)
        return [ndjson(out)]

    return generation_response(gen, produce, failed, lines=True)


def _loads(s: str):
    import json

    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return s


def _think(body: dict) -> tuple[bool | None, str | None]:
    """(Job.think, Job.effort): true, false, or a level (gpt-oss's low, medium, high: thinking on, with
    that reasoning effort)."""
    v = body.get("think")
    if v is None or isinstance(v, bool):
        return v, None
    if v in ("low", "medium", "high"):
        return True, v
    raise InvalidRequest("'think' must be true, false, or one of low, medium, high")


async def _resolve_with_options(st: State, body: dict):
    """The model, its sampling options (Modelfile PARAMETERs, then the request's `options`)
    and the context window for a /api/generate or /api/chat request."""
    # num_thread / num_gpu in the request's options: how the model is loaded (a reload when they differ)
    resolved = with_load_options(await st.resolve(model_name(body)), body.get("options"))
    opts, num_ctx = c.base_options(resolved)
    req_ctx = c.apply_ollama_options(opts, body.get("options"))
    c.apply_logprobs(opts, body)  # top level, not in options
    return resolved, opts, req_ctx or num_ctx


@router.post("/generate")
async def generate(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved, opts, num_ctx = await _resolve_with_options(st, body)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string")
    images = body.get("images")
    if images is not None and not isinstance(images, list):
        raise InvalidRequest("'images' must be a list of base64 strings")
    images = [from_base64(b, f"images[{k}]") for k, b in enumerate(images or [])] or None
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string")
    if images and suffix:
        raise InvalidRequest("'images' and 'suffix' cannot be combined: fill in the middle takes text only")
    context = body.get("context")
    if context is not None:
        c.token_ids(context, "context", ": the 'context' of an earlier /api/generate answer")
        if suffix:
            raise InvalidRequest("'context' and 'suffix' cannot be combined: fill in the middle starts afresh")
    if not prompt and not images and not suffix and not body.get("input_extra"):
        return await _load_only(st, resolved, body, num_ctx, chat=False)
    _format(opts, body.get("format"))
    raw = c.get_bool(body, "raw")
    if raw and (body.get("system") or body.get("template") or context):  # as Ollama answers it
        raise InvalidRequest("raw mode does not support template, system, or context: a raw prompt is sent to "
                             "the model as it is")
    prompt = prompt or ""
    if images and raw and prompt.count(MEDIA_MARKER) != len(images):
        raise InvalidRequest(f"a raw prompt with images must hold {MEDIA_MARKER} where each image goes "
                             f"({len(images)} of them)")
    if images and not raw:
        prompt = MEDIA_MARKER * len(images) + prompt  # before the text, as Ollama places them
    # a suffix asks for the code between prompt and suffix (fill in the middle), laid out with the model's
    # FIM tokens as Ollama's insert templates do; the model's chat template is not used then
    # input_extra (llama-server's, a localrun extension here): other files of the project, laid out before it
    # with the model's repository tokens; it makes the request a fill in the middle, the suffix may be empty
    extra = c.infill_extra(body.get("input_extra"))
    if extra and images:
        raise InvalidRequest("'images' and 'input_extra' cannot be combined: fill in the middle takes text only")
    if extra and context:
        raise InvalidRequest("'context' and 'input_extra' cannot be combined: fill in the middle starts afresh")
    infill = Infill(prefix=prompt, suffix=suffix or "", extra=extra) if suffix or extra else None
    think, effort = _think(body)
    job = Job(resolved, opts, prompt=prompt if infill is None else "", raw=raw or infill is not None, images=images,
              system=c.get_str(body, "system"), template=c.get_str(body, "template"), think=think, effort=effort,
              num_ctx=num_ctx, keep_alive=st.keep_alive(body), api="ollama.generate", infill=infill,
              prompt_ids=not images)  # Ollama's `context`: token ids (an image's positions have none)
    if context:
        # as Ollama does: the earlier prompt and answer as text (special tokens written out), then this
        # prompt; the ids already begin with the model's BOS if it has one, so none is added again
        job.context_text = await until_disconnected(request, st.generation.detokenize(
            resolved, context, keep_alive=st.keep_alive(body)))
        job.add_special = False
    return await _run(request, st, body, job, chat=False)


@router.post("/chat")
async def chat(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved, opts, num_ctx = await _resolve_with_options(st, body)
    messages = body.get("messages")
    if messages is None or messages == []:
        return await _load_only(st, resolved, body, num_ctx, chat=True)
    messages = c.normalize_messages(messages, ollama_images=True)
    _format(opts, body.get("format"))
    tools = c.check_tools(body.get("tools"), resolved.template)
    think, effort = _think(body)
    # a final assistant message with text is continued, as Ollama's templates do (`$last`): a prefill
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last["content"].strip()) and not last.get("tool_calls")
    job = Job(resolved, opts, messages=messages, tools=tools, think=think, effort=effort, num_ctx=num_ctx,
              keep_alive=st.keep_alive(body), api="ollama.chat", images=take_images(messages), truncate=_truncate(body),
              continue_final=prefill)
    return await _run(request, st, body, job, chat=True)


def _truncate(body: dict) -> bool:
    """Ollama's `truncate`, on unless false: a chat drops its oldest turns to fit num_ctx; an
    embeddings input is cut to the model's embedding window."""
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise InvalidRequest("'truncate' must be true or false")
    return truncate


@router.post("/embed")
async def embed(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(model_name(body))
    dims = c.get_int(body, "dimensions", 1)
    t0 = time.perf_counter_ns()
    if body.get("input") in (None, "", []):  # as Ollama: nothing to embed, the model loaded (as keep_alive says)
        _, load_s = await st.manager.load(resolved, keep_alive=st.keep_alive(body))
        return {"model": resolved.name, "embeddings": [], "total_duration": time.perf_counter_ns() - t0,
                "load_duration": int(load_s * 1e9), "prompt_eval_count": 0}
    texts = c.embed_inputs(body.get("input"), "input")
    was_loaded = resolved.name in st.manager.runners
    vectors, n = await until_disconnected(request, st.generation.embed(  # (a client gone: the work stops)
        resolved, texts, keep_alive=st.keep_alive(body), dimensions=dims, truncate=_truncate(body)))
    runner = st.manager.runners.get(resolved.name)
    load_s = runner.load_seconds if (runner is not None and not was_loaded) else 0.0
    return {"model": resolved.name, "embeddings": vectors, "total_duration": time.perf_counter_ns() - t0,
            "load_duration": int(load_s * 1e9), "prompt_eval_count": n}


@router.post("/embeddings")
async def embeddings_legacy(request: Request):
    """Ollama's older single-text endpoint: {"model", "prompt"} -> {"embedding": [...]}."""
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(model_name(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):  # one text: a list belongs to /api/embed's `input`
        raise InvalidRequest("'prompt' must be a string (for several texts use /api/embed with 'input')")
    if not prompt:  # as Ollama: an empty embedding, the model loaded
        await st.manager.load(resolved, keep_alive=st.keep_alive(body))
        return {"embedding": []}
    text = c.embed_inputs(prompt, "prompt")
    vectors, _ = await until_disconnected(request, st.generation.embed(
        resolved, text, keep_alive=st.keep_alive(body), truncate=_truncate(body)))
    return {"embedding": vectors[0]}
