"""Slot and prefix admission for the batched loop: which slot a waiting request gets, and what it starts from.

A request gets the slot whose cells hold the longest prefix of its prompt, cut back to that prefix (it
takes an idle slot over, or, when that prefix is in a running slot or an idle one worth keeping, gets a
copy of that slot's cells (:meth:`Admission.copy_stream`: a memcpy, far cheaper than computing the tokens
again). A request whose prompt shares a longer prefix with a prompt still being prefilled waits for that
prefill instead of computing the same tokens beside it. Running sequences are kept in consecutive slots
(:meth:`Admission.compact`), as llama.cpp computes one forward pass per run of consecutive sequence ids.
A ``prompt_cache_key`` steers the choice among equal prefixes. Everything here runs on the loop's thread.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Callable

import numpy as np

from localrun.backends.base import TokenLogprob
from localrun.backends.llamacpp.slots import Request, Slot

log = logging.getLogger("localrun.llamacpp")

MIN_RECOMPUTE = 2  # prompt tokens evaluated even when all are cached (a batch of one differs: see start)
SHARE_WAIT_TOKENS = 32  # a request waits for a running prefill when that would spare it this many tokens


class Admission:
    """The rules that hand a context's slots (``parallel`` of ``n_cells // parallel`` cells each) to
    requests. ``prompt_text(tok)`` is a prompt token's text (a scored
    prompt's cached positions); ``counters`` are the loop's."""

    def __init__(self, lib, ctx, mem, slots: list[Slot], *, n_cells: int, parallel: int, share_prefixes: bool,
                 copy_cells: bool, name: str, counters: dict[str, Any], prompt_text: Callable[[int], str]) -> None:
        self.lib, self.ctx, self.mem = lib, ctx, mem
        self.n_cells, self.parallel, self.share_prefixes, self.name = n_cells, parallel, share_prefixes, name
        self.copy_cells = copy_cells  # a prefix is copied cell by cell, not as a whole stream: see copy_stream
        self.counters, self.prompt_text = counters, prompt_text
        self.slots = slots  # the loop's
        self._keyed: dict[str, int] = {}  # cache key -> the slot its last request used (at most one key a slot)
        self.disk = None  # disk_prefix.DiskPrefixes: the prompt cache on disk, when on

    def admit(self, waiting: list[Request], running: list[Request]) -> None:
        """Start waiting requests (in order, those that need not wait for a shared prefill) while fewer than
        ``parallel`` run."""
        i = 0
        while i < len(waiting) and len(running) < self.parallel:
            r = waiting[i]
            if self._wait_for_shared_prefill(r, running) or (self.disk is not None and self._wait_for_disk(r)):
                i += 1
                continue
            del waiting[i]
            self.start(r, running)

    def compact(self, running: list[Request]) -> None:
        """Keep the running sequences in consecutive slots. With one KV stream per sequence llama.cpp
        computes a step as one forward pass per run of consecutive sequence ids, so streams in slots 0
        and 2 cost two passes a step where slots 0 and 1 cost one. A sequence outside the window of
        slots that holds most running ones moves into a free slot inside it: its cells are copied
        (``copy_stream``, a memcpy, cheaper than the pass it saves on every step after),
        and the slot it leaves keeps the tokens as an idle cached prefix (a slot that another
        ``prompt_cache_key`` last used is not taken)."""
        if not self.share_prefixes or len(running) < 2:
            return  # (recurrent state is no KV stream: no runs to keep together)
        ids = {r.sid for r in running}
        k = len(ids)
        if max(ids) - min(ids) == k - 1:
            return
        start = max(range(self.parallel - k + 1), key=lambda a: (len(ids.intersection(range(a, a + k))), -a))
        free = [i for i in range(start, start + k) if i not in ids]
        key_of = {sid: key for key, sid in self._keyed.items()}  # a slot another key last used stays its
        for r in sorted((r for r in running if not start <= r.sid < start + k), key=lambda r: r.sid):
            dst = next((i for i in free if key_of.get(i) in (None, r.cache_key)), None)
            if dst is not None:
                free.remove(dst)
                self._move(r, self.slots[dst])

    def _move(self, r: Request, dst: Slot) -> None:
        src = self.slots[r.sid]
        self.copy_stream(src, dst)
        dst.tokens, dst.prompt_len, dst.lps = list(src.tokens), src.prompt_len, list(src.lps)
        dst.request, dst.last_used = r, src.last_used
        src.request, src.last_used = None, time.monotonic()
        self._keys_follow(src, dst)  # dst's cells are r's now
        r.sid = dst.id
        self.counters["moved_sequences"] += 1

    def copy_stream(self, src: Slot, dst: Slot) -> None:
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

    def _runs_with(self, running: list[Request], sid: int) -> int:
        """Runs of consecutive slots (forward passes a step) if a sequence in `sid` joined the running ones."""
        ids = sorted({r.sid for r in running} | {sid})
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

    def _wait_for_shared_prefill(self, r: Request, running: list[Request]) -> bool:
        """True when a running prefill will soon hold more of r's prompt than the cache does now:
        r waits for it and shares it, instead of computing the same tokens alongside."""
        if not self.share_prefixes:
            return False
        have = max(self._reusable(sl, r, r.prompt) for sl in self.slots)
        want = r.options.prompt_logprobs
        for s in running:
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

    def _usable(self, r: Request) -> list[int]:
        return r.prompt[:max(0, len(r.prompt) - MIN_RECOMPUTE)] if self.share_prefixes else []

    def _wait_for_disk(self, r: Request) -> bool:
        """True while r waits for a saved state of its prompt to be read from disk (disk_prefix.DiskPrefixes)."""
        if r.disk is False:
            return False
        usable = self._usable(r)
        in_memory = max(self._reusable(sl, r, usable) for sl in self.slots) if r.disk is None else 0
        return self.disk.wait(r, usable, in_memory)

    def start(self, r: Request, running: list[Request]) -> None:
        """Give r a slot holding the longest prefix of its prompt the cache has."""
        # At least MIN_RECOMPUTE prompt tokens are evaluated even when the cache holds all of them:
        # llama.cpp computes a batch of one token with other kernels than a longer batch, so a
        # prompt evaluated from its last token alone gets slightly different logits (and a greedy
        # answer that depends on what ran before); batches of two or more agree exactly.
        usable = self._usable(r)
        # a cache key (prompt_cache_key): on a tie the slot the key last used wins, and a new slot is
        # taken from those no other key last used while there are such (keyless: nothing changes)
        mine = self._keyed.get(r.cache_key) if r.cache_key else None
        owned = {sid for key, sid in self._keyed.items() if key != r.cache_key} if self._keyed else set()
        if self.disk is not None and r.disk:  # a state read from disk goes into a free slot, found just below
            self.disk.restore(r, max(self._reusable(sl, r, usable) for sl in self.slots), owned)
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
            # running ones (see compact); then an empty one, else the least recently used. src (running,
            # or idle with more of its own prompt than r shares) keeps what it holds; r gets a copy of it
            near = {q.sid + d for q in running for d in (-1, 1)}  # empty while nothing runs: no preference
            dst = min(spare or free, key=lambda sl: (sl.id in owned, bool(near) and sl.id not in near, bool(sl.tokens),
                                                     sl.last_used))
            if n:
                self.copy_stream(src, dst)
                dst.tokens, dst.lps = list(src.tokens), list(src.lps)  # cut back below
                self.counters["copied_prefixes"] += 1
                if src.request is None and self._runs_with(running, src.id) < self._runs_with(running, dst.id):
                    # r in src (idle) leaves fewer runs of running slots than r in dst (src fills a gap):
                    # src's prefix lives on in dst and r runs in src. The same one copy, and no gap left
                    # for compact to close with a second one
                    self._hand_over(src, dst)
                    dst = src
        if r.prompt_lps is not None:  # position 0's (none), then the cached positions' as scored before
            want = r.options.prompt_logprobs or 0
            r.prompt_lps = [TokenLogprob(token=self.prompt_text(r.prompt[0]), logprob=None)] + [
                x if len(x.top) <= want else TokenLogprob(x.token, x.logprob, x.top[:want], x.raw,
                                                          x.top_raw[:want] if x.top_raw else None)
                for x in dst.lps[:n]]
        self.truncate(dst, n)
        if self._keyed or r.cache_key:  # the slot's cells are r's now: its key's, no other's
            for key in [key for key, sid in self._keyed.items() if sid == dst.id]:
                del self._keyed[key]
            if r.cache_key:
                self._keyed[r.cache_key] = dst.id
        dst.request, dst.last_used = r, time.monotonic()
        r.sid, r.n_cached, r.computed = dst.id, n, n
        r.pending = r.prompt[n:]
        r.history = list(r.prompt)
        running.append(r)
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

    def truncate(self, slot: Slot, keep: int) -> None:
        """The slot keeps its first ``keep`` cells (llama_memory_seq_rm)."""
        if keep < len(slot.tokens) or keep == 0:
            self.lib.llama_memory_seq_rm(self.mem, slot.id, keep, -1)
            del slot.tokens[keep:]
            del slot.lps[max(0, keep - 1):]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
