"""The batched loop's state: a slot (a sequence and its KV stream) and a request inside the loop.

A :class:`Slot` is one of the context's ``parallel`` sequences: the tokens its cells hold, and the request
using it (None: idle, its tokens a cached prefix). A :class:`Request` is one generation, from the caller's
options to the loop's bookkeeping of it (what it computed, what it waits to feed, what it emitted).
"""

from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localrun.backends.base import SamplingOptions, TokenLogprob
from localrun.stop_strings import StopScanner

if TYPE_CHECKING:
    from localrun.backends.llamacpp.images import ImageSpan


@dataclass(eq=False)
class Slot:
    """A sequence id, and with it one stream of the KV cache (``num_ctx`` cells): the tokens its
    cells hold (positions 0..n-1), the request using it (None: idle, its tokens a cached prefix)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    request: "Request | None" = None
    last_used: float = 0.0
    prompt_len: int = 0  # the length of the prompt it served last
    # prompt logprobs a scoring request computed over these cells: lps[p - 1] is position p's (the
    # logprob of tokens[p] after tokens[:p]), each with the alternatives that request asked for; a later
    # scored prompt that starts with the same tokens reuses them (lm-eval's choices of one question)
    lps: list[TokenLogprob] = field(default_factory=list)




@dataclass(eq=False)
class Request:
    """One generation inside the loop. Its chunks (and an exception, last, if it fails) go to
    ``queue`` (an asyncio.Queue) on ``loop``, or, with a ``sink``, to ``sink.put`` on the loop's own
    thread (then ``sink.outbox.flush()`` once a step: a runner process writes them to its pipe
    without waking its event loop per token); ``delivered`` is set once the consumer took the first."""

    prompt: list[int]
    options: SamplingOptions
    sampler: Any  # llama_sampler chain (owned: freed when the request ends)
    loop: Any
    queue: Any
    window: int  # the request's context window (num_ctx): prompt + output + drafts stay inside it
    grammar: Any = None  # its JSON grammar's llama_sampler, outside the chain (owned too)
    matcher: Any = None  # or its own regex / choices / grammar: an llguidance LLMatcher (structured.constraints.Matchers)
    speculative: int = 0  # draft tokens per step (0: off)
    rid: str = ""
    cancelled: bool = False
    delivered: threading.Event = field(default_factory=threading.Event)
    # loop state
    sid: int = -1
    n_cached: int = 0
    computed: int = 0  # tokens of this sequence in the KV cache
    pending: list[int] = field(default_factory=list)  # fed at the next step (prompt rest / last token)
    history: list[int] = field(default_factory=list)  # prompt + output (prompt lookup reads it)
    draft: list[int] = field(default_factory=list)
    n_out: int = 0
    limit: int = 0
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    finished: bool = False
    drafted: int = 0
    accepted: int = 0
    waited: bool = False  # counted once in shared_waits
    images: list[ImageSpan] = field(default_factory=list)  # in prompt order
    on_end: Any = None  # called once on the loop's thread when the request leaves it (frees its image chunks)
    preserved: frozenset = frozenset()  # special tokens whose text this request's output keeps
    cache_key: str | None = None  # the client's prompt_cache_key (see admission.Admission.start)
    argmax: bool = False  # plain greedy (plain_greedy): an argmax over its logits row, not the chain
    sink: Any = None  # instead of loop/queue: put(item) and outbox.flush() on the loop's thread
    # options.prompt_logprobs set: each prompt token's TokenLogprob, filled as its prefill runs (no
    # cached prefix: its logits are computed again), handed on with the first chunk; else None
    prompt_lps: list[TokenLogprob] | None = None
    disk: Any = None  # the prompt cache on disk: None (not looked), False (nothing to read), a disk_prefix.DiskRead

    def __post_init__(self) -> None:
        o = self.options
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stops = StopScanner(o.stop)
        self.stop_ids = set(o.stop_token_ids)
        room = self.window - len(self.prompt)
        self.limit = room if o.max_tokens is None else min(room, o.max_tokens)
        if o.prompt_logprobs is not None:
            self.prompt_lps = []


    def image_at(self) -> ImageSpan | None:
        """The image whose span starts where the prefill stands, if one does."""
        return next((img for img in self.images if img.start == self.computed), None)

    def text_ahead(self) -> int:
        """Prompt tokens it can feed before its next image (or the prompt's end)."""
        nxt = next((img.start for img in self.images if img.start >= self.computed), len(self.prompt))
        return nxt - self.computed

    def release(self, lib) -> None:
        """Its native resources go: its sampler chain, and (on_end) its image chunks."""
        if self.sampler:
            lib.llama_sampler_free(self.sampler)
            self.sampler = None
        if self.grammar:
            lib.llama_sampler_free(self.grammar)
            self.grammar = None
        self.matcher = None
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()
