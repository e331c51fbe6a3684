"""The FastAPI app: security middleware, error mapping, routes; `serve()` runs it.

Security (docs/security.md: 'Loopback binds and Host headers', 'API key', 'CORS', 'Body and
header size'): loopback binds refuse foreign Host headers (DNS rebinding, 403);
LOCALRUN_API_KEY, when set, is required on every route (401); CORS headers only for
LOCALRUN_ORIGINS; bodies over MAX_BODY_BYTES answer 413 (chunked ones too, as soon as they
pass it), except a blob upload (POST /api/blobs/..., bounded by the disk); binding a
non-loopback address without an API key is refused unless LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1
(containers), and then the Host check stays on: only requests addressed to localhost are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import ipaddress
import json
import logging
import signal
import sys
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import Response as StarletteResponse

from localrun.config import Settings, settings as read_settings
from localrun.errors import Busy, LocalrunError
from localrun.server.error_shapes import error_body

log = logging.getLogger("localrun.server")

MAX_BODY_BYTES = 32 * 2**20
MAX_HEADER_BYTES = 32 * 2**10


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_only(value: str) -> str:
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:].split("]")[0]
    if v.count(":") == 1:
        return v.split(":")[0]
    return v


def _host_allowed(value: str) -> bool:
    h = _host_only(value)
    return h == "localhost" or h.endswith(".localhost") or is_loopback(h)


class SecurityMiddleware:
    """Pure ASGI (no per-chunk overhead on streams): Host check, API key, body limit."""

    def __init__(self, app, settings: Settings):
        self.app = app
        # a loopback bind, or any bind without a key (LOCALRUN_ALLOW_UNAUTHENTICATED_BIND, e.g. 0.0.0.0 in a
        # container whose port is published on the host's 127.0.0.1): a browser page must not reach it
        self.check_host = is_loopback(settings.host) or not settings.api_key
        self.api_key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw_headers = scope.get("headers") or []
        if sum(len(k) + len(v) for k, v in raw_headers) > MAX_HEADER_BYTES:
            return await self._deny(scope, send, 431, f"request headers too large (limit {MAX_HEADER_BYTES // 1024} KiB)",
                                    "request_header_fields_too_large")
        headers = dict(raw_headers)
        if self.check_host:
            host = headers.get(b"host", b"").decode("latin-1")
            if host and not _host_allowed(host):
                return await self._deny(scope, send, 403, "forbidden host header: this daemon only answers "
                                        "requests addressed to localhost (DNS rebinding protection)", "forbidden")
        if self.api_key and scope.get("method") != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            # bearer (OpenAI, Ollama) or x-api-key (Anthropic's SDK and Claude Code)
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"").strip()
            if not token or not hmac.compare_digest(token, self.api_key):
                return await self._deny(scope, send, 401, "missing or wrong API key: send "
                                        "'Authorization: Bearer <LOCALRUN_API_KEY>' (or 'x-api-key')",
                                        "invalid_api_key")
        if scope.get("method") == "POST" and scope.get("path", "").startswith("/api/blobs/"):
            # a model file on its way into the library (Ollama's blob upload): gigabytes, streamed to disk
            # as they arrive; the route checks the free space first and the sha256 at the end
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > MAX_BODY_BYTES
            except ValueError:
                return await self._deny(scope, send, 400, "bad Content-Length header", "invalid_request_error")
            if too_big:
                return await self._deny(scope, send, 413, f"request body too large (limit {MAX_BODY_BYTES // 2**20} MiB)",
                                        "request_too_large")
            return await self.app(scope, receive, send)
        if b"transfer-encoding" not in headers:  # neither header: no body (HTTP/1.1), nothing to count
            return await self.app(scope, receive, send)
        # chunked bodies: count as they arrive. Past the limit the 413 goes out at once, from here, and
        # the app's read fails with _TooLarge; whatever the app (or its error handling) sends after that
        # is dropped, so the answer is the 413 in this API's shape, never a 500 or a 400.
        seen = 0
        started = False
        refused = False

        async def guarded_send(msg):
            nonlocal started
            if refused:
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        async def limited_receive():
            nonlocal seen, refused
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    if not started and not refused:
                        refused = True
                        await self._deny(scope, send, 413, f"request body too large (limit "
                                         f"{MAX_BODY_BYTES // 2**20} MiB)", "request_too_large")
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            pass

    @staticmethod
    async def _deny(scope, send, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(scope.get("path", ""), status, message, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def exact_routes(app) -> dict[tuple[str, str], Any]:
    """(method, path) -> endpoint for every route FastAPI would call with the request alone: a fixed
    path, no parameters, dependencies or response model, only a `request: Request` (every route of ours
    but a few). The first route registered for a pair wins, as in FastAPI's own matching."""
    from fastapi.routing import APIRoute

    def walk(routes):
        for r in routes:
            inner = getattr(r, "original_router", None)  # an included router (FastAPI >= 0.16x keeps them nested)
            if inner is not None:
                yield from walk(inner.routes)
            else:
                yield r

    table: dict[tuple[str, str], Any] = {}
    for r in walk(app.router.routes):
        if not isinstance(r, APIRoute) or "{" in r.path or r.response_model is not None or r.status_code is not None:
            continue
        d = r.dependant
        if (d.request_param_name is None or d.path_params or d.query_params or d.header_params or d.cookie_params
                or d.body_params or d.dependencies or d.response_param_name or d.background_tasks_param_name
                or getattr(d, "websocket_param_name", None) or getattr(d, "http_connection_param_name", None)
                or r.dependencies or not inspect.iscoroutinefunction(r.endpoint)):
            continue
        for m in r.methods or ():
            table.setdefault((m, r.path), r.endpoint)
    return table


