"""Ollama-shaped model management under /api: version, tags, ps, show, copy, delete, pull, create and blob uploads.

Pull and create stream their progress as NDJSON (or answer once, with `stream` false); a blob upload
is streamed to disk as it arrives. Generation, chat and embeddings: :mod:`localrun.server.routes_ollama`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from datetime import datetime
from pathlib import Path
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.requests import ClientDisconnect

from localrun.library.modelfile import PARAMETERS, ROLES, format_parameter_value, parse_modelfile, parse_parameter, quote_value
from localrun.library.names import parse_name
from localrun.library.paths import files_view
from localrun.library.disk_errors import DiskFull

import localrun
from localrun.errors import InvalidRequest, LocalrunError
from localrun.server import params as c
from localrun.server.disconnect import until_disconnected
from localrun.server.state import State, json_body, ndjson, ndjson_response

router = APIRouter(prefix="/api")
log = logging.getLogger("localrun.server")
_BACKGROUND: set = set()


def model_name(body: dict) -> str:
    """The request's model: 'model' (or Ollama's older 'name'); a 400 when it is missing."""
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
    from localrun.server.metrics import prompt_cache_ps, runner_stats

    st: State = request.app.state.lr
    models = st.manager.ps()
    if models:  # the prompt cache on disk's hits, from each runner (ps -v)
        stats = await runner_stats(list(st.manager.runners.values()))
        for m in models:
            pc = prompt_cache_ps(stats.get(m["name"]) or {})
            if pc is not None:
                m["prompt_cache"] = pc
    return {"models": models}


@router.post("/show")
async def show(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    info = await asyncio.to_thread(st.library.show, model_name(body))
    if not c.get_bool(body, "verbose"):
        mi = info.get("model_info")
        if isinstance(mi, dict):  # Ollama drops the big token arrays unless verbose
            info = {**info, "model_info": {k: v for k, v in mi.items() if not isinstance(v, list)}}
    if c.get_bool(body, "fit_context"):  # localrun's own: the context `launch` gives an agent
        resolved = await st.resolve(model_name(body))
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
    name = await asyncio.to_thread(st.library.stored_name, model_name(body))
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
    name = model_name(body)
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
    name = model_name(body)
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
