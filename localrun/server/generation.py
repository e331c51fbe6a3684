"""The generation service: the one way from a validated request to tokens.

Every API (OpenAI chat/completions, Ollama generate/chat, Anthropic Messages, OpenAI
Responses) is a translator: it turns its JSON into a :class:`Job`, calls
:meth:`GenerationService.start`, and turns the typed events of the :class:`Generation`
it gets back into its own wire shape. The checks live here, once:

1. render the prompt (the model's template in the sandbox; Modelfile SYSTEM/MESSAGE),
2. lease the model (queue, admission, load: the model manager),
3. check the backend can do what the job asks (JSON schema, images, ...): 400 up front; images
   are checked and decoded before the lease (server/images.py: a model without a projector, too
   many, too big, a bomb, corrupt, a URL while fetching is off: 400 naming the part),
4. tokenize once (n choices share the prompt), check the context window (400 naming it),
   cap max_tokens at the room left (``fit_window``). A runner process tokenizes a single
   choice's prompt itself, with that same check, as part of starting it: one round trip to
   the runner before the first token, not two,
5. start the backend stream and wait for its first event, so a backend's refusal (a
   grammar it cannot build, a window it cannot fit) is still an HTTP error, not a broken
   stream,
6. split what the model writes into reasoning, content and tool calls
   (:mod:`localrun.server.output`) and hand back :class:`Delta`, :class:`ToolCalls`,
   :class:`Done` events with a normalized finish reason and usage.

The lease is released exactly once: when the events end, when the consumer closes them,
or by :meth:`Generation.release` (idempotent) from whoever gives up first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from localrun.backends.base import (CONTEXT_EXCEEDED, INFILL_BATCH, MEDIA_MARKER, Chunk, GenerationRequest, Infill,
                                    SamplingOptions, TokenLogprob, Usage, fit_window)
from localrun.templates.chat import MAX_OUTPUT_CHARS, render_chat
from localrun.errors import InvalidRequest, LocalrunError, ShuttingDown
from localrun.library.capabilities import KIND_USE, model_kind
from localrun.server import generic_tools
from localrun.server.images import load_images
from localrun.server.manager import DEFAULT, Lease, ModelManager
from localrun.server.output import (HARMONY_TOKENS, HarmonyParser, OutputParser, Reasoning, is_forced_call, is_harmony,
                                    reasoning_for)
from localrun.server.tool_formats import learn as learn_tool_format

log = logging.getLogger("localrun.generation")

RERANK_GROUP = 32  # documents one call to the runner scores


@dataclass
class Job:
    """What a translator asks for, already validated field by field."""

    resolved: Any  # the library's ResolvedModel
    options: SamplingOptions
    messages: list[dict] | None = None  # chat: normalized messages, rendered with the model's template
    prompt: str | None = None  # text: as given when `raw`, else wrapped as one user turn
    raw: bool = True
    system: str | None = None  # text jobs: a system prompt over the Modelfile's SYSTEM
    template: str | None = None  # text jobs: a template over the model's
    tools: list[dict] | None = None  # OpenAI-style tool definitions rendered into the prompt
    think: bool | None = None  # None: as the template does; False: ask it not to think; True: must think
    # how hard to think ("low", "medium", "high"): gpt-oss's reasoning_effort, for templates that take it
    # (the rest ignore it); Ollama's think levels, OpenAI's reasoning_effort, the Responses API's effort
    effort: str | None = None
    num_ctx: int | None = None
    keep_alive: Any = DEFAULT
    n: int = 1
    add_special: bool = True
    api: str = "openai"  # for metrics and logs
    # images (server.images.ImageInput), in the order of the MEDIA_MARKERs the rendered prompt holds:
    # a translator puts a marker in the message text (or prompt) where each image goes
    images: list | None = None
    # fill in the middle: the code before and after the cursor (and other files' chunks); `prompt` (raw)
    # goes after the prefix, as llama-server's /infill takes it. The backend lays it out with the
    # model's FIM tokens; a model without them is a 400.
    infill: Infill | None = None
    prompt_ids: bool = False  # keep the prompt's token ids (Generation.prompt_ids: Ollama's `context`)
    tool_format: str | None = None  # "generic": the template cannot render tools (server/generic_tools.py)
    cache_key: str | None = None  # the client's prompt_cache_key: a routing / prefix-cache hint for the backend
    # a chat longer than the window drops its oldest turns (Ollama's /api/chat `truncate`, on by default
    # there): system messages and the last user turn stay; see GenerationService._fit_messages
    truncate: bool = False
    # the last message is the assistant's and the model continues it (Anthropic's prefill, vLLM's
    # continue_final_message): the chat is rendered without a new turn and cut after that message's text
    continue_final: bool = False
    # the prompt as token ids (OpenAI completions' other form): neither rendered nor tokenized; the
    # backend checks them against its vocabulary
    token_prompt: list[int] | None = None
    # Ollama's /api/generate `context` (an earlier answer's token ids), as text: it goes before the prompt,
    # as Ollama puts it (render_prompt)
    context_text: str | None = None


@dataclass
class Delta:
    index: int
    content: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)
    cut_chars: int = 0  # the last chunk's Chunk.cut_chars: content's last characters a llama-server stream leaves out
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first Delta when options.prompt_logprobs is set


@dataclass
class ToolCalls:
    index: int
    calls: list[dict]  # [{"id", "name", "arguments": JSON string}]


@dataclass
class Done:
    index: int
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it, when one did


Event = Delta | ToolCalls | Done


@dataclass
class Choice:
    """One finished choice, for non-streamed answers."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # options.prompt_logprobs: one per prompt token


