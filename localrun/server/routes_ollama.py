"""Ollama-shaped routes under /api (NDJSON streams; the final chunk carries timing stats)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.requests import ClientDisconnect

from localrun.library.modelfile import PARAMETERS, ROLES, format_parameter_value, parse_modelfile, parse_parameter, quote_value
from localrun.library.names import parse_name
from localrun.library.paths import files_view
from localrun.library.disk_errors import DiskFull

import localrun
from localrun.backends.base import MEDIA_MARKER, Infill, SamplingOptions
from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import params as c
from localrun.server.generation import Delta, Done, Generation, Job, ToolCalls, until_disconnected
from localrun.server.images import from_base64, take_images
from localrun.server.manager import with_load_options
from localrun.server.routes_openai import token_logprobs
from localrun.server.state import State, generation_response, json_body, ndjson, ndjson_response

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


# The Ollama API level localrun speaks: clients gate on it (GitHub Copilot Chat refuses servers below 0.6.4).
OLLAMA_API_VERSION = "0.12.6"


FILES_VIEW = files_view()


@router.api_route("/version", methods=["GET", "HEAD"])  # (HEAD: health checks, as Ollama answers them)
async def version():
    # files_view: the CLI's `create` sends paths only to a daemon that sees this machine's files
    return {"version": OLLAMA_API_VERSION, "localrun_version": localrun.__version__, "files_view": FILES_VIEW}


@router.api_route("/tags", methods=["GET", "HEAD"])
async def tags(request: Request):
    st: State = request.app.state.lr
    models = await st.list_models()
    return {"models": [{"name": m.name, "model": m.name, "modified_at": _iso(m.modified_at), "size": m.size,
                        "digest": m.digest.removeprefix("sha256:"), "details": m.details,
                        "capabilities": m.capabilities} for m in models]}


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
    if c.get_bool(body, "fit_context"):  # localrun's own: the context `launch` gives an agent
        resolved = await st.resolve(_name(body))
        train = getattr(resolved.info, "context_length", None) or st.settings.context_length
        n, why = await st.manager.fitting_context(resolved, int(train))
        info = {**info, "fit_context": {"num_ctx": n, "trained": train, "reason": why}}
    if "insert" in info.get("capabilities", ()) and ".Suffix" not in (info.get("template") or ""):
        # Continue decides a model can fill in the middle by ".Suffix" in its Ollama (Go) template; ours is
        # Jinja, and localrun lays the FIM tokens out itself: an inert Jinja comment says so
        info = {**info, "template": (info.get("template") or "") + FIM_TEMPLATE_NOTE}
    return info


FIM_TEMPLATE_NOTE = "{# .Suffix: fill-in-the-middle requests (suffix) are laid out with the model's FIM tokens #}"


@router.post("/push")
async def push(request: Request):
    """`ollama push` has no counterpart: the library is local, and there is no registry to push to."""
    raise LocalrunError("localrun does not push models to a registry: its library is on this machine. Share the "
                        "GGUF file itself (`localrun show --modelfile NAME` names it) or publish it on the Hugging "
                        "Face hub, where `localrun pull hf.co/USER/REPO` finds it", status=501, code="not_supported")


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
    name = await asyncio.to_thread(st.library.stored_name, _name(body))
    # out of the library first, so no new request loads it; a loaded runner finishes its requests and then
    # unloads (its weights stay readable to it: an open or mapped file outlives its name)
    await asyncio.to_thread(st.library.remove, name)
    st.manager.forget(name)
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
        except Exception as exc:  # a bug: log it, answer without internals (paths), keep serving
            log.exception("%s failed", request.url.path)
            await q.put({"error": f"internal error: {type(exc).__name__}", "status": 500})
        await q.put(None)

    st: State = request.app.state.lr
    if st.generation.draining:
        from localrun.errors import ShuttingDown

        raise ShuttingDown("the daemon is shutting down; pull or create again once it is back")
    st.pulls.add(cancel)
    task = asyncio.ensure_future(run())
    _BACKGROUND.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_BACKGROUND.discard)
    task.add_done_callback(lambda _t: st.pulls.discard(cancel))

    async def events() -> AsyncIterator[dict]:
        last = None
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                if ev.get("status") == "success" and last == "success":
                    continue
                last = ev.get("status")
                yield ev
        finally:
            cancel.set()

    if stream:
        async def lines() -> AsyncIterator[bytes]:
            async for ev in events():
                yield ndjson(ev)

        return ndjson_response(lines())

    async def wait():
        err = None
        async for ev in events():
            if "error" in ev and err is None:
                err = ev
        if err:
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": err["error"]}, status_code=err.get("status", 500))
        return {"status": "success"}

    return await until_disconnected(request, wait())


@router.post("/pull")
async def pull(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    name = _name(body)
    parse_name(name)  # a bad name is a 400 before any 200
    stream = c.get_bool(body, "stream", True)

    def work(progress, cancel):
        st.library.pull(name, progress=progress, cancel=cancel)

    return await _progress(request, work, stream)


def _modelfile_from_fields(body: dict, files: bool) -> str:
    """Ollama's newer /api/create fields (from, system, template, parameters, ...) as a Modelfile
    (with `files`, the model is those uploaded blobs and there is no FROM). Every value is written
    quoted as the Modelfile parser reads it back exactly (quotes, \"\"\", leading spaces), and each
    parameter is checked here, so a field can neither fail as "Modelfile line N" nor add a line."""
    src = c.get_str(body, "from", required=not files)
    if src is not None and ("\n" in src or "\r" in src):
        raise InvalidRequest("'from' must be one model name or path (it contains a line break)")
    lines = [f"FROM {src}"] if src else []
    for key, word in (("template", "TEMPLATE"), ("system", "SYSTEM"), ("license", "LICENSE")):
        v = body.get(key)
        if isinstance(v, list):
            if not all(isinstance(x, str) for x in v):
                raise InvalidRequest(f"'{key}' must be a string or a list of strings")
            v = "\n".join(v)
        if v is not None:
            if not isinstance(v, str):
                raise InvalidRequest(f"'{key}' must be a string")
            if "\x00" in v:
                raise InvalidRequest(f"'{key}' contains a NUL character")
            lines.append(f"{word} {quote_value(v)}")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be an object")
    for k, v in params.items():
        if k not in PARAMETERS:  # (also keeps a key from carrying a line of its own)
            raise InvalidRequest(f"unknown parameter {k!r} in 'parameters' (known: {', '.join(sorted(PARAMETERS))})")
        if isinstance(v, list) and k != "stop":
            raise InvalidRequest(f"parameter {k} takes one value, not a list")
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, (dict, list)) or item is None:
                raise InvalidRequest(f"parameter {k} must be a {'string' if k == 'stop' else 'number, string or boolean'}")
            if isinstance(item, str) and "\x00" in item:
                raise InvalidRequest(f"parameter {k} contains a NUL character")
            lines.append(f"PARAMETER {k} {format_parameter_value(parse_parameter(k, item))}")
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict):
            raise InvalidRequest("'messages' entries must be objects")
        role, content = m.get("role"), m.get("content", "")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise InvalidRequest(f"a message's 'role' must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str) or "\x00" in content:
            raise InvalidRequest("a message's 'content' must be a string (with no NUL character)")
        lines.append(f"MESSAGE {role.lower()} {quote_value(content)}")
    return "\n".join(lines) + "\n"


@router.post("/create")
async def create(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    name = _name(body)
    quantize = body.get("quantize") or None  # Ollama's: the GGUF (F16, BF16, F32) stored quantized, e.g. q4_K_M
    if quantize is not None:
        from localrun.library.quantize import quant_type

        quantize = quant_type(quantize)  # an unknown type is a 400 before any 200
    files, adapters = body.get("files"), body.get("adapters") or None
    if files is not None:  # bad names or digests, and a file never uploaded, are a 400 before any 200 too
        await asyncio.to_thread(st.library.check_files, files)
    if adapters is not None:  # (a LoRA adapter in GGUF; `ollama create` uploads a Modelfile's ADAPTER so)
        await asyncio.to_thread(st.library.check_files, adapters, "adapters")
    modelfile = body.get("modelfile")
    if modelfile is None:
        modelfile = _modelfile_from_fields(body, files is not None)
    if not isinstance(modelfile, str):
        raise InvalidRequest("'modelfile' must be a string")  # (an empty one: the parser says it has no FROM)
    parse_name(name)  # bad names and Modelfiles are a 400 before any 200
    # (off the event loop: a TEMPLATE is compiled to check it, up to a second for a big one)
    mf = await asyncio.to_thread(parse_modelfile, modelfile, require_from=files is None)
    if files is not None and mf.from_ is not None:
        raise InvalidRequest("give the model as 'from' (or a Modelfile's FROM) or as 'files', not both")
    base = c.get_str(body, "base_dir") or c.get_str(body, "path")
    base_dir = Path(base) if base else None
    try:
        if base_dir is not None and (base_dir.name.lower() == "modelfile" or base_dir.is_file()):
            base_dir = base_dir.parent
    except OSError:  # a name too long, a loop, ...: the library says what is wrong with it
        pass
    stream = c.get_bool(body, "stream", True)

    def work(progress, cancel):
        st.library.create(name, mf, base_dir=base_dir, progress=progress, cancel=cancel, files=files, adapters=adapters,
                          quantize=quantize)

    return await _progress(request, work, stream)


BLOB_WRITE = 4 * 2**20  # bytes of an upload gathered per write (each on a thread: the loop never waits on the disk)
BLOB_SPARE = 64 * 2**20  # free space an upload must leave on the library's disk
BLOB_IDLE_S = 60.0  # an upload that sends nothing for this long is dropped (its temp file goes)


@router.head("/blobs/{digest}")
async def blob_exists(request: Request, digest: str):
    """Ollama's check before an upload: 200 when the library has the blob, else 404."""
    st: State = request.app.state.lr
    return Response(status_code=200 if st.library.has_blob(digest) else 404)


@router.post("/blobs/{digest}")
async def blob_upload(request: Request, digest: str):
    """Ollama's upload of a model file (`ollama create`, the SDKs' create_blob): the body is the file,
    the URL names its sha256. 201 once stored, 200 when the library had it already (the body unread);
    a body whose sha256 differs is discarded (400). A create's `files` then names the blob."""
    st: State = request.app.state.lr
    if st.library.has_blob(digest):  # a bad digest is a 400 here
        return Response(status_code=200)
    store = st.library.store
    await asyncio.to_thread(store.ensure)
    length = request.headers.get("content-length")
    sized = length is not None and length.isdigit()

    async def check_space(need: int) -> None:
        free = (await asyncio.to_thread(shutil.disk_usage, store.root)).free
        if need + BLOB_SPARE > free:
            raise DiskFull(f"disk full: the upload {'is' if sized else 'has come to'} {need / 2**30:.2f} GiB and the "
                           f"model library's disk has {free / 2**30:.2f} GiB free; free some space (e.g. `localrun rm` "
                           "unused models) and try again")

    if sized:
        await check_space(int(length))
    up = await asyncio.to_thread(st.library.upload, digest)
    try:
        pending: list[bytes] = []
        n = 0
        pieces = request.stream().__aiter__()
        while True:
            try:
                piece = await asyncio.wait_for(pieces.__anext__(), BLOB_IDLE_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise LocalrunError(f"the upload stalled: nothing came for {BLOB_IDLE_S:g} s, so it was dropped "
                                    "and nothing was stored; send the file again", status=408,
                                    code="upload_stalled") from None
            pending.append(piece)
            n += len(piece)
            if n >= BLOB_WRITE:
                if not sized:  # a chunked body: stop before the disk is full, not when it is
                    await check_space(n)
                await asyncio.to_thread(up.write, b"".join(pending))
                pending, n = [], 0
        if pending:
            await asyncio.to_thread(up.write, b"".join(pending))
        _, size = await asyncio.to_thread(up.finish)
        log.info("stored an uploaded file: %s (%d bytes)", digest, size)
    except ClientDisconnect:  # the client went away midway: the temp file goes, nobody to answer
        log.info("an upload of %s stopped midway (the client went away); nothing was stored", digest)
        return Response(status_code=499)
    finally:
        await asyncio.to_thread(up.close)
    return Response(status_code=201)


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
    resolved = with_load_options(await st.resolve(_name(body)), body.get("options"))
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
    if not prompt and not images and not suffix:
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
    infill = Infill(prefix=prompt, suffix=suffix) if suffix else None
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
    resolved = await st.resolve(_name(body))
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
    resolved = await st.resolve(_name(body))
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
