"""llama.cpp's batched loop: one context per model, continuous batching, cached prefixes.

One :class:`BatchedLlama` owns a model's single ``llama_context``: ``parallel`` sequences, each a
slot (``slots.Slot``) with a KV stream of its own (``num_ctx`` cells). One thread runs the loop; each step

1. admits waiting requests while fewer than ``parallel`` run (``admission.Admission``): a request gets
   the slot whose cells hold the longest prefix of its prompt, cut back to that prefix (it takes an idle
   slot over, or, when that prefix is in a running slot or an idle one worth keeping, gets a copy of that
   slot's cells (``Admission.copy_stream``: a memcpy, far cheaper than computing the
   tokens again). A request whose prompt shares a longer prefix with a prompt still
   being prefilled waits for that prefill instead of computing the same tokens beside it;
2. builds one ``llama_batch``: every decoding sequence's next token (plus prompt-lookup drafts when
   speculative decoding is on), then prefill chunks of the others, first come first served, up to
   ``step_tokens`` tokens, so a long prompt never stalls the streams already running; laid out in
   slot order, as llama.cpp computes one forward pass per run of consecutive sequence ids;
3. calls ``llama_decode`` once (the GIL is released: the daemon's pipe keeps moving meanwhile);
4. samples each sequence that has an output row with its own sampler chain (logit bias,
   penalties, grammar, top-k/p, min-p, temperature, its own seeded RNG; plain greedy is an argmax
   over the logits row: ``sampling.TokenChooser``), handles stop tokens, stop strings and limits, and
   hands each request its chunk (``output.Output``).

A finished or cancelled request's slot keeps its tokens: a later prompt that starts with them
reuses them (a chat's next turn, an agent's system prompt and tools, an editor's next keystroke).
Running sequences never run out of cells: each is bounded by its window (``num_ctx``).

Everything here runs on the loop's thread except :meth:`submit` / :meth:`cancel` (any thread).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from localrun.backends.base import TokenLogprob
from localrun.backends.llamacpp.admission import Admission
from localrun.backends.llamacpp.images import ImageFeed
from localrun.backends.llamacpp.output import Output
from localrun.backends.llamacpp.sampling import TokenChooser
from localrun.backends.llamacpp.slots import Request, Slot
from localrun.errors import BackendError

log = logging.getLogger("localrun.llamacpp")

FIRST_CHUNK_WAIT = 0.05  # seconds the loop waits for a request's first chunk to reach its consumer (TTFT)
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
                 name: str = "", encode=None, decode_image=None, governor=None, copy_cells: bool = False,
                 disk=None) -> None:
        self.lib, self.model, self.ctx = lib, model, ctx
        # a ThreadGovernor (localrun.backends.llamacpp.cpu_share): fewer compute threads while other processes
        # take the CPUs (polled once a step, here on the loop's thread, the one that calls llama_decode)
        self.governor = governor
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        # on the loop's thread only (its team is llama.cpp's), and where llama.cpp's threads take every CPU this
        # process may use: with a CPU to spare the daemon and the client run there, and a team started again
        # after each request's first token would cost the streams running beside it a thread start per worker
        from localrun.backends.llamacpp.cpu_share import usable_cpus

        n_cpus = len(usable_cpus() or range(os.cpu_count() or 1))
        self._release_threads = omp_release() if lib.llama_n_threads(ctx) >= n_cpus else None
        self.score_rows = prompt_logprobs_rows(self.n_vocab)
        self.mem = lib.llama_get_memory(ctx)
        self.n_cells = int(lib.llama_n_ctx(ctx))
        self.parallel = parallel
        self.step_tokens = max(step_tokens, parallel * 2)
        self.share_prefixes = share_prefixes
        self.name = name
        self.slots = [Slot(i) for i in range(parallel)]
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
        self._logits_view: tuple | None = None  # ((address, rows), array): _logits's view of llama.cpp's buffer
        # token choice (sampler chains, constraints, logprobs), slot and prefix admission, and the step's output
        self.chooser = TokenChooser(lib, ctx, self.vocab, self.n_vocab, self.counters, self.slots,
                                    fail=self._finish_error)
        self.admission = Admission(lib, ctx, self.mem, self.slots, n_cells=self.n_cells, parallel=parallel,
                                   share_prefixes=share_prefixes, copy_cells=copy_cells, name=name,
                                   counters=self.counters, prompt_text=self.chooser.prompt_text)
        self.output = Output(self.chooser)
        # the prompt cache on disk (a prompt_disk.PromptDisk): long prompts' states saved, and read back into a slot
        self.disk = None
        if disk is not None and share_prefixes:
            from localrun.backends.llamacpp.disk_prefix import DiskPrefixes

            self.disk = self.admission.disk = DiskPrefixes(lib, ctx, self.mem, disk, self.slots,
                                                           n_cells=self.n_cells // parallel, step=self.step_tokens,
                                                           name=name)
        # images (a vision projector is loaded): encode(span) -> embeddings runs on a thread of its own
        # (a running stream never waits for another request's image to encode);
        # decode_image(span, seq, pos) puts them in the KV cache on the loop's thread
        self.images = ImageFeed(encode, decode_image, name=name, slots=self.slots, counters=self.counters,
                                wake=self._cv, truncate=self.admission.truncate, fail=self._finish_error)
        self._alloc_batch(self.step_tokens)
        self._thread = threading.Thread(target=self._run, name=f"llama-batch-{name}", daemon=True)
        self._thread.start()

    @property
    def copy_cells(self) -> bool:
        """Whether a prefix is copied cell by cell, not as a whole stream (Admission.copy_stream)."""
        return self.admission.copy_cells

    @copy_cells.setter
    def copy_cells(self, on: bool) -> None:
        self.admission.copy_cells = on

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
        self.images.shutdown()
        if self.disk is not None:
            self.disk.close()
        gone = BackendError("the model was unloaded while this request ran")
        for r in [*self._running, *self._waiting, *self._inbox]:
            self._finish_error(r, gone)
        self.output.flush()
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
        return {**c, **(self.disk.counters if self.disk is not None else {}), "cells": self.n_cells, "cells_used": sum(len(sl.tokens) for sl in self.slots),
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
                self.admission.admit(self._waiting, self._running)
                self.admission.compact(self._running)
                if self._running:
                    worked = self._step()
                    for r in [r for r in self._running if r.finished]:  # e.g. an image that failed to encode
                        self._end(r)
                    self.output.flush()
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
            self.output.flush()

    def _reap(self) -> None:
        """Requests whose consumer left end here: their sequences become idle cache entries."""
        if any(r.cancelled for r in self._waiting):
            for r in [r for r in self._waiting if r.cancelled]:
                r.release(self.lib)
            self._waiting = [r for r in self._waiting if not r.cancelled]
        for r in [r for r in self._running if r.cancelled]:
            self._end(r)

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
        prefills = [r for r in self._running if r.computed < len(r.prompt) and self.images.ready(r)]
        for r in prefills:
            if budget <= 0:
                break
            chunk = r.pending[:min(budget, r.text_ahead(),
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
            self.admission.truncate(slot, 0)
            r.release(self.lib)
        if ret < -1:
            self.fatal = f"llama.cpp reported a compute error (code {ret})"

    def _after(self, rows, outs: list[int], n_out: int) -> None:
        lib, ctx = self.lib, self.ctx
        chooser, output = self.chooser, self.output
        firsts: list[Request] = []
        prefilled: list[Request] = []  # prompts whose prefill ended this step (the prompt cache on disk)
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
                chooser.score_prompt(r, r.computed, logits[o0:o0 + k])
            r.computed += k
            if not decoding:
                r.pending = r.pending[k:]
                self.counters["prefill_tokens"] += k
                if r.computed < len(r.prompt):
                    continue
                if self.disk is not None:
                    prefilled.append(r)
                if r.limit <= 0:  # max_tokens 0: the prompt scored, nothing generated
                    output.emit(r, [])
                    continue
            sampled: list[tuple[int, TokenLogprob | None]] = []
            for row in range(first_row + k - 1 if not decoding else first_row, first_row + k):
                if r.argmax:
                    # (a prompt without prompt logprobs has one output row: its last token's)
                    out = logits[o0 + row - first_row if decoding or r.prompt_lps is not None else o0]
                    if r.options.ban_eog:
                        out[chooser.eog_ids()] = -np.inf  # (the chain's logit bias bans them for the other paths)
                    tok = int(out.argmax())
                elif r.grammar:
                    tok = chooser.constrained(r, row)
                elif r.matcher is not None:
                    tok = chooser.matched(r, row)
                    if tok is None:  # past llguidance's bounds: r has its error
                        sampled = None
                        break
                else:
                    tok = lib.llama_sampler_sample(r.sampler, ctx, row)
                sampled.append((tok, chooser.logprob(row, tok, r.options.top_logprobs) if r.options.logprobs else None))
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
                    self.admission.truncate(self.slots[r.sid], keep)
                    r.computed = keep
                r.draft = []
            first = r.t_first is None
            output.emit(r, sampled)
            if first and not r.finished:
                firsts.append(r)
        for r in [r for r in self._running if r.finished]:
            self._end(r)
        if firsts:  # let the consumers hand on their first tokens before the next decode takes the CPU
            if self._release_threads is not None:  # nor a spinning OpenMP worker (before the write that wakes them)
                self._release_threads()
            self.output.flush()
            deadline = time.monotonic() + FIRST_CHUNK_WAIT
            for r in firsts:
                r.delivered.wait(max(0.0, deadline - time.monotonic()))
        for r in prefilled:  # after the first tokens went out: a copy of the cells, written by another thread
            self.disk.prefilled(r)

    def _end(self, r: Request) -> None:
        """r leaves the loop; its slot keeps r's tokens for a later prompt that starts with them."""
        self._running.remove(r)
        r.release(self.lib)
        slot = self.slots[r.sid]
        slot.request, slot.last_used, slot.prompt_len = None, time.monotonic(), len(r.prompt)
        if not self.share_prefixes:
            self.admission.truncate(slot, 0)

    def _finish_error(self, r: Request, exc: BaseException) -> None:
        r.finished = True
        r.release(self.lib)
        if not r.cancelled:
            self.output.put(r, exc)