class ExactRoutes:
    """The router's front: a request for one of `exact_routes` goes straight to its endpoint; every
    other one to FastAPI's router. FastAPI 0.16x's matching walks each included router's routes through
    several layers: 40-50 us a request for /v1/chat/completions, 150 us for /api/chat (2-core Xeon, hot;
    some 3x that on the caches an idle spell leaves cold), on every request's way to its first token.
    What the endpoint raises goes to FastAPI's exception handlers, as from the router; what it returns
    is sent as FastAPI sends it (a Response as it is, anything else as JSON)."""

    def __init__(self, app, table: dict[tuple[str, str], Any]) -> None:
        self.app, self.table = app, table

    async def __call__(self, scope, receive, send):
        endpoint = self.table.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        if endpoint is None or scope.get("root_path"):
            return await self.app(scope, receive, send)
        scope["endpoint"], scope["path_params"] = endpoint, {}
        response = await endpoint(Request(scope, receive, send))
        if not isinstance(response, StarletteResponse):
            from fastapi.encoders import jsonable_encoder

            response = JSONResponse(jsonable_encoder(response))
        await response(scope, receive, send)


class ErrorMiddleware:
    """Any exception a route did not turn into a response becomes a shaped 500 here, logged,
    with nothing internal in it. Starlette's own last-resort handler answers 500 too, but then
    re-raises, and the server closes the client's kept-alive connection; this one does not."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_tracked)
        except _TooLarge:
            raise  # SecurityMiddleware has answered 413 already
        except Exception as exc:  # noqa: BLE001 - the last place an error can still be an answer
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                body = json.dumps(error_body(scope.get("path", ""), 500, f"internal error: {type(exc).__name__}",
                                             "internal_error")).encode()
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})


def _default_library(s: Settings):
    from localrun.library import Library

    return Library(s.models_dir)


def create_app(settings: Settings | None = None, library: Any = None, loader: Any = None) -> FastAPI:
    """The daemon's ASGI app. `library` defaults to the store under settings.models_dir;
    `loader(spec, backend) -> Backend` defaults to a runner process per model (tests pass an
    in-process fake)."""
    s = settings or read_settings()
    from localrun.server.state import State

    state = State(s, library if library is not None else _default_library(s), loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        clean = getattr(state.library, "clean_temp", None)
        if clean is not None:  # temp files a killed daemon left behind
            try:
                removed = await asyncio.to_thread(clean)
                if removed:
                    log.info("removed %d leftover temp file(s) from the store", removed)
            except OSError as exc:
                log.warning("could not clean the store's temp area: %s", exc)
        prune = getattr(state.library, "prune", None)
        if prune is not None and not s.noprune:  # blobs no model uses (LOCALRUN_NOPRUNE=1 keeps them)
            try:
                freed = await asyncio.to_thread(prune)
                if freed:
                    log.info("removed %.1f MB of blobs no model uses (LOCALRUN_NOPRUNE=1 keeps them)", freed / 1e6)
            except (OSError, LocalrunError) as exc:
                log.warning("could not prune unused blobs: %s", exc)
        state.manager.start()
        probe = asyncio.get_running_loop().create_task(_report_llamacpp_build())
        try:
            yield
        finally:
            probe.cancel()
            await state.manager.shutdown()

    app = FastAPI(title="localrun", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.lr = state

    @app.exception_handler(LocalrunError)
    async def _lr_error(request: Request, exc: LocalrunError):
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Busy) else None
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(error_body(request.url.path, exc.status, exc.public_message, exc.code),
                            status_code=exc.status, headers=headers)

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(request.url.path, exc.status_code, msg, "not_found"), status_code=exc.status_code)


    @app.get("/")
    @app.head("/")
    async def root():
        return PlainTextResponse("localrun is running")

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import Response

        from localrun.server.metrics import CONTENT_TYPE

        return Response(await state.metrics.render(), media_type=CONTENT_TYPE)

    from localrun.server.routes_anthropic import router as anthropic_router
    from localrun.server.routes_llama import router as llama_router
    from localrun.server.routes_ollama import router as ollama_router
    from localrun.server.routes_ollama_models import router as ollama_models_router
    from localrun.server.routes_openai import router as openai_router
    from localrun.server.routes_responses import router as responses_router

    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(ollama_models_router)  # (before generate/chat: the routes' order as it was)
    app.include_router(ollama_router)
    app.include_router(llama_router)
    # exact paths straight to their endpoints, inside FastAPI's exception handling
    app.router.middleware_stack = ExactRoutes(app.router.middleware_stack, exact_routes(app))

    app.add_middleware(ErrorMiddleware)  # innermost of ours: a bug is a shaped 500, the connection lives on
    if s.origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(s.origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    # added last = outermost: runs before CORS, so preflights still need a good Host
    app.add_middleware(SecurityMiddleware, settings=s)
    from localrun.server.metrics import MetricsMiddleware

    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: counts refusals too
    return app


def _version() -> str:
    import localrun

    return localrun.__version__


def check_models_dir(s: Settings) -> None:
    """The model library's folder (LOCALRUN_MODELS, else LOCALRUN_HOME/models) exists and is writable,
    or the daemon does not start: every pull and create would fail otherwise."""
    import os

    d = s.models_dir
    try:
        d.mkdir(parents=True, exist_ok=True)
        ok = d.is_dir() and os.access(d, os.W_OK | os.X_OK)
        why = "not a writable folder"
    except OSError as exc:
        ok, why = False, exc.strerror or str(exc)
    if not ok:
        var = "LOCALRUN_MODELS" if s.models is not None else "LOCALRUN_HOME"
        raise SystemExit(f"cannot use {d} for the model library: {why}. Point {var} at a folder this user "
                         "can write (it is created if missing)")


def check_bind(s: Settings) -> None:
    """Refuse a non-loopback bind without an API key (docs/security.md, 'API key'), unless
    LOCALRUN_ALLOW_UNAUTHENTICATED_BIND says so (a container, its port published on 127.0.0.1)."""
    if is_loopback(s.host) or s.api_key:
        return
    if s.allow_unauthenticated_bind:
        log.warning("listening on %s:%s without an API key (LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1): only requests "
                    "addressed to localhost are answered; publish this port on 127.0.0.1 only, or set "
                    "LOCALRUN_API_KEY", s.host, s.port)
        return
    raise SystemExit(
        f"refusing to listen on {s.host}:{s.port} without an API key: anyone on the network could run "
        "models and change the library. Set LOCALRUN_API_KEY=<secret> (clients send it as a Bearer token), "
        "or bind 127.0.0.1 (LOCALRUN_HOST=127.0.0.1:PORT); in a container whose port is published on the "
        "host's 127.0.0.1 only, LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1 allows it."
    )


def setup_logging(s: Settings) -> None:
    level = getattr(logging, s.log_level.upper(), logging.INFO)
    root = logging.getLogger("localrun")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
    root.setLevel(level)


def _server_class():
    import uvicorn

    class DaemonServer(uvicorn.Server):
        """uvicorn's server, but a SIGTERM/SIGINT that ended in a graceful shutdown is a normal
        exit (status 0), not the signal raised again once the shutdown is done; and the first
        signal starts the daemon's drain (no new work, LOCALRUN_SHUTDOWN_GRACE for what runs)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            state = getattr(getattr(self.config.app, "state", None), "lr", None)
            loop = asyncio.get_event_loop()
            if state is not None and loop.is_running():
                loop.call_soon_threadsafe(state.begin_drain)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return DaemonServer


