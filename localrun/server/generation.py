"""A started generation: its typed events, or its collected choices; then the lease goes back.

:meth:`GenerationService.start <localrun.server.generation_service.GenerationService.start>` hands
one back, its first chunk already in (or, with ``prime=False``, to be primed by the route). Its
events split what the model writes into reasoning, content and tool calls
(:mod:`localrun.server.output`), with a normalized finish reason and usage.

The lease is released exactly once: when the events end, when the consumer closes them,
or by :meth:`Generation.release` (idempotent) from whoever gives up first.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from localrun.backends.base import Chunk, GenerationRequest, Usage
from localrun.errors import InvalidRequest
from localrun.server import generic_tools, lenient_calls
from localrun.server.job import Delta, Done, Event, FinishedChoice, Job, ToolCalls
from localrun.server.loaded import Lease
from localrun.server.output import HarmonyParser, OutputParser, is_forced_call
from localrun.server.prompt import context_advice, uses_harmony
from localrun.server.tool_formats import learn as learn_tool_format

if TYPE_CHECKING:
    from localrun.server.generation_service import GenerationService


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
            raise context_advice(exc, self.job, self.lease) from None
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
                parser = HarmonyParser(names) if uses_harmony(self.job) \
                    else OutputParser(self.reasoning, names, tool_format=learn_tool_format(self.job.resolved.template)
                                      if self.job.tools and not generic else None, tools=self.job.tools, generic=generic,
                                      forced=bool(self.job.tools) and is_forced_call(self.job.options.json_schema),
                                      lenient=bool(self.job.tools) and lenient_calls.enabled())
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

    async def collect(self) -> list[FinishedChoice]:
        """Run every choice to its end; the non-streamed answer."""
        choices = [FinishedChoice(i) for i in range(len(self.requests))]
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



__all__ = ["Generation"]
