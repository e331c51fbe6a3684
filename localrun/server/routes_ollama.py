"""Ollama-shaped routes under /api (NDJSON streams; the final chunk carries timing stats)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response

import localrun
from localrun.backends.base import SamplingOptions
from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import common as c
from localrun.server.routes_openai import _embed_inputs
from localrun.server.state import State, json_body, ndjson, ndjson_response

router = APIRouter(prefix="/api")
log = logging.getLogger("localrun.server")
_BACKGROUND: set = set()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _name(body: dict) -> str:
    v = body.get("model", body.get("name"))
    if not isinstance(v, str) or not v.strip():
        raise InvalidRequest("'model' is required")
    return v


def _iso(dt: datetime) -> str:
    return dt.astimezone().isoformat()


@router.get("/version")
async def version():
    return {"version": localrun.__version__}


@router.get("/tags")
async def tags(request: Request):
    st: State = request.app.state.lr
    models = await st.list_models()
    return {"models": [{"name": m.name, "model": m.name, "modified_at": _iso(m.modified_at), "size": m.size,
                        "digest": m.digest.removeprefix("sha256:"), "details": m.details} for m in models]}


@router.get("/ps")
async def ps(request: Request):
    st: State = request.app.state.lr
    return {"models": st.manager.ps()}


@router.post("/show")
async def show(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    info = await asyncio.to_thread(st.library.show, _name(body))
    if not c.get_bool(body, "verbose"):
        mi = info.get("model_info")
        if isinstance(mi, dict):  # Ollama drops the big token arrays unless verbose
            info = {**info, "model_info": {k: v for k, v in mi.items() if not isinstance(v, list)}}
    return info


@router.post("/copy")
async def copy(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    src, dst = c.get_str(body, "source", required=True), c.get_str(body, "destination", required=True)
    await asyncio.to_thread(st.library.copy, src, dst)
    return Response(status_code=200)


@router.delete("/delete")
async def delete(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(_name(body))
    await st.manager.unload(resolved.name)
    await asyncio.to_thread(st.library.remove, resolved.name)
    return Response(status_code=200)


async def _progress(request: Request, work, stream: bool):
    """Run a library call that reports PullEvents on a thread; stream them as NDJSON.
    The client going away sets the cancel event (pull stops, stays resumable)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def progress(ev) -> None:
        loop.call_soon_threadsafe(q.put_nowait, ev.to_dict() if hasattr(ev, "to_dict") else dict(ev))

    async def run():
        try:
            await asyncio.to_thread(work, progress, cancel)
            await q.put({"status": "success"})
        except LocalrunError as exc:
            await q.put({"error": exc.public_message, "status": exc.status})
        except Exception as exc:  # a bug or an OS error: say what, keep serving
            await q.put({"error": f"{type(exc).__name__}: {exc}", "status": 500})
        await q.put(None)

    task = asyncio.ensure_future(run())
    _BACKGROUND.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_BACKGROUND.discard)

    async def events() -> AsyncIterator[bytes]:
        last = None
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                if ev.get("status") == "success" and last == "success":
                    continue
                last = ev.get("status")
                yield ndjson(ev)
        finally:
            cancel.set()

    if stream:
        return ndjson_response(events())

    async def wait():
        events_seen = [ev async for ev in events()]
        err = next((e for e in events_seen if "error" in e), None)
        if err:
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": err["error"]}, status_code=err.get("status", 500))
        return {"status": "success"}

    return await c.until_disconnected(request, wait())


