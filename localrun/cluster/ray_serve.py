"""Replicas of localrun's native engine past one machine, on Ray Serve (``pip install "localrun[ray]"``).

    localrun ray-serve MODEL --replicas 2 [--min-replicas N --max-replicas M] [--address auto]
    python -m localrun.cluster.ray_serve MODEL ...          (the same)

MODEL is a GGUF file or a model in the local localrun library (``localrun pull`` it first). The
weights path must be readable on every node that runs a replica (a shared filesystem, or the same
library on each node), and localrun must be installed on every node.

Shape of the application (two deployments):

* ``LocalrunReplica`` (N replicas, autoscaled between --min/--max-replicas): one native-engine
  ``LLMEngine`` each, behind localrun's own Backend wrapper (``localrun.backends.native``: sampling
  options, prompt-length and stop handling, errors, KV freed on abort). Not the daemon's
  GenerationService: that one owns a model library, a memory planner, load/unload and a wait queue
  for *many* models on one machine; here Ray owns placement, scaling and queueing, and one replica
  serves one model for its whole life, so the daemon's layer would only duplicate Serve's.
* ``OpenAIIngress`` (one replica by default): the OpenAI-compatible HTTP surface - ``/v1/models``,
  ``/v1/chat/completions`` (streamed and not), ``/v1/completions``. It renders the prompt exactly as
  the daemon does (``localrun.server.prompt.render_prompt`` with the model's own chat template,
  Modelfile SYSTEM/MESSAGES and PARAMETERs) and sends the replica the finished prompt text.
  Every answer names the replica that served it: the ``x-localrun-replica`` header and a
  ``localrun_replica`` field in the body and in every stream chunk.

Routing: ``localrun.cluster.router.PrefixAffinityRouter``, a Ray Serve *custom request router*
(``RequestRouterConfig`` on the replica deployment): a conversation's next turn - whose rendered
prompt extends the previous turn's - goes to the replica whose radix cache holds that prefix; new
conversations go to the least-loaded replica. The prefix table is bounded (LRU, ``max_blocks``).

Why a plain Serve deployment and not Ray Serve LLM's custom-engine protocol (checked against Ray 2.60,
the version pip installs today): Serve LLM's ``LLMEngine`` base class lives in
``ray.llm._internal.serve.core.engine.protocol`` (internal, no stability promise), speaks OpenAI
request/response models that Serve LLM takes from vLLM's OpenAI server, ``LLMConfig``'s engine enum has
only ``vLLM``, and ``ray.serve.llm`` needs the ``ray[llm]`` extra (vLLM, pyarrow, ...) just to import -
it does not import here with ``ray[serve]`` alone. Plugging localrun in there would tie it to Ray
internals and pull vLLM onto CPU boxes. What Serve LLM adds over plain Serve for this engine is the
OpenAI layer (localrun has its own) and prefix-aware routing, and routing is a *public* Serve API
(``ray.serve.request_router``, PublicAPI alpha; ``RequestRouterConfig`` with kwargs since Ray 2.48), so this module uses plain deployments plus
that API. The router reads ``.prompt`` from the call object, so Ray's own ``PrefixCacheAffinityRouter``
(``ray.serve.llm.request_router``, needs ``ray[llm]``; it reads ``prompt``/``messages`` too and keeps
its prefix tree in a detached actor) can be swapped in through the same ``RequestRouterConfig``.

Models too large for one node: each replica is one process with the whole model (this engine has no
tensor/pipeline parallelism across machines). A model whose memory plan exceeds the largest node is
refused with an error that points to vLLM on Ray (``ray.serve.llm`` with
``tensor_parallel_size``/``pipeline_parallel_size``), the documented hand-off for multi-node models.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

from localrun.backends.base import SamplingOptions
from localrun.errors import InsufficientMemory, InvalidRequest, LocalrunError

log = logging.getLogger("localrun.cluster")

REPLICA_HEADER = "x-localrun-replica"
VLLM_HINT = ("serve it with vLLM on Ray instead (Ray Serve LLM: `from ray.serve.llm import LLMConfig, "
             "build_openai_app` with engine_kwargs tensor_parallel_size/pipeline_parallel_size; "
             "https://docs.ray.io/en/latest/serve/llm/); localrun's native engine runs one whole model per replica")


class ModelTooLarge(InsufficientMemory):
    """The model does not fit on any single node of the cluster."""


def _need_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise LocalrunError(f"Ray Serve is not installed ({exc}); install it with: pip install \"localrun[ray]\"") from None
    return ray, serve


# ---------------------------------------------------------------------------------------------------- model
@dataclass
class ModelSource:
    """What every replica and the ingress need to know about the model (plain data: it travels to Ray)."""

    name: str
    weights: str
    format: str = "gguf"
    template: str | None = None
    system: str | None = None
    parameters: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    created: float = 0.0


def resolve_model(model: str) -> ModelSource:
    """A GGUF file path, or a model name in the local library (LOCALRUN_HOME)."""
    p = Path(model).expanduser()
    if p.is_file():
        from localrun.library.gguf_info import read_gguf_info

        info = read_gguf_info(p)
        return ModelSource(name=p.stem, weights=str(p.resolve()), template=info.chat_template,
                           created=p.stat().st_mtime)
    if p.suffix == ".gguf" or model.startswith(("/", ".", "~")):
        raise InvalidRequest(f"{model}: no such GGUF file")
    from localrun.library.api import Library

    r = Library().resolve(model)  # NotFound says to pull it
    return ModelSource(name=r.name, weights=str(r.weights), format=r.format, template=r.template, system=r.system,
                       parameters=dict(r.parameters or {}), messages=list(r.messages or []),
                       created=r.modified_at.timestamp())


def _load_spec(src: ModelSource, num_ctx: int, num_parallel: int, device: str | None):
    from localrun.backends.base import LoadSpec

    extra = {"native_device": device} if device else {}
    return LoadSpec(name=src.name, weights=Path(src.weights), format=src.format, num_ctx=num_ctx,
                    num_parallel=num_parallel, extra=extra)


def check_fits(src: ModelSource, num_ctx: int, num_parallel: int, device: str | None, gpus_per_replica: float) -> int:
    """Bytes one replica needs; ModelTooLarge when that exceeds the largest node (CPU: Ray's `memory`
    resource; GPU: the GPU memory this machine sees, when it has one)."""
    from localrun.backends import native

    est = native.estimate_memory(_load_spec(src, num_ctx, num_parallel, device))
    need = est.weights_bytes + est.kv_bytes + est.overhead_bytes
    gib = 2**30
    if gpus_per_replica > 0:
        try:
            import torch

            if torch.cuda.is_available():
                have = torch.cuda.get_device_properties(0).total_memory
                if need > have:
                    raise ModelTooLarge(f"{src.name} needs about {need / gib:.1f} GiB per replica (weights "
                                        f"{est.weights_bytes / gib:.1f} GiB + KV {est.kv_bytes / gib:.1f} GiB) but a "
                                        f"GPU here has {have / gib:.1f} GiB; {VLLM_HINT}")
        except ImportError:
            pass
        return need
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    have = max((n.get("Resources", {}).get("memory", 0) for n in nodes), default=0)
    if have and need > have:
        raise ModelTooLarge(f"{src.name} needs about {need / gib:.1f} GiB per replica (weights "
                            f"{est.weights_bytes / gib:.1f} GiB + KV {est.kv_bytes / gib:.1f} GiB) but the largest "
                            f"node offers {have / gib:.1f} GiB; lower --num-ctx/--num-parallel, or {VLLM_HINT}")
    return need


# ---------------------------------------------------------------------------------------------------- replica
@dataclass
class ReplicaCall:
    """One generation, as the ingress hands it to a replica. `prompt` is what the router matches on."""

    prompt: str
    options: SamplingOptions
    request_id: str = ""


def _replica_tag() -> str:
    from ray import serve

    ctx = serve.get_replica_context()
    rid = getattr(ctx, "replica_id", None)
    return getattr(rid, "unique_id", None) or ctx.replica_tag


class LocalrunReplica:
    """A Serve replica: one native engine on this node (Ray sets its CPUs/GPU)."""

    def __init__(self, src: ModelSource, num_ctx: int, num_parallel: int, device: str | None = None) -> None:
        from localrun.backends import native

        self.backend = native.load(_load_spec(src, num_ctx, num_parallel, device))
        self.tag = _replica_tag()

    async def generate(self, call: ReplicaCall) -> AsyncIterator[dict]:
        """Pieces as plain dicts; errors come back as one {"error": ...} item (status kept)."""
        from localrun.backends.base import GenerationRequest

        req = GenerationRequest(prompt=call.prompt, options=call.options, request_id=call.request_id)
        try:
            async for c in self.backend.generate(req):
                item: dict[str, Any] = {"text": c.text, "finish_reason": c.finish_reason, "replica": self.tag}
                if c.usage is not None:
                    item["usage"] = [c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens]
                yield item
        except LocalrunError as exc:
            yield {"error": {"message": exc.public_message, "status": exc.status, "code": exc.code}, "replica": self.tag}

    def stats(self) -> dict:
        return {"replica": self.tag, **self.backend.engine.stats()}


# ---------------------------------------------------------------------------------------------------- ingress
def _error(status: int, message: str, code: str, replica: str | None = None):
    from starlette.responses import JSONResponse

    etype = "invalid_request_error" if status < 500 else "server_error"
    headers = {REPLICA_HEADER: replica} if replica else None
    return JSONResponse({"error": {"message": message, "type": etype, "param": None, "code": code}},
                        status_code=status, headers=headers)


class OpenAIIngress:
    """OpenAI-compatible HTTP ingress (Serve calls __call__ with a Starlette request)."""

    def __init__(self, replica_handle, src: ModelSource) -> None:
        self.handle = replica_handle.options(stream=True)
        self.src = src
        self.resolved = SimpleNamespace(name=src.name, template=src.template, system=src.system,
                                        parameters=src.parameters, messages=src.messages)

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        path, method = request.url.path.rstrip("/"), request.method
        try:
            if path == "/v1/models" and method == "GET":
                return JSONResponse(self._models())
            if path == f"/v1/models/{self.src.name}" and method == "GET":
                return JSONResponse(self._models()["data"][0])
            if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
                try:
                    body = await request.json()
                except ValueError:
                    raise InvalidRequest("the request body is not valid JSON") from None
                if not isinstance(body, dict):
                    raise InvalidRequest("the request body must be a JSON object")
                return await self._generate(body, chat=path.endswith("chat/completions"))
            return _error(404, f"no route {method} {path}; this server has /v1/models, /v1/chat/completions "
                               "and /v1/completions", "not_found")
        except LocalrunError as exc:
            return _error(exc.status, exc.public_message, exc.code)
        except Exception as exc:  # noqa: BLE001 - a replica died or Serve failed: still OpenAI's error shape
            log.error("request failed: %s: %s", type(exc).__name__, exc)
            return _error(503, f"no replica could serve the request ({type(exc).__name__}); retry", "server_busy")

    def _models(self) -> dict:
        return {"object": "list", "data": [{"id": self.src.name, "object": "model", "created": int(self.src.created),
                                            "owned_by": "localrun"}]}

    async def _job(self, body: dict, chat: bool) -> tuple[ReplicaCall, bool, bool]:
        from localrun.server import params as p
        from localrun.server.job import Job
        from localrun.server.prompt import render_prompt
        from localrun.server.routes_openai import openai_options, thinking_switch

        model = body.get("model")
        if model not in (None, self.src.name):
            raise LocalrunError(f"model '{model}' is not served here; this deployment serves '{self.src.name}'",
                                status=404, code="model_not_found")
        opts, _num_ctx, n = openai_options(body, self.resolved, chat=chat)
        if n != 1:
            raise InvalidRequest("'n' must be 1 on the Ray Serve ingress")
        for key in ("tools", "logprobs", "top_logprobs", "suffix", "echo"):
            if body.get(key):
                raise InvalidRequest(f"'{key}' is not supported on the Ray Serve ingress yet; use the localrun daemon")
        if chat:
            messages = p.normalize_messages(body.get("messages"))
            if any(m.get("images") for m in messages):
                raise InvalidRequest("images are not supported on the Ray Serve ingress (its native engine has no "
                                     "vision tower); use the localrun daemon with a vision model")
            job = Job(resolved=self.resolved, options=opts, messages=messages, think=thinking_switch(body))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequest("'prompt' must be a non-empty string")
            job = Job(resolved=self.resolved, options=opts, prompt=prompt, raw=True)
        so = body.get("stream_options") or {}
        prompt = await asyncio.to_thread(render_prompt, job)  # templates can be slow (bounded): off the loop
        call = ReplicaCall(prompt=prompt, options=opts, request_id=uuid.uuid4().hex[:12])
        return call, p.get_bool(body, "stream"), bool(so.get("include_usage"))

    async def _generate(self, body: dict, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        call, stream, include_usage = await self._job(body, chat)
        gen = self.handle.generate.remote(call)
        it = gen.__aiter__()
        streaming = False
        try:
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                return _error(500, "the replica ended the stream without an answer", "server_error")
            if "error" in first:
                e = first["error"]
                return _error(e["status"], e["message"], e["code"], first.get("replica"))
            replica = first["replica"]
            cid = ("chatcmpl-" if chat else "cmpl-") + call.request_id
            created = int(time.time())
            if not stream:
                return JSONResponse(await self._collect(first, it, cid, created, chat),
                                    headers={REPLICA_HEADER: replica})
            streaming = True
            return StreamingResponse(self._sse(first, gen, it, cid, created, chat, include_usage),
                                     media_type="text/event-stream", headers={REPLICA_HEADER: replica})
        finally:
            if not streaming:
                gen.cancel()  # no-op when the replica finished; else it aborts the request and frees its KV

    def _usage(self, u: list | None) -> dict | None:
        from localrun.server.routes_openai import usage_body

        return usage_body(*u) if u else None

    async def _collect(self, first: dict, it, cid: str, created: int, chat: bool) -> dict:
        parts, last = [], first
        item = first
        while True:
            if "error" in item:
                raise LocalrunError(item["error"]["message"], status=item["error"]["status"], code=item["error"]["code"])
            parts.append(item["text"])
            last = item
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                break
        text, finish = "".join(parts), last.get("finish_reason") or "stop"
        finish = "stop" if finish == "abort" else finish
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.src.name, "choices": [choice], "usage": self._usage(last.get("usage")),
                "localrun_replica": first["replica"]}

    async def _sse(self, first: dict, gen, it, cid: str, created: int, chat: bool, include_usage: bool):
        from localrun.server.routes_openai import sse, stream_error

        obj = "chat.completion.chunk" if chat else "text_completion"
        replica = first["replica"]

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return sse({"id": cid, "object": obj, "created": created, "model": self.src.name, "choices": [choice],
                        "localrun_replica": replica})

        item, usage, role = first, None, chat
        try:
            while True:
                if "error" in item:
                    yield sse(stream_error(LocalrunError(item["error"]["message"], status=item["error"]["status"],
                                                         code=item["error"]["code"])))
                    break
                fin = item.get("finish_reason")
                if item["text"] or fin or role:
                    yield chunk(item["text"], ("stop" if fin == "abort" else fin), role)
                    role = False
                usage = item.get("usage") or usage
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
            if include_usage and usage:
                yield sse({"id": cid, "object": obj, "created": created, "model": self.src.name, "choices": [],
                           "usage": self._usage(usage), "localrun_replica": replica})
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream's error shape
            yield sse(stream_error(exc))
        finally:
            gen.cancel()  # the client went away (or an error): abort on the replica, free its KV
        yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------- app
def build_app(model: str | ModelSource, *, replicas: int = 1, min_replicas: int | None = None,
              max_replicas: int | None = None, num_ctx: int = 4096, num_parallel: int = 4,
              cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0, device: str | None = None,
              router: str = "localrun.cluster.router.PrefixAffinityRouter", router_kwargs: dict | None = None,
              check_memory: bool = True):
    """The Serve application (ingress bound to the replicas). Needs a connected Ray (ray.init) when
    `check_memory` is on. `router`: the replica deployment's request router class (import path), e.g.
    Ray's default "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter" to compare."""
    ray, serve = _need_ray()
    try:
        from ray.serve.config import RequestRouterConfig
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError:
        raise LocalrunError(f"Ray {ray.__version__} has no request router API (Ray Serve >= 2.48); upgrade with: "
                            "pip install -U \"localrun[ray]\"") from None

    src = model if isinstance(model, ModelSource) else resolve_model(model)
    if replicas < 1:
        raise InvalidRequest("--replicas must be at least 1")
    if gpus_per_replica > 1:
        raise InvalidRequest(f"--gpus-per-replica {gpus_per_replica}: the native engine runs a replica on one GPU "
                             f"(no tensor parallelism); for a model that needs several, {VLLM_HINT}")
    if (min_replicas is None) != (max_replicas is None):
        min_replicas = replicas if min_replicas is None else min_replicas
        max_replicas = max(replicas, min_replicas) if max_replicas is None else max_replicas
    if min_replicas is not None:
        if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
            raise InvalidRequest(f"need 0 <= --min-replicas ({min_replicas}) <= --max-replicas ({max_replicas}), "
                                 "max at least 1")
        if not min_replicas <= replicas <= max_replicas:
            replicas = min(max(replicas, min_replicas), max_replicas)
    if check_memory:
        check_fits(src, num_ctx, num_parallel, device, gpus_per_replica)
    scale: dict[str, Any] = {"num_replicas": replicas}
    if min_replicas is not None:
        scale = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                        "initial_replicas": replicas, "target_ongoing_requests": num_parallel}}
    replica = serve.deployment(LocalrunReplica, name="LocalrunReplica").options(
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        max_ongoing_requests=num_parallel * 2,
        request_router_config=RequestRouterConfig(
            request_router_class=router,
            request_router_kwargs=dict(router_kwargs or {})),
        **scale,
    )
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(replica.bind(src, num_ctx, num_parallel, device), src)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="localrun ray-serve",
        description="Serve MODEL (a GGUF file or a library model) with N replicas of localrun's native engine on a "
                    "Ray cluster, behind an OpenAI-compatible API with prefix-cache-aware routing.",
        epilog="A model too large for one node cannot be split across nodes by this engine: " + VLLM_HINT)
    ap.add_argument("model", help="GGUF path or library model name (readable on every node)")
    ap.add_argument("--replicas", type=int, default=1, help="replicas to start with (default 1)")
    ap.add_argument("--min-replicas", type=int, help="autoscaling lower bound (turns autoscaling on)")
    ap.add_argument("--max-replicas", type=int, help="autoscaling upper bound (turns autoscaling on)")
    ap.add_argument("--address", default="auto",
                    help="Ray cluster address: auto (default: the running cluster), ray://HOST:10001, or local")
    ap.add_argument("--http-host", default="0.0.0.0", help="Serve HTTP host (default 0.0.0.0)")
    ap.add_argument("--port", type=int, default=8000, help="Serve HTTP port (default 8000)")
    ap.add_argument("--num-ctx", type=int, default=4096, help="context window per sequence (default 4096)")
    ap.add_argument("--num-parallel", type=int, default=4,
                    help="sequences a replica runs at once; autoscaling targets this many ongoing requests")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--gpus-per-replica", type=float, default=0.0, help="1 to put each replica on a GPU (CUDA)")
    ap.add_argument("--name", default="localrun", help="Serve application name (default localrun)")
    ap.add_argument("--route-prefix", default="/", help="HTTP route prefix (default /)")
    ap.add_argument("--max-prefix-blocks", type=int, default=None, help="prefix table bound (16-char blocks)")
    ap.add_argument("--no-block", action="store_true",
                    help="deploy on the cluster and return (the app keeps running) instead of serving until Ctrl+C")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        ray, serve = _need_ray()
        src = resolve_model(args.model)
    except LocalrunError as exc:
        print(f"localrun ray-serve: {exc.message}", file=sys.stderr)
        return 1
    try:
        ray.init(address=None if args.address == "local" else args.address)
    except ConnectionError as exc:
        print(f"localrun ray-serve: no Ray cluster at {args.address} ({exc}); start one with `ray start --head` "
              "or pass --address local for a one-machine Ray", file=sys.stderr)
        return 1
    try:
        app = build_app(src, replicas=args.replicas, min_replicas=args.min_replicas,
                        max_replicas=args.max_replicas, num_ctx=args.num_ctx, num_parallel=args.num_parallel,
                        cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                        device="cuda" if args.gpus_per_replica > 0 else "cpu",
                        router_kwargs={"max_blocks": args.max_prefix_blocks} if args.max_prefix_blocks else None)
    except LocalrunError as exc:
        print(f"localrun ray-serve: {exc.message}", file=sys.stderr)
        return 1
    serve.start(http_options={"host": args.http_host, "port": args.port})
    serve.run(app, name=args.name, route_prefix=args.route_prefix, blocking=False)
    scale = (f"{args.replicas} replicas" if args.min_replicas is None and args.max_replicas is None
             else f"autoscaling {args.min_replicas}..{args.max_replicas} replicas")
    print(f"localrun ray-serve: {src.name} ({scale}) at "
          f"http://{args.http_host}:{args.port}{args.route_prefix.rstrip('/')}/v1", file=sys.stderr)
    if args.no_block:
        return 0

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # Ctrl+C or a service manager's stop: take the app down
    signal.signal(signal.SIGINT, stop)  # (also when started in the background, where SIGINT comes ignored)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(args.name)
        return 0


if __name__ == "__main__":
    sys.exit(main())
