"""What the engine keeps per request and hands back: the request record, its stream, its outputs.

A request arrives through `LLMEngine.add_request` (online, with a `RequestStream` the engine
thread pushes `StreamDelta`s into) or `LLMEngine.generate` (offline, ending in a
`GenerationOutput`); `new_request` checks it against the engine's limits and `check_group`
its group (n > 1).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localrun.engine.sampler import SamplingParams
from localrun.engine.scheduler import Sequence
from localrun.engine.tokenizer import Detokenizer, Tokenizer

if TYPE_CHECKING:
    from localrun.engine.engine import LLMEngine

MAX_GROUP = 128  # members of one group (the OpenAI API allows n up to 128)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # per token: (token_id, logprob, [(id, logprob), ...])
    first_token_time: float | None = None
    prompt_logprobs: list | None = None  # params.prompt_logprobs: per prompt token, as logprobs (the first's None)
    finish_time: float | None = None
    arrival_time: float = 0.0


@dataclass
class StreamDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list | None = None
    usage: dict | None = None  # on the last delta: prompt/completion/cached tokens and timings
    error: str | None = None
    error_kind: str | None = None  # "out_of_memory": the step ran out of memory (the engine goes on)
    stop_sequence: str | None = None  # on the last delta: the stop string that ended the request
    prompt_logprobs: list | None = None  # on the first delta when params.prompt_logprobs is set


@dataclass(eq=False)
class EngineRequest:
    """One request as the engine tracks it: its sequence, detokenizer, stream and what was sent."""

    seq: Sequence
    detok: Detokenizer | None
    stream: "RequestStream | None" = None
    text: str = ""  # text so far (stop strings cut it)
    sent: int = 0  # characters of `text` already streamed
    logprobs: list = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_ids: list[int] = field(default_factory=list)  # tokens not yet streamed
    pending_lp: list = field(default_factory=list)
    stop_sequence: str | None = None  # the stop string that ended it
    num_tokens: int = 0  # output tokens handled (the sequence may hold more, still in flight)
    group: tuple[str, int, int] | None = None  # (group id, size, index): n > 1 sharing one prefill
    prompt_sent: bool = False  # its prompt logprobs went out (on the first delta)


class RequestStream:
    """Async iterator of StreamDelta for one request; closing it early aborts the request."""

    def __init__(self, engine: "LLMEngine", request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def _push(self, delta: StreamDelta) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finish_reason is not None:
            self.done = True
        return delta

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


def new_request(prompt_ids: list[int], params: SamplingParams, request_id: str | None, *, limit: int, vocab: int,
                scores_prompts: bool, tokenizer: Tokenizer | None) -> EngineRequest:
    """A request for `prompt_ids`, checked: a prompt shorter than `limit` tokens (the context window, or
    the KV pool when smaller), token ids under `vocab`, a compiled grammar, prompt logprobs only where
    the engine `scores_prompts`. ValueError otherwise."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    n = len(prompt_ids)
    if n >= limit:
        raise ValueError(f"the prompt has {n} tokens but the context window holds {limit}; shorten it")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if params.grammar is not None and not hasattr(params.grammar, "matcher"):
        raise ValueError("SamplingParams.grammar must be a grammar from LLMEngine.compile_grammar()")
    if params.prompt_logprobs is not None and not scores_prompts:
        raise ValueError("prompt logprobs are not computed with speculative decoding or tensor parallelism")
    seq = Sequence(request_id or uuid.uuid4().hex, prompt_ids, params)
    detok = Detokenizer(tokenizer, prompt_ids, params.keep_special) if tokenizer else None
    return EngineRequest(seq, detok)


def generation_output(req: EngineRequest) -> GenerationOutput:
    """A finished request's result for `LLMEngine.generate`."""
    s = req.seq
    return GenerationOutput(
        token_ids=s.token_ids[s.prompt_len:s.prompt_len + req.num_tokens], text=req.text if req.detok else None,
        finish_reason=s.finish_reason or "abort", prompt_tokens=s.prompt_len, cached_tokens=max(s.cached_tokens, 0),
        completion_tokens=req.num_tokens,
        logprobs=req.logprobs if s.params.needs_logprobs else None, first_token_time=req.first_token_time,
        finish_time=req.finish_time, arrival_time=req.arrival_time, prompt_logprobs=s.prompt_lps)


def check_group(group) -> tuple[str, int, int] | None:
    """An add_request `group` as (group id, size, index), checked; None for none."""
    if group is None:
        return None
    try:
        gid, size, index = group
        gid, size, index = str(gid), int(size), int(index)
    except (TypeError, ValueError):
        raise ValueError("group must be (group id, size, index)") from None
    if not 1 <= size <= MAX_GROUP or not 0 <= index < size:
        raise ValueError(f"a group has 1 to {MAX_GROUP} members and each index is in [0, size); got size {size}, "
                         f"index {index}")
    return gid, size, index