class Generation:
    """A started job: its events, or its collected choices; then the lease goes back."""

    def __init__(self, service: "GenerationService", job: Job, lease: Lease, release: Callable[[], Awaitable[None]],
                 requests: list[GenerationRequest], prompt: str, reasoning, t0: float) -> None:
        self.service, self.job, self.lease, self._release = service, job, lease, release
        self.requests, self.prompt, self.reasoning = requests, prompt, reasoning
        self.t0 = t0
        self.id = uuid.uuid4().hex
        self.model = job.resolved.name
        self.prompt_tokens = len(requests[0].prompt_token_ids or [])
        self.usage = Usage(prompt_tokens=self.prompt_tokens)
        self._first: dict[int, tuple[AsyncIterator[Chunk], Chunk]] = {}  # started choices and their first chunks
        # backend streams not yet closed: release() closes them, so a consumer that vanished
        # without closing its iterator (a cancelled response task) still aborts the work
        self._open: list = []
        self._released = False
        self._priming: asyncio.Task | None = None  # prime_soon's task, until the first chunk is in
        self._started = False
        self.interrupted: BaseException | None = None  # set when the daemon ends this generation early
        self.prompt_ids: list[int] | None = requests[0].prompt_token_ids if job.prompt_ids else None
        self.output_ids: dict[int, list[int]] = {}  # every token each choice generated (Ollama's `context`)

    @property
    def load_seconds(self) -> float:
        return self.lease.load_seconds

    async def _prime(self) -> None:
        """Start choice 0 and take its first chunk (errors raise here, before any response).
        A group (n > 1 on a backend that shares the prefill) starts every choice at once: the
        backend holds the group until all its members are there."""
        grouped = len(self.requests) > 1 and self.requests[0].group is not None
        streams = [self.lease.backend.generate(r) for r in (self.requests if grouped else self.requests[:1])]
        self._open.extend(streams)

        async def first(stream) -> Chunk:
            try:
                return await stream.__anext__()
            except StopAsyncIteration:
                return Chunk(finish_reason="stop", usage=Usage(prompt_tokens=self.prompt_tokens))

        try:
            if len(streams) == 1:  # awaited here: no task, and no loop turn to hand the chunk back (TTFT)
                chunks = [await first(streams[0])]
            else:
                chunks = await asyncio.gather(*(first(st) for st in streams), return_exceptions=True)
                failed = next((c for c in chunks if isinstance(c, BaseException)), None)
                if failed is not None:
                    raise failed
        except BaseException:
            for st in streams:
                await st.aclose()
                self._open.remove(st)
            raise
        if chunks[0].prompt_tokens is not None:  # the runner tokenized the prompt (request.window)
            self.prompt_tokens = self.usage.prompt_tokens = chunks[0].prompt_tokens
        if chunks[0].cached_tokens is not None:  # known from the start (Anthropic's message_start splits it)
            self.usage.cached_tokens = chunks[0].cached_tokens
        if self.job.prompt_ids and chunks[0].prompt_token_ids is not None:  # the runner's tokens or infill layout
            self.prompt_ids = list(chunks[0].prompt_token_ids)
        self._first = dict(enumerate(zip(streams, chunks)))

    async def prime(self) -> None:
        """start(prime=False)'s second half: start the backend and take the first chunk; a failure
        gives the lease back and raises (a prompt over the window with the advice start gives)."""
        try:
            await self._prime()
        except InvalidRequest as exc:
            await self.release()
            raise _context_advice(exc, self.job, self.lease) from None
        except BaseException:
            await self.release()
            raise

    def prime_soon(self) -> asyncio.Task:
        """prime() in a task of its own, for a route that sends something while the prompt prefills
        (Anthropic's keep-alive); release() cancels it."""
        self._priming = asyncio.ensure_future(self.prime())
        return self._priming

    async def release(self) -> None:
        if not self._released:
            self._released = True
            task, self._priming = self._priming, None
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()  # (its stream is being iterated there: closed by _prime as the cancel lands)
                await asyncio.wait({task})
            self.service.active.discard(self)
            self._first = {}
            for stream in self._open:
                try:
                    await stream.aclose()  # the backend aborts whatever it was still generating
                except RuntimeError:  # being iterated right now: that consumer closes it
                    pass
            self._open.clear()
            await self._release()

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events in order (choice 0, then 1, ...); releases the lease at the end."""
        if self._started:
            raise RuntimeError("a generation's events can be read once")
        self._started = True
        metrics = self.service.metrics
        try:
            for i, req in enumerate(self.requests):
                if self.interrupted is not None:
                    raise self.interrupted
                if i in self._first:
                    stream, pending = self._first.pop(i)
                else:
                    stream, pending = self.lease.backend.generate(req), None
                    self._open.append(stream)
                names = {t["function"]["name"] for t in self.job.tools or []} or None
                generic = self.job.tool_format == generic_tools.NAME
                parser = HarmonyParser(names) if _harmony(self.job) \
                    else OutputParser(self.reasoning, names, tool_format=learn_tool_format(self.job.resolved.template)
                                      if self.job.tools and not generic else None, tools=self.job.tools, generic=generic,
                                      forced=bool(self.job.tools) and is_forced_call(self.job.options.json_schema))
                hide_reasoning = self.job.think is False
                first_at, last_at = None, None
                try:
                    while True:
                        if self.interrupted is not None:
                            raise self.interrupted
                        if pending is not None:
                            chunk, pending = pending, None
                        else:
                            try:
                                chunk = await stream.__anext__()
                            except StopAsyncIteration:
                                break
                        now = time.perf_counter()
                        if chunk.token_ids and metrics is not None:
                            if first_at is None:
                                metrics.first_token(self, now - self.t0)
                            elif last_at is not None:
                                metrics.inter_token(self, (now - last_at) / len(chunk.token_ids), len(chunk.token_ids))
                        if chunk.token_ids:
                            first_at = first_at or now
                            last_at = now
                            self.output_ids.setdefault(i, []).extend(chunk.token_ids)
                        reasoning, content = parser.feed(chunk.text) if chunk.text else ("", "")
                        if hide_reasoning:
                            reasoning = ""
                        if reasoning or content or chunk.logprobs or chunk.prompt_logprobs is not None:
                            yield Delta(i, content, reasoning, chunk.logprobs, list(chunk.token_ids),
                                        chunk.cut_chars if chunk.finish_reason is not None else 0,
                                        chunk.prompt_logprobs)
                        if chunk.finish_reason is not None:
                            reasoning, content, calls = parser.finish()
                            if hide_reasoning:
                                reasoning = ""
                            if reasoning or content:
                                yield Delta(i, content, reasoning)
                            if calls:
                                yield ToolCalls(i, calls)
                            usage = chunk.usage or Usage(prompt_tokens=self.prompt_tokens)
                            self._add_usage(usage)
                            reason = "tool_calls" if calls else chunk.finish_reason
                            if metrics is not None:
                                metrics.finished(self, usage, reason)
                            yield Done(i, reason, usage, chunk.stop_sequence if reason == "stop" else None)
                            break
                finally:
                    await stream.aclose()
                    if stream in self._open:
                        self._open.remove(stream)
        finally:
            await self.release()

    def _add_usage(self, u: Usage) -> None:
        self.usage.prompt_tokens = u.prompt_tokens or self.usage.prompt_tokens
        self.usage.cached_tokens = max(self.usage.cached_tokens, u.cached_tokens)
        self.usage.completion_tokens += u.completion_tokens
        self.usage.prompt_eval_seconds = self.usage.prompt_eval_seconds or u.prompt_eval_seconds
        self.usage.eval_seconds += u.eval_seconds

    async def collect(self) -> list[Choice]:
        """Run every choice to its end; the non-streamed answer."""
        choices = [Choice(i) for i in range(len(self.requests))]
        parts: list[tuple[list[str], list[str]]] = [([], []) for _ in choices]
        async for ev in self.events():
            ch = choices[ev.index]
            if isinstance(ev, Delta):
                parts[ev.index][0].append(ev.content)
                parts[ev.index][1].append(ev.reasoning)
                if ev.logprobs:
                    ch.logprobs.extend(ev.logprobs)
                if ev.prompt_logprobs is not None:
                    ch.prompt_logprobs = ev.prompt_logprobs
                ch.token_ids.extend(ev.token_ids)
            elif isinstance(ev, ToolCalls):
                ch.tool_calls.extend(ev.calls)
            else:
                ch.finish_reason, ch.usage, ch.stop_sequence = ev.finish_reason, ev.usage, ev.stop_sequence
        for ch, (content, reasoning) in zip(choices, parts):
            ch.content, ch.reasoning = "".join(content), "".join(reasoning)
        return choices


class GenerationService:
    def __init__(self, manager: ModelManager, metrics: Any = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self.active: set[Generation] = set()
        self.draining = False

    def _admit(self) -> None:
        if self.draining:
            raise ShuttingDown("the daemon is shutting down; send the request again once it is back")

    async def drain(self, grace: float) -> None:
        """Admit nothing new; let running generations go on for up to `grace` seconds, then end
        each remaining one with an error (its stream closes properly, with a finish reason)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.active:
            return
        exc = ShuttingDown(f"the daemon is shutting down: this answer was cut after the {grace:g}s grace period "
                           "(LOCALRUN_SHUTDOWN_GRACE); send the request again once it is back")
        for gen in list(self.active):
            gen.interrupted = exc
        for runner in list(self.manager.runners.values()):
            interrupt = getattr(runner.backend, "interrupt_all", None)
            if interrupt is not None:  # wakes the streams waiting on their next token
                interrupt(exc)

    async def start(self, job: Job, *, prime: bool = True) -> Generation:
        """Render, lease, check, tokenize and start `job`; raises (with the lease given back)
        on anything the request itself got wrong, before any response is sent. `prime` False: the
        backend is not started yet; the caller runs Generation.prime (or prime_soon) next."""
        self._admit()
        t0 = time.perf_counter()
        _check_generates(job)
        images = await self._images(job)
        prompt, reasoning = await self._render(job)
        if images:
            self._check_markers(prompt, images)
        lease, release = await self._lease(job)
        gen = None
        try:
            self._admit()  # it may have waited in the queue while the daemon began to stop
            self._check_capabilities(job, lease)
            if job.truncate and job.messages and len(job.messages) > 1:
                job, prompt, reasoning, images = await self._fit_messages(job, lease, prompt, reasoning, images)
            self._check_length(prompt, lease)
            if job.token_prompt is not None:
                requests = self._requests(job, lease, prompt, list(job.token_prompt))
            elif job.infill is not None:  # the backend lays the prompt out (and checks the window)
                requests = self._requests(job, lease, prompt, None)
            elif images or (job.n == 1 and getattr(lease.backend, "tokenizes_in_generate", False)):
                # the runner tokenizes (a prompt with images only it can: image tokens come from the projector)
                requests = self._requests(job, lease, prompt, None, images)
            else:
                ids = await lease.backend.tokenize(prompt, add_special=job.add_special)
                requests = self._requests(job, lease, prompt, ids)
            gen = Generation(self, job, lease, release, requests, prompt, reasoning, t0)
            self.active.add(gen)
            if self.metrics is not None:
                self.metrics.started(gen)
            if prime:
                await gen._prime()
        except InvalidRequest as exc:
            if gen is not None:
                self.active.discard(gen)
            await release()
            raise _context_advice(exc, job, lease) from None
        except BaseException:
            if gen is not None:
                self.active.discard(gen)
            await release()
            raise
        return gen

    async def count_tokens(self, job: Job) -> int:
        """The length in tokens of the prompt `job` renders to, by its model's own template and
        tokenizer; nothing is generated (the model is loaded, or kept, for its tokenizer)."""
        self._admit()
        if job.images:
            # image tokens are known once the runner has laid the prompt out with the projector: start it
            # (prefill and one token, its prefix then cached for the real request) and read its length
            opts = replace(job.options, max_tokens=1, json_schema=None, json_mode=False, regex=None, choices=None,
                           grammar=None, logit_bias=None,
                           logprobs=False, stop=[], stop_token_ids=[])
            gen = await self.start(replace(job, options=opts, n=1, tools=job.tools))
            try:
                return gen.prompt_tokens
            finally:
                await gen.release()
        return len((await self.tokenize(job))[0])

    async def tokenize(self, job: Job) -> tuple[list[int], int]:
        """The token ids of the prompt `job` renders to (its model's template and tokenizer; images
        are not laid out here: count_tokens does that) and the window (num_ctx) they would run in.
        Nothing is generated; the model is loaded, or kept, for its tokenizer."""
        self._admit()
        if job.images:
            raise InvalidRequest("images are not tokenized here: /v1/messages/count_tokens counts a prompt with "
                                 "images")
        prompt, _ = await self._render(job)
        lease, release = await self._lease(job, slot=False)  # no generation slot: never behind a stream
        try:
            self._check_length(prompt, lease)  # bounded work: a prompt that cannot fit is not tokenized
            return await lease.backend.tokenize(prompt, add_special=job.add_special), lease.num_ctx
        finally:
            await release()

    async def detokenize(self, resolved: Any, ids: list[int], *, keep_alive: Any = DEFAULT) -> str:
        """The text token ids stand for, by the model's own vocabulary (an id outside it is a 400)."""
        self._admit()
        async with self.manager.use(resolved, keep_alive=keep_alive, slot=False) as lease:
            return await lease.backend.detokenize(ids)

    async def tokenizer(self, resolved: Any, *, keep_alive: Any = DEFAULT) -> tuple[str, str, int]:
        """The model's (begin-of-text token, end-of-text token, window): its vocabulary's, loaded (or kept)."""
        self._admit()
        async with self.manager.use(resolved, keep_alive=keep_alive, slot=False) as lease:
            info = lease.backend.info
            return info.bos_token, info.eos_token, lease.num_ctx

    async def embed(self, resolved: Any, texts: list[str], *, keep_alive: Any = DEFAULT,
                    dimensions: int | None = None, truncate: bool = False) -> tuple[list[list[float]], int]:
        """Embedding vectors (truncated to `dimensions`, then re-normalized, as OpenAI's
        text-embedding-3 models do) and the number of input tokens. An input longer than the model's
        embedding window is a 400, or with `truncate` (Ollama's /api/embed) its first tokens are embedded."""
        self._admit()
        if model_kind(resolved) == "rerank":
            what, where = KIND_USE["rerank"]
            raise InvalidRequest(f'"{resolved.name}" does not support embeddings: it is {what}, which scores '
                                 f"documents against a query; use it with {where}")
        async with self._able(resolved, keep_alive, "supports_embeddings", "make embeddings") as lease:
            vectors = await lease.backend.embed(texts, truncate=truncate)
            counts = [len(await lease.backend.tokenize(t, add_special=True)) for t in texts]
            window = lease.backend.info.embed_window
            n_tokens = sum(min(n, window) for n in counts) if truncate and window else sum(counts)
        if dimensions is not None:
            if vectors and dimensions > len(vectors[0]):  # (OpenAI refuses a size its model cannot give)
                raise InvalidRequest(f"'dimensions' is {dimensions}; {resolved.name}'s embeddings have "
                                     f"{len(vectors[0])}: ask for {len(vectors[0])} or fewer")
            vectors = [_renormalize(v[:dimensions]) for v in vectors]
        return vectors, n_tokens

    @asynccontextmanager
    async def _able(self, resolved: Any, keep_alive: Any, able: str, doing: str) -> AsyncIterator[Lease]:
        """A lease of the loaded model whose backend can (BackendInfo.`able`), else a 400 saying it cannot `doing`."""
        async with self.manager.use(resolved, keep_alive=keep_alive) as lease:
            info = lease.backend.info
            if not getattr(info, able):
                raise InvalidRequest(f"{resolved.name} runs on the {info.name} backend, which does not {doing}")
            yield lease

    async def rerank(self, resolved: Any, query: str, documents: list[str], *, keep_alive: Any = DEFAULT,
                     truncate: bool = False) -> tuple[list[list[float]], list[int]]:
        """Each document's classifier outputs against the query, and each pair's tokens (a reranker's: the
        model's GGUF has a classifier head). A pair over the model's window is a 400, or with `truncate`
        its document is cut."""
        self._admit()
        if (kind := model_kind(resolved)) != "rerank":
            what = KIND_USE[kind][0]
            raise InvalidRequest(f'"{resolved.name}" does not support reranking: it is {what}. A reranker\'s GGUF '
                                 "has a classifier head (bge-reranker-v2-m3, Qwen3-Reranker)")
        async with self._able(resolved, keep_alive, "supports_rerank", "rerank") as lease:
            scores: list[list[float]] = []
            counts: list[int] = []
            # a few documents a call: a client that goes away stops the work within one group
            for i in range(0, len(documents), RERANK_GROUP):
                s, c = await lease.backend.rerank(query, documents[i:i + RERANK_GROUP], truncate=truncate)
                scores += s
                counts += c
            return scores, counts

    @staticmethod
    async def _render(job: Job) -> tuple[str, Reasoning | None]:
        """The prompt, and how the model marks its thinking (None: it does not think)."""
        if job.infill is not None:  # laid out by the backend with the model's FIM tokens, no template
            return job.prompt or "", None
        if job.messages is not None and job.tool_format is None and generic_tools.needed(
                job.resolved.template, job.tools):
            await asyncio.to_thread(generic_tools.prepare, job)  # may build a grammar: off the loop
        # a template runs on a worker thread (a slow one must not stall the loop); a raw prompt has none
        prompt = render_prompt(job) if job.raw and job.messages is None else await asyncio.to_thread(render_prompt, job)
        reasoning = reasoning_for(job.template or job.resolved.template, prompt)
        if job.think is True and reasoning is None and not is_harmony(job.template or job.resolved.template):
            raise InvalidRequest(f"{job.resolved.name} does not support thinking (its template has no "
                                 "<think> block); leave thinking unset or turn it off")
        return prompt, reasoning

    async def _fit_messages(self, job: Job, lease: Lease, prompt: str, reasoning, images: list[bytes] | None):
        """Ollama's chat truncation: a conversation whose prompt leaves the answer less than a quarter of
        the window (or its max_tokens, if fewer) loses its oldest turns, cut before a user message (a
        template may insist that turns alternate from a user one), the system messages among them kept;
        the fewest dropped that fit, found by bisection (each try one render and one tokenize). When even
        the last user turn on its own leaves too little room, that is what goes; a prompt over the window
        is then refused as ever. Images in dropped turns go with them; an image counts here as its marker's
        text (only the runner knows its tokens), so a kept one can still overflow: a 400 then, as ever.
        (job, prompt, reasoning, images)."""
        window = lease.num_ctx
        room = max(1, min(job.options.max_tokens or window, window // 4))
        target = window - room
        if len(prompt.encode()) + 2 <= target:  # no token stands for less than a byte (+ BOS / EOS)
            return job, prompt, reasoning, images
        msgs = job.messages

        per_token = lease.backend.info.max_token_bytes

        async def tokens(text: str) -> int:
            if per_token and len(text) > per_token * window:  # cannot fit: not worth tokenizing (_check_length)
                return window + 1
            return len(await lease.backend.tokenize(text, add_special=job.add_special))

        if await tokens(prompt) <= target:
            return job, prompt, reasoning, images
        cuts = [i for i, m in enumerate(msgs) if i > 0 and m["role"] == "user"]
        if not cuts:
            return job, prompt, reasoning, images

        async def cut_at(i: int):
            kept = [m for m in msgs[:i] if m["role"] == "system"] + msgs[i:]
            cut = replace(job, messages=kept)
            text, why = await self._render(cut)
            return cut, text, why

        lo, hi, best = 0, len(cuts) - 1, None
        while lo <= hi:  # the fewest turns dropped whose prompt fits (fewer dropped: never shorter)
            mid = (lo + hi) // 2
            found = await cut_at(cuts[mid])
            if await tokens(found[1]) <= target:
                best, hi = (cuts[mid], found), mid - 1
            else:
                lo = mid + 1
        i, (cut, text, why) = best if best is not None else (cuts[-1], await cut_at(cuts[-1]))
        dropped = [m for m in msgs[:i] if m["role"] != "system"]
        if images:  # each message holds the images of its markers, in order: the kept ones keep theirs
            kept, at = [], 0
            for j, m in enumerate(msgs):
                n = str(m.get("content") or "").count(MEDIA_MARKER)
                if j >= i or m["role"] == "system":
                    kept += images[at:at + n]
                at += n
            images = kept or None
            self._check_markers(text, images or [])
        log.info("%s: the chat's %d oldest of %d messages were dropped to fit num_ctx %d (%s)", job.resolved.name,
                 len(dropped), len(msgs), window, job.api)
        return cut, text, why, images

    async def _images(self, job: Job) -> list[bytes] | None:
        """The job's images as bytes, every bound checked (server/images.py), or None. A model
        without a vision projector is refused here, before anything is loaded or fetched."""
        if not job.images:
            return None
        if getattr(job.resolved, "projector", None) is None:
            raise InvalidRequest(f"{job.resolved.name} cannot take images: it has no vision projector. Send text "
                                 "only, or use a vision model (one pulled with its projector, or created with a "
                                 "second FROM naming its mmproj GGUF)")
        return await load_images(job.images, self.manager.settings)

    @staticmethod
    def _check_markers(prompt: str, images: list[bytes]) -> None:
        found = prompt.count(MEDIA_MARKER)
        if found != len(images):
            raise InvalidRequest(f"the rendered prompt holds {found} image place(s) for {len(images)} image(s): the "
                                 f"text {MEDIA_MARKER} is reserved for images, and the model's template must keep "
                                 "every message that carries one")

    async def _lease(self, job: Job, slot: bool = True) -> tuple[Lease, Callable[[], Awaitable[None]]]:
        cm = self.manager.use(job.resolved, num_ctx=job.num_ctx, keep_alive=job.keep_alive, slot=slot)
        lease = await cm.__aenter__()
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                await cm.__aexit__(None, None, None)

        return lease, release

    @staticmethod
    def _check_capabilities(job: Job, lease: Lease) -> None:
        info = lease.backend.info
        o = job.options
        if o.constraints() and not info.supports_json_schema:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which cannot constrain "
                                 "output (JSON, a regex, choices, a grammar) yet; use LOCALRUN_BACKEND=llamacpp")
        if o.logprobs and not info.supports_logprobs:
            raise InvalidRequest(f"the {info.name} backend does not return logprobs")
        if (o.prompt_logprobs is not None or o.max_tokens == 0) and not info.supports_prompt_logprobs:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which does not score prompts "
                                 "(the prompt's logprobs, max_tokens 0); use LOCALRUN_BACKEND=llamacpp for them")
        if job.images and not info.supports_images:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which cannot take images yet; "
                                 "run it with LOCALRUN_BACKEND=llamacpp (or auto) to send it images")
        if job.infill is not None and not info.supports_infill:
            raise InvalidRequest(infill_refusal(job.resolved.name, info.name))
        if o.logit_bias and not info.supports_logit_bias:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which does not take "
                                 "logit_bias; use LOCALRUN_BACKEND=llamacpp for it")

    @staticmethod
    def _trim_infill(job: Job, lease: Lease) -> Infill:
        """The infill with texts no longer than the layout can use: the backend keeps the prefix's last
        3/4 x INFILL_BATCH tokens, the suffix's first 1/4 and as many tokens of the extra chunks as the
        window holds, and no token is longer than max_token_bytes, so characters beyond that (plus a
        margin for the tokens at the cut) cannot reach the model: a 30 MB file costs no 30 s tokenizing."""
        inf = job.infill
        per_token = lease.backend.info.max_token_bytes
        if inf is None or not per_token:
            return inf
        margin = 4096
        keep_pre = per_token * (3 * (INFILL_BATCH // 4)) + margin
        keep_suf = per_token * (INFILL_BATCH // 4) + margin
        room = per_token * lease.num_ctx + margin
        extra: list[dict] = []
        for chunk in reversed(inf.extra):  # the layout keeps the extra tokens nearest the prefix
            if room <= 0:
                break
            text = chunk.get("text") or ""
            text = text[-room:] if len(text) > room else text
            room -= len(text) + len(chunk.get("filename") or "")
            extra.append({**chunk, "text": text})
        extra.reverse()
        return Infill(prefix=inf.prefix[-keep_pre:] if len(inf.prefix) > keep_pre else inf.prefix,
                      suffix=inf.suffix[:keep_suf], extra=extra)

    @staticmethod
    def _check_length(prompt: str, lease: Lease) -> None:
        """Refuse a prompt that cannot fit the window before spending time tokenizing it: no
        token stands for more than max_token_bytes bytes (and a character is at least a byte)."""
        per_token = lease.backend.info.max_token_bytes
        if per_token and len(prompt) > per_token * lease.num_ctx:
            raise InvalidRequest(f"the prompt is {len(prompt)} characters: more than the context window of "
                                 f"{lease.num_ctx} tokens (num_ctx) can hold; shorten the prompt or ask for a larger "
                                 "num_ctx", code=CONTEXT_EXCEEDED)

    @staticmethod
    def _requests(job: Job, lease: Lease, prompt: str, ids: list[int] | None,
                  images: list[bytes] | None = None) -> list[GenerationRequest]:
        """The backend requests of `job`; `ids` None: the runner tokenizes and checks the window.
        Every choice carries the images (the same bytes objects)."""
        o = replace(job.options, stop=list(job.options.stop), stop_token_ids=list(job.options.stop_token_ids))
        if job.infill is not None:  # n separate requests, each laid out and window-checked by the backend
            infill = GenerationService._trim_infill(job, lease)
            return [GenerationRequest(prompt=prompt, options=replace(o, seed=o.seed + i) if (o.seed is not None and i)
                                      else o, request_id=uuid.uuid4().hex, window=lease.num_ctx, infill=infill)
                    for i in range(job.n)]
        if ids is not None:
            o.max_tokens = fit_window(len(ids), lease.num_ctx, o.max_tokens)
        out = []
        gid = uuid.uuid4().hex if job.n > 1 and lease.backend.info.supports_groups else None
        for i in range(job.n):
            oi = replace(o, seed=o.seed + i) if (o.seed is not None and i) else o
            if ids is None:
                oi = replace(oi, stop=list(oi.stop), stop_token_ids=list(oi.stop_token_ids))  # the runner caps each
                out.append(GenerationRequest(prompt=prompt, options=oi, request_id=uuid.uuid4().hex,
                                             add_special=job.add_special, window=lease.num_ctx, images=images,
                                             return_prompt_ids=job.prompt_ids, group=(gid, job.n, i) if gid else None,
                                             preserve=_preserve(job), cache_key=job.cache_key))
            else:
                out.append(GenerationRequest(prompt=prompt, options=oi, request_id=uuid.uuid4().hex,
                                             prompt_token_ids=ids, group=(gid, job.n, i) if gid else None,
                                             preserve=_preserve(job), cache_key=job.cache_key))
        return out


def infill_refusal(model: str, backend: str) -> str:
    return (f"{model} cannot fill in the middle (suffix / input_suffix) on the {backend} backend: its vocabulary "
            "has no fill-in-the-middle tokens, or its backend cannot lay them out (llama.cpp can); use a code model "
            "with FIM tokens such as Qwen2.5-Coder, or send the prompt without a suffix")


def _harmony(job: Job) -> bool:
    """The prompt was rendered by a harmony template (gpt-oss): a chat, or a templated /api/generate
    (not a raw prompt, whose output goes back as the model wrote it)."""
    return (job.messages is not None or not job.raw) and is_harmony(job.template or job.resolved.template)


def _preserve(job: Job) -> list[str] | None:
    """The tool-call markers of the model's template, kept as text in the output (tools only), and
    a harmony template's message framing (its channels are parsed from the text)."""
    if _harmony(job):
        return list(HARMONY_TOKENS)
    fmt = learn_tool_format(job.resolved.template) if job.tools and job.tool_format != generic_tools.NAME \
        else None
    return list(fmt.specials) or None if fmt is not None else None


def _check_generates(job: Job) -> None:
    """An embedding model or a reranker generates nothing: refused before it is loaded, in Ollama's words
    ('"all-minilm" does not support chat') and with where to use it."""
    kind = model_kind(job.resolved)
    if kind == "completion":
        return
    what, where = KIND_USE[kind]
    raise InvalidRequest(f'"{job.resolved.name}" does not support {"chat" if job.messages is not None else "generate"}: '
                         f"it is {what}; use it with {where}")


def _context_advice(exc: InvalidRequest, job: Job, lease: Lease) -> InvalidRequest:
    """A prompt over the window: say what the model's limit is and advice that can work (a
    larger num_ctx only when the model was trained for one)."""
    if "context window" not in exc.message or "num_ctx" not in exc.message:
        return exc
    train = getattr(getattr(job.resolved, "info", None), "context_length", None)
    head = exc.message.split(";")[0]
    if train and lease.num_ctx < train:
        # where this request's API takes a num_ctx (/v1 and Anthropic: a top-level extension; llama.cpp's: none)
        where = ("options.num_ctx, " if job.api.startswith("ollama.") else "" if job.api.startswith("llama.")
                 else "the request's top-level num_ctx, ")
        advice = (f"{job.resolved.name} was trained for {train} tokens: ask for a larger num_ctx (up to {train}: "
                  f"{where}PARAMETER num_ctx or LOCALRUN_CONTEXT_LENGTH), or shorten the prompt")
    else:
        advice = (f"{lease.num_ctx} tokens is {job.resolved.name}'s limit (the context it was trained for); shorten "
                  "the prompt (fewer or smaller tools, a shorter system prompt, fewer turns) or use a model with a "
                  "longer context")
    return InvalidRequest(f"{head}; {advice}", code=exc.code)


def _renormalize(v: list[float]) -> list[float]:
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v] if norm > 0 else v


def _check_text_size(messages: list[dict]) -> None:
    """A chat whose text is more than a template may build (MAX_OUTPUT_CHARS, about a million tokens: more
    than any context window) is a 400 saying so, before the template runs into its own bound and is blamed."""
    n = 0
    for m in messages:
        n += len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            n += len(args) if isinstance(args, str) else len(json.dumps(args)) if args is not None else 0
    if n > MAX_OUTPUT_CHARS:
        raise InvalidRequest(f"the messages hold {n:,} characters of text; a prompt may hold at most "
                             f"{MAX_OUTPUT_CHARS:,} (about a million tokens, more than any context window): "
                             "shorten the conversation, or send the text in parts")


def render_prompt(job: Job) -> str:
    """The prompt text the model sees (runs on a worker thread: templates can be slow)."""
    r = job.resolved
    extra: dict[str, Any] = {}
    if job.think is not None:
        extra["enable_thinking"] = job.think  # Qwen3's switch; templates that lack it ignore it
    if job.effort is not None:
        extra["reasoning_effort"] = job.effort  # gpt-oss's "Reasoning: high"
    if job.messages is not None:
        msgs = list(job.messages)
        _check_text_size(msgs)
        history = [dict(m) for m in (r.messages or [])]
        if r.system and not any(m["role"] == "system" for m in msgs):
            history.insert(0, {"role": "system", "content": r.system})
        tools = None if job.tool_format == generic_tools.NAME else (job.tools or None)
        if tools:
            learn_tool_format(r.template)  # learned here, off the event loop (cached per template)
        if job.continue_final:
            rendered = render_chat(r.template, history + msgs, add_generation_prompt=False, tools=tools, **extra)
            return _cut_after_final(rendered, msgs[-1])
        return render_chat(r.template, history + msgs, add_generation_prompt=True, tools=tools, **extra)
    assert job.prompt is not None
    before = job.context_text or ""
    if job.raw:
        return before + job.prompt
    msgs = []
    system = job.system if job.system is not None else r.system
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": job.prompt})
    return before + render_chat(job.template or r.template, msgs, add_generation_prompt=True, **extra)


def _cut_after_final(rendered: str, final: dict) -> str:
    """The rendered chat up to the end of its last (assistant) message's text, so that the model goes
    on writing it (transformers' continue_final_message does the same): the text as given, else as
    the template trimmed it; a 400 when the template does not write it at all."""
    if final.get("role") != "assistant":
        raise InvalidRequest("only an assistant message can be continued: the last message is the "
                             f"{final.get('role')}'s")
    text = final.get("content") or ""
    if not text.strip():
        raise InvalidRequest("the last (assistant) message to continue is empty: drop it, or give it the "
                             "text the answer should start with")
    for cut in (text, text.strip(), text.rstrip()):
        i = rendered.rfind(cut)
        if i >= 0:
            return rendered[:i + len(cut)]
    raise InvalidRequest("this model's chat template does not write the last assistant message as it was "
                         "given, so the answer cannot continue it; end with a user message instead")


class ClientGone(LocalrunError):
    """The HTTP client closed the connection before its (non-streamed) answer was ready."""

    status = 499
    code = "client_closed_request"


async def until_disconnected(request: Any, coro) -> Any:
    """Run `coro`, cancelling it when the HTTP client goes away: a non-streamed request, or a
    streamed one's start (queue, load, prefill: an IDE gives a stale completion up at the next
    keystroke); the work stops (the backend aborts the request) and the route ends with
    ClientGone, which nobody is left to read, instead of an exception escaping to the server.

    The client's going is the ASGI server's ``http.disconnect`` message, awaited (the route has
    read the body by then, so that is the next message): no polling. Starlette's
    ``is_disconnected()`` polled every 50 ms per waiting stream, each poll a cancel scope whose
    message formats the task's repr: 40% of the daemon's CPU with 8 streams on 2 cores, taken from
    llama.cpp's threads.

    On Python 3.11+ `coro` runs in the caller's own task, which the watcher cancels (and the
    cancel is taken back here): no task started for it, no turn of the event loop to hand its
    result back, on the path of every streamed request's first token."""
    if CANCEL_IN_TASK:
        async with disconnect_cancels(request.receive):
            return await coro
    task = asyncio.ensure_future(coro)
    gone = False

    async def watch():
        nonlocal gone
        while not task.done():
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:
            raise ClientGone("the client closed the connection") from None
        raise
    finally:
        watcher.cancel()


CANCEL_IN_TASK = hasattr(asyncio.Task, "uncancel")  # Python 3.11+


@asynccontextmanager
async def disconnect_cancels(receive: Callable[[], Awaitable[dict]]):
    """Inside the block, the client's going (the ASGI ``http.disconnect`` message, awaited by a watcher
    task) cancels this very task; leaving the block because of it raises ClientGone, the cancel taken
    back (``Task.uncancel``; Python 3.11+: CANCEL_IN_TASK). A cancel from elsewhere too (the server
    stopping) stays a cancel. The watcher runs only while this task waits inside the block, so its cancel
    lands there; once the block is left (``done``) it cancels nothing. Used by until_disconnected and by
    a streamed response's body (state.ClosingStreamingResponse): no task for the work itself, and no turn
    of the event loop to hand its result back."""
    task = asyncio.current_task()
    gone = done = False

    async def watch():
        nonlocal gone
        while not done:
            message = await receive()
            if message.get("type") == "http.disconnect":
                if not done:
                    gone = True
                    task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if gone and not task.uncancel():
            raise ClientGone("the client closed the connection") from None
        raise
    finally:
        done = True
        watcher.cancel()


__all__ = ["Job", "Delta", "ToolCalls", "Done", "Choice", "Generation", "GenerationService", "render_prompt",
           "until_disconnected", "disconnect_cancels", "ClientGone"]
