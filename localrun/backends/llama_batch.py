"""llama.cpp's batched loop: one context per model, continuous batching, cached prefixes.

One :class:`BatchedLlama` owns a model's single ``llama_context``: ``parallel`` sequences, each a
:class:`Slot` with a KV stream of its own (``num_ctx`` cells). One thread runs the loop; each step

1. admits waiting requests while fewer than ``parallel`` run: a request gets the slot whose
   cells hold the longest prefix of its prompt, cut back to that prefix (it takes an idle slot over,
   or, when that prefix is in a running slot or an idle one worth keeping, gets a copy of that
   slot's cells (:meth:`BatchedLlama._copy_stream`: a memcpy, far cheaper than computing the
   tokens again). A request whose prompt shares a longer prefix with a prompt still
   being prefilled waits for that prefill instead of computing the same tokens beside it;
2. builds one ``llama_batch``: every decoding sequence's next token (plus prompt-lookup drafts when
   speculative decoding is on), then prefill chunks of the others, first come first served, up to
   ``step_tokens`` tokens, so a long prompt never stalls the streams already running; laid out in
   slot order, as llama.cpp computes one forward pass per run of consecutive sequence ids;
3. calls ``llama_decode`` once (the GIL is released: the daemon's pipe keeps moving meanwhile);
4. samples each sequence that has an output row with its own sampler chain (logit bias,
   penalties, grammar, top-k/p, min-p, temperature, its own seeded RNG; plain greedy is an argmax
   over the logits row), handles stop tokens, stop strings and limits, and hands each request its
   chunk.

A finished or cancelled request's slot keeps its tokens: a later prompt that starts with them
reuses them (a chat's next turn, an agent's system prompt and tools, an editor's next keystroke).
Running sequences never run out of cells: each is bounded by its window (``num_ctx``).

Everything here runs on the loop's thread except :meth:`submit` / :meth:`cancel` (any thread).
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import logging
import math
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from localrun.backends.base import Chunk, SamplingOptions, TokenLogprob, Usage
from localrun.errors import BackendError, InvalidRequest
from localrun.stop_strings import StopScanner

log = logging.getLogger("localrun.llamacpp")

FIRST_CHUNK_WAIT = 0.05  # seconds the loop waits for a request's first chunk to reach its consumer (TTFT)
MIN_RECOMPUTE = 2  # prompt tokens evaluated even when all are cached (a batch of one differs: see _start)
SHARE_WAIT_TOKENS = 32  # a request waits for a running prefill when that would spare it this many tokens
MAX_NGRAM = 3  # prompt lookup: the longest n-gram matched
# prompt tokens a step computes for a request that wants their logprobs: each is an output row of
# n_vocab float logits in llama.cpp's output buffer, which grows to the largest batch's rows and stays
# that size, so the rows are also held under PROMPT_LOGPROBS_BYTES: 128 rows of a 49k vocabulary
# (25 MB), 55 of a 152k one, 32 of a 262k one (estimate_memory counts them)
PROMPT_LOGPROBS_CHUNK = 128
PROMPT_LOGPROBS_BYTES = 32 * 2**20


def prompt_logprobs_rows(n_vocab: int) -> int:
    """Prompt rows scored per step for a model with this vocabulary (see PROMPT_LOGPROBS_BYTES)."""
    return max(8, min(PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_BYTES // (max(n_vocab, 1) * 4)))


def token_piece(lib, vocab, token: int, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = lib.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:  # longer than the buffer
        buf = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[: max(n, 0)]


def pieces_text(lib, vocab, ids: list[int]) -> str:
    """The text of token ids, special tokens written out (ids already checked against the vocabulary)."""
    return b"".join(token_piece(lib, vocab, t, special=True) for t in ids).decode("utf-8", "replace")


def load_lora(lib, model, ctx, path: str, name: str):
    """A LoRA adapter (a GGUF) loaded for ``model`` and set on ``ctx`` at scale 1, as Ollama applies a Modelfile's
    ADAPTER; llama.cpp frees it with the model. An adapter whose tensors do not fit the model is a BackendError
    (llama.cpp returns no adapter; llama-cpp-python's Llama(lora_path=...) went on with the null pointer and
    crashed the process)."""
    adapter = lib.llama_adapter_lora_init(model, path.encode("utf-8"))
    if not adapter:
        raise BackendError(f"llama.cpp could not load the LoRA adapter of {name} ({path}; see the runner's log): "
                           "was it trained on this model? Its tensors must fit the model's")
    if lib.llama_set_adapters_lora(ctx, (lib.llama_adapter_lora_p_ctypes * 1)(adapter), 1,
                                   (ctypes.c_float * 1)(1.0)) != 0:
        raise BackendError(f"llama.cpp could not apply the LoRA adapter of {name} ({path})")
    return adapter


def longest_piece(lib, vocab, n_vocab: int) -> int:
    """The most bytes one token of the vocabulary stands for (BackendInfo.max_token_bytes). Every load asks
    this of every token: one buffer for all of them, and a piece longer than it counted by the size
    llama.cpp says it needs (-n), not written (SmolLM2's 49,152 tokens: 95 -> 55 ms)."""
    size = 256
    buf = ctypes.create_string_buffer(size)
    to_piece = lib.llama_token_to_piece
    longest = 0
    for t in range(n_vocab):
        n = abs(to_piece(vocab, t, buf, size, 0, True))
        if n > longest:
            longest = n
    return longest


def make_sampler(lib, vocab, n_vocab: int, o: SamplingOptions, window: int, grammar: str | None = None,
                 banned: Sequence[int] = ()):
    """(a llama.cpp sampler chain for one request, its grammar's sampler or None): the caller frees
    each with llama_sampler_free. The grammar stays out of the chain, as in llama-server: it checks
    the token the chain picks and masks the whole vocabulary only when it refuses that one
    (BatchedLlama._sample_constrained). `banned` tokens are never picked (ban_eog: the
    end-of-generation tokens, as llama-server's ignore_eos bans them). InvalidRequest when the grammar does not parse."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())

    def add(s) -> None:
        if not s:
            lib.llama_sampler_free(chain)
            raise BackendError("llama.cpp could not create a sampler")
        lib.llama_sampler_chain_add(chain, s)

    bias = {**{int(t): float(b) for t, b in (o.logit_bias or {}).items()}, **{int(t): -math.inf for t in banned}}
    if bias:
        items = [lib.llama_logit_bias(t, b) for t, b in bias.items()]
        add(lib.llama_sampler_init_logit_bias(n_vocab, len(items), (lib.llama_logit_bias * len(items))(*items)))
    last_n = window if o.repeat_last_n < 0 else o.repeat_last_n
    add(lib.llama_sampler_init_penalties(n_vocab, last_n, o.repeat_penalty, o.frequency_penalty, o.presence_penalty))
    if o.temperature <= 0:
        add(lib.llama_sampler_init_greedy())
    else:
        add(lib.llama_sampler_init_top_k(o.top_k))
        add(lib.llama_sampler_init_top_p(o.top_p, 1))
        add(lib.llama_sampler_init_min_p(o.min_p, 1))
        add(lib.llama_sampler_init_temp(o.temperature))
        add(lib.llama_sampler_init_dist(o.seed if o.seed is not None else random.getrandbits(31)))
    g = None
    if grammar is not None:
        g = lib.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
        if not g:
            lib.llama_sampler_free(chain)
            raise InvalidRequest("llama.cpp cannot parse the JSON schema's grammar")
    return chain, g


class _Candidates:
    """llama.cpp's candidate arrays (llama_token_data: id, logit, p) for a pick outside
    llama_sampler_sample: one over the whole vocabulary, one of a single token; reused for every
    pick (on the loop's thread)."""

    def __init__(self, lib, n_vocab: int) -> None:
        self.lib, self.n = lib, n_vocab
        self.arr = np.zeros(n_vocab, dtype=np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = self.arr.ctypes.data_as(ctypes.POINTER(lib.llama_token_data))
        self.all = lib.llama_token_data_array(self.data, n_vocab, -1, False)
        self.one = lib.llama_token_data(0, 0.0, 0.0)
        self.single = lib.llama_token_data_array(ctypes.pointer(self.one), 1, -1, False)

    def pick(self, logits: np.ndarray, chain, mask=None) -> int:
        """The token `chain` picks from `logits` (after `mask`, a grammar sampler, when given)."""
        a = self.all
        self.arr["id"], self.arr["logit"], self.arr["p"] = self.ids, logits, 0.0
        a.data, a.size, a.selected, a.sorted = self.data, self.n, -1, False  # (a sampler may repoint data)
        if mask is not None:
            self.lib.llama_sampler_apply(mask, ctypes.byref(a))
        self.lib.llama_sampler_apply(chain, ctypes.byref(a))
        return int(a.data[a.selected].id)

    def allows(self, grammar, tok: int) -> bool:
        """Whether `grammar` (a sampler) lets `tok` come next."""
        self.one.id, self.one.logit, self.one.p = tok, 1.0, 0.0
        self.single.size, self.single.selected, self.single.sorted = 1, -1, False
        self.lib.llama_sampler_apply(grammar, ctypes.byref(self.single))
        return self.one.logit != float("-inf")


def plain_greedy(o: SamplingOptions, grammar: str | None = None) -> bool:
    """Whether the sampler chain make_sampler builds from the same arguments picks the largest raw
    logit and nothing else: greedy, no logit bias, neutral penalties, no grammar. Such a request
    takes an argmax over its logits row instead (11 us against 76 us for the chain's pass over the
    49k-token vocabulary on SmolLM2, 0.5 ms of a 52 ms step at 8 streams on 2 cores); both pick the
    first largest logit."""
    return (o.temperature <= 0 and not o.logit_bias and o.repeat_penalty == 1.0 and o.presence_penalty == 0
            and o.frequency_penalty == 0 and grammar is None)


def lookup_draft(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding): the k tokens that followed the
    first earlier occurrence of the longest n-gram (n <= max_ngram) that ends ``tokens``."""
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.nonzero((windows == arr[-n:]).all(axis=1))[0]
        for start in hits + n:
            if start < len(arr):
                return arr[start:start + k].tolist()
    return []


@dataclass(eq=False)
class ImageSpan:
    """An image in a prompt: ``n`` positions from ``start``, whose prompt "tokens" are stand-ins
    derived from the image's hash (negative: never a vocabulary id), so the prefix cache shares an
    image's cells only with a prompt that holds the same image at the same place. ``chunk`` is
    llama.cpp's (mtmd) image chunk; ``embd`` its encoded embeddings once the encoder thread is done."""

    start: int
    n: int
    chunk: Any
    embd: Any = None
    error: BaseException | None = None
    encoding: bool = False

    @property
    def end(self) -> int:
        return self.start + self.n


def image_standins(digest: bytes, n: int) -> list[int]:
    """The prompt's stand-ins for an image of n positions (see ImageSpan)."""
    key = int.from_bytes(digest[:8], "little")
    return [-1 - ((key + i) % (2**31 - 2)) for i in range(n)]


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
    matcher: Any = None  # or its own regex / choices / grammar: an llguidance LLMatcher (constraints.Matchers)
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
    cache_key: str | None = None  # the client's prompt_cache_key (see _start)
    argmax: bool = False  # plain greedy (plain_greedy): an argmax over its logits row, not the chain
    sink: Any = None  # instead of loop/queue: put(item) and outbox.flush() on the loop's thread
    # options.prompt_logprobs set: each prompt token's TokenLogprob, filled as its prefill runs (no
    # cached prefix: its logits are computed again), handed on with the first chunk; else None
    prompt_lps: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        o = self.options
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stops = StopScanner(o.stop)
        self.stop_ids = set(o.stop_token_ids)
        room = self.window - len(self.prompt)
        self.limit = room if o.max_tokens is None else min(room, o.max_tokens)
        if o.prompt_logprobs is not None:
            self.prompt_lps = []


def omp_release():
    """A call that ends the calling thread's OpenMP team (libgomp's ``omp_pause_resource_all(omp_pause_soft)``),
    where llama.cpp computes on libgomp (its Linux builds); else None. After a parallel region libgomp's
    workers spin about 300,000 turns for the next one (~10 ms on a Xeon) before they sleep: right for a
    stream of decode steps, but after a prompt's first token, while the daemon and the HTTP client take
    it on, that spinning thread held one of the box's CPUs away from them (2 vCPUs: the daemon's write
    of a first token to the client's read of it took 0.5 ms, median, and 4-5 ms in one request of ten;
    0.25 ms and under 1 ms with the team ended). The next llama_decode starts the team again (a thread
    start per worker). Not when the loop runs out of work: Linux starts a new thread on its parent's CPU,
    and after an idle spell the next prompt's prefill ran both threads on one CPU until the kernel moved
    one (2 AMD vCPUs: an 18-token prefill +8 ms, median); a team kept sleeps once its spin is done, and
    its worker wakes on its own CPU."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:  # only the libgomp already loaded (by llama.cpp's CPU library), never a second one
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        fn = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return functools.partial(fn, 1)  # omp_pause_soft


class BatchedLlama:
    """The loop (see the module docstring). ``lib`` is ``llama_cpp.llama_cpp``; model and context
    are created by the caller and owned here from then on (:meth:`close` frees them)."""

    def __init__(self, lib, model, ctx, *, parallel: int, step_tokens: int, share_prefixes: bool = True,
                 name: str = "", encode=None, decode_image=None, governor=None, copy_cells: bool = False) -> None:
        self.lib, self.model, self.ctx = lib, model, ctx
        self.copy_cells = copy_cells  # a prefix is copied cell by cell, not as a whole stream: see _copy_stream
        # a ThreadGovernor (localrun.backends.cpu_share): fewer compute threads while other processes
        # take the CPUs (polled once a step, here on the loop's thread, the one that calls llama_decode)
        self.governor = governor
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        # on the loop's thread only (its team is llama.cpp's), and where llama.cpp's threads take every CPU this
        # process may use: with a CPU to spare the daemon and the client run there, and a team started again
        # after each request's first token would cost the streams running beside it a thread start per worker
        from localrun.backends.cpu_share import usable_cpus

        n_cpus = len(usable_cpus() or range(os.cpu_count() or 1))
        self._release_threads = omp_release() if lib.llama_n_threads(ctx) >= n_cpus else None
        self.score_rows = prompt_logprobs_rows(self.n_vocab)
        self.mem = lib.llama_get_memory(ctx)
        self.n_cells = int(lib.llama_n_ctx(ctx))
        self.parallel = parallel
        self.step_tokens = max(step_tokens, parallel * 2)
        self.share_prefixes = share_prefixes
        self.name = name
        # images (a vision projector is loaded): encode(span) -> embeddings runs on a thread of its own
        # (a running stream never waits for another request's image to encode);
        # decode_image(span, seq, pos) puts them in the KV cache on the loop's thread
        self._encode, self._decode_image = encode, decode_image
        self._encoder = None
        if encode is not None:  # each encode on a thread that then exits (its OpenMP team with it: fresh_threads.py)
            from localrun.backends.fresh_threads import FreshThreadExecutor

            self._encoder = FreshThreadExecutor(f"llama-image-{name}")
        self.slots = [Slot(i) for i in range(parallel)]
        self._keyed: dict[str, int] = {}  # cache key -> the slot its last request used (at most one key a slot)
        self._waiting: list[Request] = []
        self._running: list[Request] = []  # admission order
        self._inbox: deque[Request] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self.fatal: str | None = None
        self.counters = dict(steps=0, prompt_tokens=0, cached_tokens=0, prefill_tokens=0, decode_tokens=0,
                             copied_prefixes=0, shared_waits=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                             spec_steps=0, image_tokens=0, moved_sequences=0,
                             handed_over_prefixes=0, grammar_resamples=0, copied_cells=0, copied_streams=0,
                             prefill_seconds=0.0, decode_seconds=0.0)
        self._candidates: _Candidates | None = None  # _sample_constrained's arrays, made on first use
        self._mask: np.ndarray | None = None  # _sample_matched's bitmask of the vocabulary (int32 words)
        self._logits_view: tuple | None = None  # ((address, rows), array): _logits's view of llama.cpp's buffer
        # per-token facts asked of llama.cpp once: every ctypes call lets go of the GIL, and the
        # runner's event loop (handing the last step's chunks on) takes it each time
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_ids: np.ndarray | None = None
        self._outbox: list[tuple[Request, Any]] = []
        self._alloc_batch(self.step_tokens)
        self._thread = threading.Thread(target=self._run, name=f"llama-batch-{name}", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread) ------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self._cv:
            if self._closing:
                raise BackendError("the model is being unloaded")
            if self.fatal:
                raise BackendError(self.fatal)
            self._inbox.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """The consumer is gone: the request ends at the next step boundary (its sequence stays
        cached). Also wakes a first-chunk wait."""
        req.cancelled = True
        req.delivered.set()
        with self._cv:
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._encoder is not None:
            self._encoder.shutdown(wait=True, cancel_futures=True)
        gone = BackendError("the model was unloaded while this request ran")
        for r in [*self._running, *self._waiting, *self._inbox]:
            self._finish_error(r, gone)
        self._flush()
        self._running, self._waiting = [], []
        self._inbox.clear()
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def stats(self) -> dict[str, Any]:
        c = self.counters
        spec = c["spec_steps"]
        return {**c, "cells": self.n_cells, "cells_used": sum(len(sl.tokens) for sl in self.slots),
                "running": len(self._running), "waiting": len(self._waiting) + len(self._inbox),
                "idle_sequences": sum(1 for sl in self.slots if sl.request is None and sl.tokens),
                "parallel": self.parallel,
                "threads": self.governor.current if self.governor else None,
                "thread_changes": self.governor.changes if self.governor else 0,
                # the names the native engine reports the same things under
                "prefix_query_tokens": c["prompt_tokens"], "prefix_hit_tokens": c["cached_tokens"],
                "spec_acceptance_rate": c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c["spec_draft_tokens"] else 0.0,
                "spec_tokens_per_row_step": (spec + c["spec_accepted_tokens"]) / spec if spec else 0.0}

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not (self._running or self._waiting):
                    if self.governor is not None:
                        self.governor.idle()  # until the next step, other programs' load is none of its business
                with self._cv:
                    while not (self._closing or self._inbox or self._running or self._waiting):
                        self._cv.wait()
                    if self._closing:
                        return
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                self._reap()
                self._admit()
                self._compact()
                if self._running:
                    worked = self._step()
                    for r in [r for r in self._running if r.finished]:  # e.g. an image that failed to encode
                        self._end(r)
                    self._flush()
                    # after the step, its chunks handed on: a spell's first poll reads /proc (~0.3 ms with
                    # the caches cold after an idle spell), which before the step delayed each prefill
                    if self.governor is not None and (n := self.governor.poll()) is not None:
                        self.lib.llama_set_n_threads(self.ctx, n, n)
                        log.info("%s: llama.cpp computes with %d of %d threads now (other processes use %.1f "
                                 "CPUs)", self.name, n, self.governor.n_max, self.governor.others)
                    if not worked:  # every running request waits for its image to encode
                        with self._cv:
                            self._cv.wait(0.05)
                elif self._waiting:  # nothing could start (cannot happen; do not spin)
                    time.sleep(0.001)
        except Exception as exc:  # a bug or a native failure: every request gets the error
            log.exception("llama.cpp loop of %s failed", self.name)
            self.fatal = f"llama.cpp's loop failed: {type(exc).__name__}: {exc}"
            err = BackendError(self.fatal)
            for r in [*self._running, *self._waiting]:
                self._finish_error(r, err)
            self._running, self._waiting = [], []
            self._flush()

    def _reap(self) -> None:
        """Requests whose consumer left end here: their sequences become idle cache entries."""
        if any(r.cancelled for r in self._waiting):
            for r in [r for r in self._waiting if r.cancelled]:
                self._free_sampler(r)
            self._waiting = [r for r in self._waiting if not r.cancelled]
        for r in [r for r in self._running if r.cancelled]:
            self._end(r)

    def _admit(self) -> None:
        i = 0
        while i < len(self._waiting) and len(self._running) < self.parallel:
            r = self._waiting[i]
            if self._wait_for_shared_prefill(r):
                i += 1
                continue
            del self._waiting[i]
            self._start(r)

    def _compact(self) -> None:
        """Keep the running sequences in consecutive slots. With one KV stream per sequence llama.cpp
        computes a step as one forward pass per run of consecutive sequence ids, so streams in slots 0
        and 2 cost two passes a step where slots 0 and 1 cost one. A sequence outside the window of
        slots that holds most running ones moves into a free slot inside it: its cells are copied
        (``_copy_stream``, a memcpy, cheaper than the pass it saves on every step after),
        and the slot it leaves keeps the tokens as an idle cached prefix (a slot that another
        ``prompt_cache_key`` last used is not taken)."""
        if not self.share_prefixes or len(self._running) < 2:
            return  # (recurrent state is no KV stream: no runs to keep together)
        ids = {r.sid for r in self._running}
        k = len(ids)
        if max(ids) - min(ids) == k - 1:
            return
        start = max(range(self.parallel - k + 1), key=lambda a: (len(ids.intersection(range(a, a + k))), -a))
        free = [i for i in range(start, start + k) if i not in ids]
        key_of = {sid: key for key, sid in self._keyed.items()}  # a slot another key last used stays its
        for r in sorted((r for r in self._running if not start <= r.sid < start + k), key=lambda r: r.sid):
            dst = next((i for i in free if key_of.get(i) in (None, r.cache_key)), None)
            if dst is not None:
                free.remove(dst)
                self._move(r, self.slots[dst])

    def _move(self, r: Request, dst: Slot) -> None:
        src = self.slots[r.sid]
        self._copy_stream(src, dst)
        dst.tokens, dst.prompt_len, dst.lps = list(src.tokens), src.prompt_len, list(src.lps)
        dst.request, dst.last_used = r, src.last_used
        src.request, src.last_used = None, time.monotonic()
        self._keys_follow(src, dst)  # dst's cells are r's now
        r.sid = dst.id
        self.counters["moved_sequences"] += 1

    def _copy_stream(self, src: Slot, dst: Slot) -> None:
        """dst's cells become a copy of src's (dst's own are dropped). llama_memory_seq_cp copies a
        stream whole, every one of its num_ctx cells whatever src holds: on SmolLM2 +2.5 ms at 2,048
        cells and +12 ms at 8,192 (its KV is 23 KB a token; a 7B model's is 5-6 times that), paid
        by the next llama_decode. With the KV cache in host memory, saving src's sequence and
        loading it into dst moves only the cells in use (137 cells: +0.5 ms, the same logits); on
        a GPU the stream copy stays on the device. Past half a stream the whole copy is cheaper.
        Not for a model with a sliding window (Gemma 3): its windowed cache, restored that way,
        answered differently from a fresh evaluation, where the whole copy answers the same."""
        lib, used = self.lib, len(src.tokens)
        if self.copy_cells and 0 < 2 * used <= self.n_cells // self.parallel:
            size = lib.llama_state_seq_get_size_ext(self.ctx, src.id, 0)
            buf = np.empty(max(size, 1), dtype=np.uint8)  # (not zeroed: written whole below)
            ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            written = lib.llama_state_seq_get_data_ext(self.ctx, ptr, size, src.id, 0)
            if written and lib.llama_state_seq_set_data_ext(self.ctx, ptr, written, dst.id, 0):
                self.counters["copied_cells"] += used
                return
            log.warning("%s: llama.cpp could not move sequence %d's cells to %d; copying the stream whole",
                        self.name, src.id, dst.id)
        lib.llama_memory_seq_cp(self.mem, src.id, dst.id, -1, -1)  # dst's cells are cleared first
        self.counters["copied_streams"] += 1

    def _runs_with(self, sid: int) -> int:
        """Runs of consecutive slots (forward passes a step) if a sequence in `sid` joined the running ones."""
        ids = sorted({r.sid for r in self._running} | {sid})
        return 1 + sum(b - a > 1 for a, b in zip(ids, ids[1:]))

    def _hand_over(self, src: Slot, dst: Slot) -> None:
        """dst (just given a copy of src's stream) becomes the idle cached prefix src was: its prompt
        length, age and prompt_cache_key move with it."""
        dst.prompt_len, dst.last_used = src.prompt_len, src.last_used
        self._keys_follow(src, dst)
        self.counters["handed_over_prefixes"] += 1

    def _keys_follow(self, src: Slot, dst: Slot) -> None:
        """src's cells were copied to dst: the prompt_cache_key that last used src now names dst, and
        dst's old key goes (its cells are overwritten)."""
        for key, sid in list(self._keyed.items()):
            if sid == dst.id:
                del self._keyed[key]
            elif sid == src.id:
                self._keyed[key] = dst.id

    def _wait_for_shared_prefill(self, r: Request) -> bool:
        """True when a running prefill will soon hold more of r's prompt than the cache does now:
        r waits for it and shares it, instead of computing the same tokens alongside."""
        if not self.share_prefixes:
            return False
        have = max(self._reusable(sl, r, r.prompt) for sl in self.slots)
        want = r.options.prompt_logprobs
        for s in self._running:
            if s.computed >= len(s.prompt):
                continue
            if want is not None and (s.prompt_lps is None or (s.options.prompt_logprobs or 0) < want):
                continue  # a scored prompt shares only a prefill that scores it too
            k = _common(s.prompt, r.prompt)
            if k - have >= SHARE_WAIT_TOKENS and s.computed < k:
                if not r.waited:
                    r.waited = True
                    self.counters["shared_waits"] += 1
                return True
        return False

    def _start(self, r: Request) -> None:
        """Give r a slot holding the longest prefix of its prompt the cache has."""
        # At least MIN_RECOMPUTE prompt tokens are evaluated even when the cache holds all of them:
        # llama.cpp computes a batch of one token with other kernels than a longer batch, so a
        # prompt evaluated from its last token alone gets slightly different logits (and a greedy
        # answer that depends on what ran before); batches of two or more agree exactly.
        usable = r.prompt[:max(0, len(r.prompt) - MIN_RECOMPUTE)] if self.share_prefixes else []
        # a cache key (prompt_cache_key): on a tie the slot the key last used wins, and a new slot is
        # taken from those no other key last used while there are such (keyless: nothing changes)
        mine = self._keyed.get(r.cache_key) if r.cache_key else None
        owned = {sid for key, sid in self._keyed.items() if key != r.cache_key} if self._keyed else set()
        n, src = 0, None
        for sl in self.slots:
            k = self._reusable(sl, r, usable)
            for img in r.images:  # an image's cells are reused whole or not at all
                if img.start < k < img.end:
                    k = img.start
            if k > n or (k == n and k and src is not None and src.id != mine
                         and ((src.request is not None and sl.request is None) or sl.id == mine)):
                n, src = k, sl
        free = [sl for sl in self.slots if sl.request is None]
        spare = [sl for sl in free if sl is not src]
        if owned and src is not None and src.id not in owned and not [sl for sl in spare if sl.id not in owned]:
            spare = []  # every other free slot holds another key's prefix: r takes src over (if idle)
        if src is not None and src.request is None and (n + MIN_RECOMPUTE >= src.prompt_len or not spare):
            # r covers the whole prompt src last served (the same prompt again, a chat's next turn, an
            # editor's next keystroke), or nothing else is free: r takes src over, cut back to the
            # shared prefix. Its new tokens land where a fresh evaluation puts them, so the same
            # greedy request gets the same answer.
            dst = src
        else:
            # a free slot: one another key last used only when there is no other; then one next to the
            # running ones (see _compact); then an empty one, else the least recently used. src (running,
            # or idle with more of its own prompt than r shares) keeps what it holds; r gets a copy of it
            near = {q.sid + d for q in self._running for d in (-1, 1)}  # empty while nothing runs: no preference
            dst = min(spare or free, key=lambda sl: (sl.id in owned, bool(near) and sl.id not in near, bool(sl.tokens),
                                                     sl.last_used))
            if n:
                self._copy_stream(src, dst)
                dst.tokens, dst.lps = list(src.tokens), list(src.lps)  # cut back below
                self.counters["copied_prefixes"] += 1
                if src.request is None and self._runs_with(src.id) < self._runs_with(dst.id):
                    # r in src (idle) leaves fewer runs of running slots than r in dst (src fills a gap):
                    # src's prefix lives on in dst and r runs in src. The same one copy, and no gap left
                    # for _compact to close with a second one
                    self._hand_over(src, dst)
                    dst = src
        if r.prompt_lps is not None:  # position 0's (none), then the cached positions' as scored before
            want = r.options.prompt_logprobs or 0
            r.prompt_lps = [TokenLogprob(token=self._prompt_text(r.prompt[0]), logprob=None)] + [
                x if len(x.top) <= want else TokenLogprob(x.token, x.logprob, x.top[:want], x.raw,
                                                          x.top_raw[:want] if x.top_raw else None)
                for x in dst.lps[:n]]
        self._truncate(dst, n)
        if self._keyed or r.cache_key:  # the slot's cells are r's now: its key's, no other's
            for key in [key for key, sid in self._keyed.items() if sid == dst.id]:
                del self._keyed[key]
            if r.cache_key:
                self._keyed[r.cache_key] = dst.id
        dst.request, dst.last_used = r, time.monotonic()
        r.sid, r.n_cached, r.computed = dst.id, n, n
        r.pending = r.prompt[n:]
        r.history = list(r.prompt)
        self._running.append(r)
        self.counters["prompt_tokens"] += len(r.prompt)
        self.counters["cached_tokens"] += n

    def _reusable(self, sl: Slot, r: Request, usable: list[int]) -> int:
        """Cells of sl that r can start from: the prefix it shares with `usable`; for a scored prompt,
        only positions whose logprobs sl holds (with enough alternatives), and never the last shared one
        (its row scores the token after it, which is r's own)."""
        k = _common(sl.tokens, usable)
        if r.prompt_lps is not None:
            enough = sl.lps and len(sl.lps[0].top) >= (r.options.prompt_logprobs or 0)  # (all have as many)
            k = max(0, min(k - 1, len(sl.lps) if enough else 0))
        return k

    def _truncate(self, slot: Slot, keep: int) -> None:
        """The slot keeps its first ``keep`` cells (llama_memory_seq_rm)."""
        if keep < len(slot.tokens) or keep == 0:
            self.lib.llama_memory_seq_rm(self.mem, slot.id, keep, -1)
            del slot.tokens[keep:]
            del slot.lps[max(0, keep - 1):]

    # -- one step -----------------------------------------------------------------------------------
    def _step(self) -> bool:
        """One step; False when nothing could run (the prefilling requests wait for image encodes)."""
        rows: list[tuple[Request, list[int], bool]] = []  # (request, tokens fed, decoding)
        for r in self._running:
            if r.computed >= len(r.prompt) and r.pending:  # decoding: its last token (+ drafts)
                r.draft = self._draft(r) if r.speculative else []
                rows.append((r, r.pending + r.draft, True))
        # prefill chunks get step_tokens beside the decode tokens (the context's n_batch has room for
        # both): a chunk cut short by the decode tokens (two 256-token prompts as 256 + 250) made
        # llama.cpp's equal split compute the longer one's last tokens in a pass of their own
        budget = self.step_tokens
        prefills = [r for r in self._running if r.computed < len(r.prompt) and self._text_ready(r)]
        for r in prefills:
            if budget <= 0:
                break
            chunk = r.pending[:min(budget, self._text_ahead(r),
                                   self.score_rows if r.prompt_lps is not None else budget)]
            rows.append((r, chunk, False))
            budget -= len(chunk)
        if not rows:
            return bool(prefills)
        # in slot order: with one KV stream per sequence, llama.cpp cuts a batch into one ubatch per run
        # of consecutive sequence ids in batch order (split_equal, sequential), each a whole forward
        # pass; in arrival order 8 streams took 2-3 passes a step (measured 67 ms against 56 ms)
        rows.sort(key=lambda row: row[0].sid)
        outs, n_out = self._fill(rows)
        t0 = time.perf_counter()
        ret = self.lib.llama_decode(self.ctx, self._batch)
        # compute time by step kind: a step with any prompt tokens is a prefill step (/metrics; bench overhead
        # takes a request's prefill out of its TTFT with it)
        kind = "decode_seconds" if all(decoding for _, _, decoding in rows) else "prefill_seconds"
        self.counters[kind] += time.perf_counter() - t0
        if ret != 0:
            self._decode_failed(ret, rows)
            return True
        self.counters["steps"] += 1
        self._after(rows, outs, n_out)
        return True

    # -- images ---------------------------------------------------------------------------------------
    def _image_at(self, r: Request) -> ImageSpan | None:
        return next((img for img in r.images if img.start == r.computed), None)

    def _text_ahead(self, r: Request) -> int:
        """Prompt tokens r can feed before its next image (or the prompt's end)."""
        nxt = next((img.start for img in r.images if img.start >= r.computed), len(r.prompt))
        return nxt - r.computed

    def _text_ready(self, r: Request) -> bool:
        """Whether r's prefill goes on with text now: an image due next is put in the cache first
        (once encoded: its encode is started here, on the encoder thread, if it is not yet)."""
        while (img := self._image_at(r)) is not None:
            if img.error is not None:
                self._finish_error(r, img.error)
                return False
            if img.embd is None:
                if not img.encoding:
                    img.encoding = True
                    self._encoder.submit(self._encode_one, img)
                return False
            try:
                self._decode_image(img, r.sid, r.computed)
            except Exception as exc:  # noqa: BLE001 - this request fails, the loop goes on
                self._truncate(self.slots[r.sid], r.computed)  # whatever part of it got in
                self._finish_error(r, exc if isinstance(exc, (InvalidRequest, BackendError)) else
                                   BackendError(f"llama.cpp could not decode an image: {exc}"))
                return False
            img.embd = None  # only the cells keep it
            self.slots[r.sid].tokens += r.prompt[img.start:img.end]
            r.computed += img.n
            r.pending = r.pending[img.n:]
            self.counters["image_tokens"] += img.n
        return r.computed < len(r.prompt)

    def _encode_one(self, img: ImageSpan) -> None:
        try:
            img.embd = self._encode(img)
        except BaseException as exc:  # noqa: BLE001 - the request gets it
            img.error = exc if isinstance(exc, (InvalidRequest, BackendError)) else \
                BackendError(f"llama.cpp could not encode an image: {exc}")
        with self._cv:
            self._cv.notify()

    def _draft(self, r: Request) -> list[int]:
        k = min(r.speculative, r.limit - r.n_out - 1, r.window - r.computed - 2)
        if k <= 0 or r.grammar or r.matcher is not None:
            return []
        draft = lookup_draft(r.history, k)
        cut = next((i for i, t in enumerate(draft) if t < 0), len(draft))  # an image's stand-ins are no tokens
        return draft[:cut]

    def _alloc_batch(self, n: int) -> None:
        lib = self.lib
        self._cap = n
        self._tok = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._out = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n)])
        b = lib.llama_batch()
        b.token = self._tok.ctypes.data_as(i32p)
        b.embd = None
        b.pos = self._pos.ctypes.data_as(i32p)
        b.n_seq_id = self._nseq.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs, type(b.seq_id))
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    def _logits(self, rows: int) -> np.ndarray:
        """The step's first `rows` output rows of logits, a view of llama.cpp's buffer. The view is kept
        while the buffer's address and the row count stay (every decode step: one row): numpy's
        ctypeslib.as_array makes ctypes types each call, ~0.2 ms on the first token after an idle spell."""
        addr = ctypes.cast(self.lib.llama_get_logits(self.ctx), ctypes.c_void_p).value
        if self._logits_view is None or self._logits_view[0] != (addr, rows):
            buf = (ctypes.c_float * (rows * self.n_vocab)).from_address(addr)
            self._logits_view = ((addr, rows), np.frombuffer(buf, dtype=np.float32).reshape(rows, self.n_vocab))
        return self._logits_view[1]

    def _fill(self, rows: list[tuple[Request, list[int], bool]]) -> tuple[list[int], int]:
        """The batch of `rows`; returns each row's first output row (its logits' index, counted here in
        Python) and the step's number of output rows."""
        n = sum(len(t) for _, t, _ in rows)
        if n > self._cap:
            self._alloc_batch(n)
        i = 0
        outs: list[int] = []
        n_out = 0
        for r, toks, decoding in rows:
            k = len(toks)
            self._tok[i:i + k] = toks
            self._pos[i:i + k] = np.arange(r.computed, r.computed + k, dtype=np.int32)
            self._seq[i:i + k] = r.sid
            # logits for every token a decoding sequence feeds (its drafts are checked), every prompt
            # token of a request for their logprobs, and a prompt's last token
            every = decoding or r.prompt_lps is not None
            self._out[i:i + k] = 1 if every else 0
            outs.append(n_out)
            if every:
                n_out += k
            elif r.computed + k == len(r.prompt):
                self._out[i + k - 1] = 1
                n_out += 1
            i += k
        self._batch.n_tokens = n
        return outs, n_out

    def _decode_failed(self, ret: int, rows) -> None:
        """The step's requests end with the error; what the step wrote for them is dropped."""
        what = {1: "no room in the KV cache", 2: "the computation was aborted", -1: "an invalid batch"}.get(
            ret, "a compute error")
        err = BackendError(f"llama.cpp could not decode ({what}, code {ret}); the request was ended")
        for r in {id(r): r for r, _, _ in rows}.values():
            self._finish_error(r, err)
            self._running.remove(r)
            slot = self.slots[r.sid]
            slot.request = None
            self._truncate(slot, 0)
            self._free_sampler(r)
        if ret < -1:
            self.fatal = f"llama.cpp reported a compute error (code {ret})"

    def _after(self, rows, outs: list[int], n_out: int) -> None:
        lib, ctx = self.lib, self.ctx
        firsts: list[Request] = []
        logits = None
        if n_out and any(r.argmax or (r.prompt_lps is not None and not decoding) for r, _, decoding in rows):
            logits = self._logits(n_out)  # the step's output rows, in batch order
        i = 0
        for (r, toks, decoding), o0 in zip(rows, outs):  # o0: the row's first output row
            k = len(toks)
            first_row = i
            i += k
            self.slots[r.sid].tokens += toks
            if not decoding and r.prompt_lps is not None:
                self._score_prompt(r, r.computed, logits[o0:o0 + k])
            r.computed += k
            if not decoding:
                r.pending = r.pending[k:]
                self.counters["prefill_tokens"] += k
                if r.computed < len(r.prompt):
                    continue
                if r.limit <= 0:  # max_tokens 0: the prompt scored, nothing generated
                    self._emit(r, [])
                    continue
            sampled: list[tuple[int, TokenLogprob | None]] = []
            for row in range(first_row + k - 1 if not decoding else first_row, first_row + k):
                if r.argmax:
                    # (a prompt without prompt logprobs has one output row: its last token's)
                    out = logits[o0 + row - first_row if decoding or r.prompt_lps is not None else o0]
                    if r.options.ban_eog:
                        out[self.eog_ids()] = -np.inf  # (the chain's logit bias bans them for the other paths)
                    tok = int(out.argmax())
                elif r.grammar:
                    tok = self._sample_constrained(r, row)
                elif r.matcher is not None:
                    tok = self._sample_matched(r, row)
                    if tok is None:  # past llguidance's bounds: r has its error
                        sampled = None
                        break
                else:
                    tok = lib.llama_sampler_sample(r.sampler, ctx, row)
                sampled.append((tok, self._logprob(row, tok, r.options.top_logprobs) if r.options.logprobs else None))
                j = len(sampled) - 1  # the draft token this one is checked against
                if not (decoding and j < len(r.draft) and tok == r.draft[j]):
                    break
            if sampled is None:
                continue
            if decoding:
                self.counters["decode_tokens"] += len(sampled)
            if r.draft:
                keep = r.computed - k + len(sampled)  # the fed tokens whose successors were accepted
                self.counters["spec_draft_tokens"] += len(r.draft)
                self.counters["spec_accepted_tokens"] += len(sampled) - 1
                self.counters["spec_steps"] += 1
                r.drafted += len(r.draft)
                r.accepted += len(sampled) - 1
                if keep < r.computed:
                    self._truncate(self.slots[r.sid], keep)
                    r.computed = keep
                r.draft = []
            first = r.t_first is None
            self._emit(r, sampled)
            if first and not r.finished:
                firsts.append(r)
        for r in [r for r in self._running if r.finished]:
            self._end(r)
        if firsts:  # let the consumers hand on their first tokens before the next decode takes the CPU
            if self._release_threads is not None:  # nor a spinning OpenMP worker (before the write that wakes them)
                self._release_threads()
            self._flush()
            deadline = time.monotonic() + FIRST_CHUNK_WAIT
            for r in firsts:
                r.delivered.wait(max(0.0, deadline - time.monotonic()))

    def _emit(self, r: Request, sampled: list[tuple[int, TokenLogprob | None]]) -> None:
        """Feed sampled tokens through r's stop handling and hand on what they give as one chunk."""
        o = r.options
        now = time.perf_counter()
        first = r.t_first is None
        if first:
            r.t_first = now
        text_parts: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        finish = None
        for tok, lp in sampled:
            if not o.ignore_eos and (self._is_eog(tok) or tok in r.stop_ids):
                finish = "stop"
                text_parts.append(r.decoder.decode(b"", final=True) + r.stops.flush())
                break
            r.n_out += 1
            r.history.append(tok)
            ids.append(tok)
            if lp is not None:
                lps.append(lp)
            text, hit = r.stops.feed(r.decoder.decode(self.piece(tok, tok in r.preserved)))
            text_parts.append(text)
            if hit:
                finish = "stop"
                break
            if r.n_out >= r.limit:
                finish = "length"
                text_parts.append(r.decoder.decode(b"", final=True) + r.stops.flush())
                break
        if not sampled:  # max_tokens 0
            finish = "length"
        elif finish is None:
            r.pending = [sampled[-1][0]]
        chunk = Chunk(text="".join(text_parts), token_ids=ids, logprobs=lps or None,
                      prompt_logprobs=r.prompt_lps if first else None)
        if finish is not None:
            r.finished = True
            chunk.finish_reason, chunk.stop_sequence = finish, r.stops.matched
            chunk.usage = Usage(prompt_tokens=len(r.prompt), completion_tokens=r.n_out, cached_tokens=r.n_cached,
                                prompt_eval_seconds=r.t_first - r.t0, eval_seconds=now - r.t_first)
        if chunk.text or chunk.token_ids or chunk.finish_reason or chunk.prompt_logprobs is not None:
            self._outbox.append((r, chunk))

    def _end(self, r: Request) -> None:
        """r leaves the loop; its slot keeps r's tokens for a later prompt that starts with them."""
        self._running.remove(r)
        self._free_sampler(r)
        slot = self.slots[r.sid]
        slot.request, slot.last_used, slot.prompt_len = None, time.monotonic(), len(r.prompt)
        if not self.share_prefixes:
            self._truncate(slot, 0)

    def _finish_error(self, r: Request, exc: BaseException) -> None:
        r.finished = True
        self._free_sampler(r)
        if not r.cancelled:
            self._outbox.append((r, exc))

    def _flush(self) -> None:
        """Hand this step's chunks to their consumers: one wake-up per event loop, not per chunk
        (a sink's: one write per outbox)."""
        if not self._outbox:
            return
        by_loop: dict[Any, list[tuple[Request, Any]]] = {}
        outboxes: dict[int, Any] = {}
        for r, item in self._outbox:
            if r.sink is not None:
                r.sink.put(item)
                outboxes[id(r.sink.outbox)] = r.sink.outbox
            else:
                by_loop.setdefault(r.loop, []).append((r, item))
        self._outbox = []
        for outbox in outboxes.values():
            outbox.flush()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop has closed: nobody is waiting for these
                pass

    def _free_sampler(self, r: Request) -> None:
        """r's native resources go: its sampler chain, and (on_end) its image chunks."""
        if r.sampler:
            self.lib.llama_sampler_free(r.sampler)
            r.sampler = None
        if r.grammar:
            self.lib.llama_sampler_free(r.grammar)
            r.grammar = None
        r.matcher = None
        if r.on_end is not None:
            on_end, r.on_end = r.on_end, None
            on_end()

    def eog_ids(self) -> np.ndarray:
        """The vocabulary's end-of-generation tokens (llama_vocab_is_eog), found once (~10 ms for 50k tokens)."""
        if self._eog_ids is None:
            self._eog_ids = np.array([t for t in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, t)],
                                     dtype=np.int64)
        return self._eog_ids

    def _is_eog(self, tok: int) -> bool:
        e = self._eog.get(tok)
        if e is None:
            e = self._eog[tok] = bool(self.lib.llama_vocab_is_eog(self.vocab, tok))
        return e

    def piece(self, tok: int, special: bool = False) -> bytes:
        """A token's bytes (any thread: the cache is a dict, filled once per token)."""
        if special:  # a preserved special token: its text, not the empty piece
            return token_piece(self.lib, self.vocab, tok, special=True)
        p = self._pieces.get(tok)
        if p is None:
            p = self._pieces[tok] = token_piece(self.lib, self.vocab, tok)
        return p

    def _sample_constrained(self, r: Request, row: int) -> int:
        """A token for r (which has a grammar) at a batch row, as llama-server's common_sampler_sample
        picks it: the chain picks from the row's logits; the grammar checks that one token; only when
        it refuses does the grammar mask the whole vocabulary (4.5 ms a token on SmolLM2's 49k, a
        step's worth) before the chain picks again. Greedy, this is the argmax of the tokens the
        grammar allows, as masking first gives; sampled, the first draw (from the unmasked
        distribution) stands when the grammar allows it, as in llama-server."""
        if self._candidates is None:
            self._candidates = _Candidates(self.lib, self.n_vocab)
        c = self._candidates
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        tok = c.pick(logits, r.sampler)
        if not c.allows(r.grammar, tok):
            self.counters["grammar_resamples"] += 1
            tok = c.pick(logits, r.sampler, mask=r.grammar)
        self.lib.llama_sampler_accept(r.grammar, tok)
        self.lib.llama_sampler_accept(r.sampler, tok)
        return tok

    def _sample_matched(self, r: Request, row: int) -> int | None:
        """A token for r (which has an llguidance matcher) at a batch row, as _sample_constrained picks one: the
        chain picks; the matcher checks that token; only when it refuses does its mask of the vocabulary (tens
        of microseconds) go over the logits before the chain picks again. None, with r ended with an error,
        when the grammar went past llguidance's bounds on one token's work."""
        if self._candidates is None:
            self._candidates = _Candidates(self.lib, self.n_vocab)
        c, m = self._candidates, r.matcher
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        tok = c.pick(logits, r.sampler)
        if not m.validate_tokens([tok]):
            self.counters["grammar_resamples"] += 1
            if self._mask is None:
                self._mask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
            m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
            allowed = np.unpackbits(self._mask.view(np.uint8), count=self.n_vocab, bitorder="little").astype(bool)
            if not m.is_error() and allowed.any():
                tok = c.pick(np.where(allowed, logits, np.float32("-inf")), r.sampler)
        if m.is_error() or not m.consume_token(tok):
            from localrun.structured.constraints import stopped_message

            self._finish_error(r, InvalidRequest(stopped_message(m.get_error())))
            return None
        self.lib.llama_sampler_accept(r.sampler, tok)
        return tok

    def _score_prompt(self, r: Request, start: int, block: np.ndarray) -> None:
        """r.prompt_lps gets the logprobs of the prompt tokens that the logits rows in `block` (those of
        prompt positions start, start+1, ...) predict: row j, prompt[start + j + 1] and its top
        alternatives (options.prompt_logprobs of them), as _logprob computes them for output tokens."""
        prompt, top_n = r.prompt, r.options.prompt_logprobs or 0
        rows = block[:max(0, min(len(block), len(prompt) - 1 - start))]  # (a view of llama.cpp's logits)
        if not len(rows):
            return
        m = rows.max(axis=1)
        lse = m.astype(np.float64) + np.log(np.exp(rows - m[:, None]).sum(axis=1, dtype=np.float64))
        nxt = np.asarray(prompt[start + 1:start + 1 + len(rows)], dtype=np.int64)
        chosen = rows[np.arange(len(rows)), nxt] - lse
        if top_n == 1:  # (lm-eval asks for one: is the prompt's token the greedy one)
            tops = rows.argmax(axis=1)[:, None]
        elif top_n > 1:  # row by row: a whole block's argpartition holds an int64 per logit
            tops = np.empty((len(rows), top_n), dtype=np.int64)
            for j, row in enumerate(rows):
                idx = np.argpartition(row, len(row) - top_n)[-top_n:]
                tops[j] = idx[np.argsort(-row[idx], kind="stable")]
        for j, tok in enumerate(nxt.tolist()):
            top = [] if top_n <= 0 else [(self._prompt_text(int(t)), float(rows[j, t] - lse[j])) for t in tops[j]]
            r.prompt_lps.append(TokenLogprob(token=self._prompt_text(tok), logprob=float(chosen[j]), top=top))
        slot = self.slots[r.sid]  # its cells' logprobs, for a later scored prompt with the same start
        slot.lps = r.prompt_lps[1:]

    def _prompt_text(self, tok: int) -> str:
        """A prompt token's text: control tokens written out, as the prompt was tokenized (parse_special)."""
        if tok < 0:  # an image's stand-in (prompt logprobs are refused with images)
            return ""
        return self.piece(tok, special=True).decode("utf-8", "replace")

    def _logprob(self, row: int, token: int, top_n: int) -> TokenLogprob:
        """Log-probabilities of the raw model distribution at a batch row."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        m = logits.max()
        lse = m + np.log(np.exp(logits - m).sum())
        top: list[tuple[str, float]] = []
        top_raw: list[bytes | None] | None = None
        if top_n > 0:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx])]
            texts = [_text_and_raw(self.piece(int(t))) for t in idx]
            top = [(text, float(logits[t] - lse)) for (text, _), t in zip(texts, idx)]
            if any(raw is not None for _, raw in texts):
                top_raw = [raw for _, raw in texts]
        text, raw = _text_and_raw(self.piece(token))
        return TokenLogprob(token=text, logprob=float(logits[token] - lse), top=top, raw=raw, top_raw=top_raw,
                            top_ids=[int(t) for t in idx] if top_n > 0 else None)


def _text_and_raw(piece: bytes) -> tuple[str, bytes | None]:
    """A token's text, and its bytes when they are not whole UTF-8 (the text shows U+FFFD there)."""
    try:
        return piece.decode("utf-8"), None
    except UnicodeDecodeError:
        return piece.decode("utf-8", "replace"), piece


def _put_all(items: list[tuple[Request, Any]]) -> None:
    for r, item in items:
        r.queue.put_nowait(item)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