@router.post("/pull")
async def pull(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    name = _name(body)
    stream = c.get_bool(body, "stream", True)

    def work(progress, cancel):
        st.library.pull(name, progress=progress, cancel=cancel)

    return await _progress(request, work, stream)


def _modelfile_from_fields(body: dict) -> str:
    """Ollama's newer /api/create fields (from, system, template, parameters, ...) as a Modelfile."""
    src = c.get_str(body, "from", required=True)
    lines = [f"FROM {src}"]
    for key, word in (("template", "TEMPLATE"), ("system", "SYSTEM"), ("license", "LICENSE")):
        v = body.get(key)
        if isinstance(v, list):
            v = "\n".join(map(str, v))
        if v is not None:
            if not isinstance(v, str):
                raise InvalidRequest(f"'{key}' must be a string")
            lines.append(f'{word} """{v}"""')
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be an object")
    for k, v in params.items():
        for item in v if isinstance(v, list) else [v]:
            lines.append(f"PARAMETER {k} {item}")
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            raise InvalidRequest("'messages' entries must be objects")
        lines.append(f'MESSAGE {m.get("role")} """{m.get("content", "")}"""')
    return "\n".join(lines) + "\n"


@router.post("/create")
async def create(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    name = _name(body)
    modelfile = body.get("modelfile")
    if modelfile is None:
        modelfile = _modelfile_from_fields(body)
    if not isinstance(modelfile, str) or not modelfile.strip():
        raise InvalidRequest("'modelfile' must be a non-empty string")
    base = c.get_str(body, "base_dir") or c.get_str(body, "path")
    base_dir = Path(base) if base else None
    if base_dir is not None and base_dir.name.lower() == "modelfile" or (base_dir and base_dir.is_file()):
        base_dir = base_dir.parent
    stream = c.get_bool(body, "stream", True)

    def work(progress, cancel):
        st.library.create(name, modelfile, base_dir=base_dir, progress=progress)

    return await _progress(request, work, stream)


# -- generation ------------------------------------------------------------------------------
def _format(opts: SamplingOptions, fmt: Any) -> None:
    if fmt in (None, ""):
        return
    if fmt == "json":
        opts.json_mode = True
    elif isinstance(fmt, dict):
        opts.json_schema = c.check_json_schema(fmt)
    else:
        raise InvalidRequest("'format' must be \"json\" or a JSON schema object")


def _stats(t0: int, lease, usage) -> dict:
    return {
        "total_duration": time.perf_counter_ns() - t0,
        "load_duration": int(lease.load_seconds * 1e9),
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": int(usage.prompt_eval_seconds * 1e9),
        "eval_count": usage.completion_tokens,
        "eval_duration": int(usage.eval_seconds * 1e9),
        "cached_tokens": usage.cached_tokens,
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


async def _run(request: Request, st: State, resolved, body: dict, prompt: str, opts: SamplingOptions,
               num_ctx: int | None, chat: bool, tools: list | None, add_special: bool):
    t0 = time.perf_counter_ns()
    stream = c.get_bool(body, "stream", True)
    name = resolved.name

    def piece(text: str) -> dict:
        out: dict[str, Any] = {"model": name, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = False
        return out

    def final(lease, res_text: str, reason: str, usage) -> dict:
        out = piece("")
        if chat:
            content, calls = c.parse_tool_calls(res_text, tools)
            if calls:
                out["message"] = {"role": "assistant", "content": content,
                                  "tool_calls": [{"function": {"name": k["function"]["name"],
                                                               "arguments": _loads(k["function"]["arguments"])}}
                                                 for k in calls]}
            elif not stream:
                out["message"]["content"] = res_text
        elif not stream:
            out["response"] = res_text
        out.update(done=True, done_reason="stop" if reason == "abort" else reason, **_stats(t0, lease, usage))
        return out

    if not stream:
        async def run():
            async with st.manager.use(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body)) as lease:
                req = await c.prepare_request(lease, prompt, opts, add_special=add_special)
                res = await c.collect(lease, req)
                return final(lease, res.text, res.finish_reason, res.usage)

        return await c.until_disconnected(request, run())

    lease, release = await st.lease(resolved, num_ctx=num_ctx, keep_alive=st.keep_alive(body))
    try:
        req = await c.prepare_request(lease, prompt, opts, add_special=add_special)
    except BaseException:
        await release()
        raise

    async def events() -> AsyncIterator[bytes]:
        held: list[str] = []
        try:
            async for ch in c.stream(lease, req):
                if ch.text:
                    if tools:
                        held.append(ch.text)
                    else:
                        yield ndjson(piece(ch.text))
                if ch.finish_reason:
                    text = "".join(held)
                    if tools:
                        content, calls = c.parse_tool_calls(text, tools)
                        if not calls and text:
                            yield ndjson(piece(text))
                    yield ndjson(final(lease, text, ch.finish_reason, ch.usage))
        except Exception as exc:  # noqa: BLE001 - an error line ends the stream (Ollama's shape)
            if not isinstance(exc, LocalrunError):
                log.exception("stream failed")
                exc = LocalrunError(f"internal error: {type(exc).__name__}")
            yield ndjson({"error": exc.public_message, "status": exc.status})
        finally:
            await release()

    return ndjson_response(events(), release)


def _loads(s: str):
    import json

    try:
        return json.loads(s)
    except ValueError:
        return s


async def _resolve_with_options(st: State, body: dict):
    """The model, its sampling options (Modelfile PARAMETERs, then the request's `options`)
    and the context window for a /api/generate or /api/chat request."""
    resolved = await st.resolve(_name(body))
    opts, num_ctx = c.base_options(resolved)
    req_ctx = c.apply_ollama_options(opts, body.get("options"))
    return resolved, opts, req_ctx or num_ctx


@router.post("/generate")
async def generate(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved, opts, num_ctx = await _resolve_with_options(st, body)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string")
    if body.get("images"):
        raise InvalidRequest("images are not supported by localrun's models yet")
    if not prompt:
        return await _load_only(st, resolved, body, num_ctx, chat=False)
    _format(opts, body.get("format"))
    raw = c.get_bool(body, "raw")
    text = c.generate_prompt(resolved, prompt, c.get_str(body, "system"), c.get_str(body, "template"), raw)
    return await _run(request, st, resolved, body, text, opts, num_ctx, chat=False, tools=None, add_special=True)


@router.post("/chat")
async def chat(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved, opts, num_ctx = await _resolve_with_options(st, body)
    messages = body.get("messages")
    if messages is None or messages == []:
        return await _load_only(st, resolved, body, num_ctx, chat=True)
    messages = c.normalize_messages(messages)
    _format(opts, body.get("format"))
    tools = c.check_tools(body.get("tools"), resolved.template)
    prompt = c.chat_prompt(resolved, messages, tools)
    return await _run(request, st, resolved, body, prompt, opts, num_ctx, chat=True, tools=tools, add_special=True)


@router.post("/embed")
async def embed(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(_name(body))
    texts = _embed_inputs(body.get("input"), "input")
    t0 = time.perf_counter_ns()
    async with st.manager.use(resolved, keep_alive=st.keep_alive(body)) as lease:
        vectors = await lease.backend.embed(texts)
        n = sum([len(await lease.backend.tokenize(t, add_special=True)) for t in texts])
    return {"model": resolved.name, "embeddings": vectors, "total_duration": time.perf_counter_ns() - t0,
            "load_duration": int(lease.load_seconds * 1e9), "prompt_eval_count": n}


@router.post("/embeddings")
async def embeddings_legacy(request: Request):
    """Ollama's older single-text endpoint: {"model", "prompt"} -> {"embedding": [...]}."""
    st: State = request.app.state.lr
    body = await json_body(request)
    resolved = await st.resolve(_name(body))
    text = _embed_inputs(body.get("prompt"), "prompt")
    async with st.manager.use(resolved, keep_alive=st.keep_alive(body)) as lease:
        vectors = await lease.backend.embed(text)
    return {"embedding": vectors[0]}