async def _report_llamacpp_build() -> None:
    """Once at start: what the installed llama.cpp can do, and the fix when an NVIDIA GPU is here but
    the build cannot use it (off the event loop: both probes run child processes)."""
    from localrun.backends.select import llamacpp_build, llamacpp_gpu_advice, local_cuda_gpu

    build = await asyncio.to_thread(llamacpp_build)
    if not build.installed:
        return
    log.info("llama.cpp build: %s", build.summary)
    advice = llamacpp_gpu_advice(await asyncio.to_thread(local_cuda_gpu), build)
    if advice:
        log.warning("%s", advice)


def serve(s: Settings | None = None) -> int:
    """Run the daemon in the foreground until SIGINT/SIGTERM (`localrun serve`)."""
    import uvicorn

    s = s or read_settings()
    setup_logging(s)
    check_bind(s)
    check_models_dir(s)
    from localrun.backends.select import choose

    log.info("localrun %s listening on %s (home %s, models %s)", _version(), s.base_url, s.home, s.models_dir)
    for k, v in s.describe():
        log.info("  %s=%s", k, v)
    try:
        log.info("backend for GGUF models: %s", choose(s.backend, "gguf", None).reason if s.backend != "auto"
                 else "chosen per model at load time (see /api/ps)")
    except LocalrunError as exc:
        log.warning("%s", exc.message)
    app = create_app(s)
    # uvicorn waits for open responses up to its own timeout: longer than our grace, so that streams
    # past the grace end themselves (with an error and a finish reason) rather than being cut
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level="warning",
                            timeout_graceful_shutdown=s.shutdown_grace + 15,
                            # uvicorn's default is 5 s: a client idle longer (an agent between two model
                            # calls) that wrote on the connection as it closed got a broken pipe
                            timeout_keep_alive=int(max(1, s.http_keepalive)),
                            h11_max_incomplete_event_size=64 * 1024, access_log=False)
    server = _server_class()(config)
    try:
        server.run()  # on uvloop where it is installed (config.loop "auto"): a faster hop per request and token
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m localrun.server`: the daemon with settings from the environment."""
    try:
        s = read_settings()
    except ValueError as exc:
        print(f"localrun: {exc}", file=sys.stderr)
        return 2
    return serve(s)


__all__ = ["create_app", "serve", "main", "check_bind", "is_loopback", "MAX_BODY_BYTES"]
