"""Scheduler: which sequences run each step, with how many tokens, on which KV pages.

Continuous batching: decodes first in a per-step token budget, then prefill chunks; admission
by free KV; preemption by recompute; abort frees at once.

Each step: every running sequence in its decode phase gets its next token (oldest first),
then running sequences still prefilling get their next chunk while the budget lasts; a
sequence that cannot get a page preempts the newest running one not yet scheduled this
step (its KV is released, its computed prefix stays in the radix cache, and it returns to
the waiting queue to be recomputed). Then waiting sequences are admitted, ordered by
longest cached prefix (FCFS tie-break; plain FCFS when the queue is long), while KV pages,
sequence slots and budget last.

With overlap scheduling a step is scheduled before the previous step's sampled tokens
reach the host: such a token is a PENDING placeholder in `token_ids` (its value is still
on the device, where the next step reads it as input). A sequence whose pending token
is its last (max_tokens or the context window reached) is not scheduled again.

Work per step is O(running + admitted): the queues are lists in arrival order, a
sequence's state says where it is, and finished or moved sequences are compacted once.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from localrun.engine.config import EngineConfig
from localrun.engine.kv.base import PagePool, PrefixCache
from localrun.engine.kv.pool import PageTable
from localrun.engine.sampler import SamplingParams

_arrivals = itertools.count()
LONG_QUEUE = 128  # beyond this many waiting, skip prefix matching and go FCFS
PENDING = -1  # a sampled token not yet copied to the host
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
HELD = "held"  # a group member waiting to fork from its leader's prefill (never admitted on its own)


class Sequence:
    def __init__(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.id = seq_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.arrival = next(_arrivals)
        self.status = WAITING
        self.pages: list[int] = []
        self.row: int | None = None  # page-table row while running
        self.num_computed = 0  # tokens whose KV is in the pool (or being computed by a launched step)
        self.cached_tokens = -1  # prompt tokens served by the prefix cache at first admission
        self.node = None  # radix node locked by this sequence
        self.num_tree_pages = 0  # leading pages already inserted into the radix tree
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.num_pending = 0  # PENDING placeholders at the end of token_ids
        self.pending_row: int | None = None  # the last placeholder's row in its step's sampled tokens
        self.last_step = -1  # the step that last scheduled this sequence
        # n > 1 (a group sharing one prompt): the leader prefills; its followers are HELD until the
        # step that computes the prompt's last token, then fork from it (see Scheduler._fork)
        self.followers: list[Sequence] = []
        self.leader: Sequence | None = None  # while HELD
        # grammar-constrained: its own matcher (copy a request's state with matcher.fork())
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        self.draft: list[int] = []  # speculative decoding: proposed next tokens, verified in the coming step
        self.spec_draft_tokens = 0  # drafted tokens scheduled for verification
        self.spec_accepted_tokens = 0  # of those, accepted
        # params.prompt_logprobs: per prompt position (token id, logprob, [(id, logprob), ...]), filled as
        # the prompt's chunks are computed (position 0: logprob None); until every one is in, admission
        # computes the whole prompt (the prefix cache keeps no logits)
        self.prompt_lps: list | None = None
        self.prompt_lps_left = 0
        if params.prompt_logprobs is not None:
            self.prompt_lps = [None] * self.prompt_len
            self.prompt_lps[0] = (prompt_ids[0], None, [])
            self.prompt_lps_left = self.prompt_len - 1

    def __lt__(self, other: "Sequence") -> bool:  # arrival order (bisect)
        return self.arrival < other.arrival

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def add_pending(self, row: int) -> int:
        """Append a placeholder for the token sampled at `row` of the launched step; its position."""
        self.token_ids.append(PENDING)
        self.num_pending += 1
        self.pending_row = row
        return len(self.token_ids) - 1

    def resolve(self, position: int, token: int) -> None:
        self.token_ids[position] = token
        self.num_pending -= 1
        if self.num_pending == 0:
            self.pending_row = None


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes first, then speculative verifies, then prefill chunks
    num_tokens: list[int]
    num_decodes: int
    # group forks this step: (leader, follower) pairs; each follower samples its first token from
    # its leader's last-position logits. copies: (source page, fresh page) pairs to copy on the
    # device after the forward (the prompt's partial last page, which each follower gets its own of)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_spec: int = 0  # rows after the decodes: a decode plus its draft (1 + len(draft) tokens, all sampled)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: PagePool, cache: PrefixCache | None, table: PageTable) -> None:
        self.cfg, self.pool, self.cache, self.table = cfg, pool, cache, table
        self.P = pool.page_size
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.finished_by_scheduler: list[Sequence] = []  # pool too small for a lone sequence
        self.prefix_hit_tokens = 0  # prompt tokens served by the prefix cache (both tiers)
        self.prefix_host_hit_tokens = 0  # of those, tokens whose KV was loaded back from host memory
        self.prefix_query_tokens = 0
        self.num_preemptions = 0
        self.held: dict[str, Sequence] = {}  # group followers not yet forked, by id
        self.prefill_tokens = 0  # prompt (and recompute) tokens computed by prefill chunks
        self.forked_seqs = 0  # group followers that started from their leader's prefill
        self._step = 0

    # -- pages -------------------------------------------------------------------------------
    def _grab(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if self.pool.num_free < n and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n) if self.pool.num_free >= n else None

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        got = self._grab(-(-num_tokens // self.P) - len(seq.pages))
        if got is None:
            return False
        if got:
            self.table.write(seq.row, len(seq.pages), got)
            seq.pages += got
        return True

    def cache_prefix(self, seq: Sequence) -> None:
        """Insert the sequence's fully computed pages into the radix tree and lock them."""
        if self.cache is None:
            return
        full = min(seq.num_computed, len(seq.token_ids) - seq.num_pending) // self.P
        if full <= seq.num_tree_pages:
            return
        tree_pages, node = self.cache.insert(seq.token_ids[: full * self.P], seq.pages[:full])
        for i, (mine, theirs) in enumerate(zip(seq.pages[:full], tree_pages)):
            if mine != theirs:  # the tree already had this run: share its page, drop ours
                self.pool.incref([theirs])
                self.pool.decref([mine])
                seq.pages[i] = theirs
                self.table.write(seq.row, i, [theirs])
        self.cache.lock(node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.node, seq.num_tree_pages = node, full

    def release(self, seq: Sequence, keep_prefix: bool = True) -> None:
        """Give back every page of the sequence (its computed prefix stays cached)."""
        if keep_prefix and seq.row is not None:
            self.cache_prefix(seq)
        if self.cache is not None and seq.node is not None:
            self.cache.unlock(seq.node)
        self.pool.decref(seq.pages)
        if seq.row is not None:
            self.table.free_row(seq.row)
        seq.pages, seq.node, seq.num_tree_pages, seq.num_computed, seq.row = [], None, 0, 0, None

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        bisect.insort(self.waiting, seq)

    def add_group(self, leader: Sequence, followers: list[Sequence]) -> None:
        """Queue a group sharing one prompt: only the leader is admitted and prefills; the
        followers fork from it in the step that computes the prompt's last token."""
        if any(f.token_ids != leader.token_ids for f in followers):
            raise ValueError("every member of a group must have the same prompt")
        for f in followers:
            f.status, f.leader = HELD, leader
            self.held[f.id] = f
        leader.followers = list(followers)
        self.add(leader)

    def _unhold(self, leader: Sequence) -> None:
        """The leader cannot share its prefill (aborted, or no room to fork): its remaining
        followers become ordinary waiting sequences (the prefix cache still serves their full pages)."""
        for f in leader.followers:
            self.held.pop(f.id, None)
            f.leader = None
            self.add(f)
        leader.followers = []

    def abort(self, seq_id: str) -> Sequence | None:
        held = self.held.pop(seq_id, None)
        if held is not None:
            held.leader.followers.remove(held)
            held.leader = None
            self.finish(held)
            held.finish_reason = held.finish_reason or "abort"
            return held
        for q in (self.running, self.waiting):
            for s in q:
                if s.id == seq_id and s.status != FINISHED:
                    self.finish(s)
                    s.finish_reason = s.finish_reason or "abort"
                    return s
        return None

    def finish(self, seq: Sequence) -> None:
        """Done (or aborted): free its pages; it leaves its queue at the next compaction."""
        if seq.status == FINISHED:
            return
        seq.status = FINISHED
        self.release(seq)
        if seq.followers:
            self._unhold(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq)

    def has_work(self) -> bool:
        return any(s.status == WAITING for s in self.waiting) or any(s.status == RUNNING for s in self.running)

    def _compact(self) -> None:
        self.running = [s for s in self.running if s.status == RUNNING]
        self.waiting = [s for s in self.waiting if s.status == WAITING]

    def _order_waiting(self) -> list[Sequence]:
        if self.cache is None or len(self.waiting) > LONG_QUEUE:
            return self.waiting
        hits = {s.id: self.cache.cached_pages(s.token_ids[: self._cacheable(s)]) for s in self.waiting}
        return sorted(self.waiting, key=lambda s: (-hits[s.id], s.arrival))

    def _cacheable(self, seq: Sequence) -> int:
        return (len(seq.token_ids) - 1) // self.P * self.P  # the last token is always computed

    def _done_by_length(self, seq: Sequence) -> bool:
        """Its last token is already decided (a pending token reached max_tokens or the window)."""
        return seq.num_pending > 0 and (seq.num_output >= seq.params.max_tokens
                                        or len(seq.token_ids) >= self.cfg.max_model_len)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._compact()
        self._step += 1
        budget = self.cfg.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        specs: list[tuple[Sequence, int]] = []  # decodes with a draft to verify
        prefills: list[tuple[Sequence, int]] = []
        preempted = False
        for want_decode in (True, False):
            for seq in self.running:
                if budget <= 0:
                    break
                if seq.status != RUNNING or seq.last_step == self._step or self._done_by_length(seq):
                    continue
                need = len(seq.token_ids) - seq.num_computed
                if (need == 1) != want_decode:
                    continue
                n = min(need, budget)
                if want_decode and seq.draft:
                    if self._room_for_draft(seq, budget):
                        seq.last_step = self._step
                        specs.append((seq, 1 + len(seq.draft)))
                        budget -= 1 + len(seq.draft)
                        continue
                    seq.draft = []  # no room: a plain decode
                ok, victim = self._make_room(seq, seq.num_computed + n)
                preempted |= victim
                if not ok:
                    continue
                seq.last_step = self._step
                (decodes if want_decode else prefills).append((seq, n))
                budget -= n
        if not preempted:
            budget = self._admit(budget, prefills)
        forks: list[tuple[Sequence, Sequence]] = []
        copies: list[tuple[int, int]] = []
        for seq, n in prefills:
            if seq.followers and seq.num_computed + n == len(seq.token_ids):
                self._fork(seq, forks, copies)
        self._compact()
        batch = decodes + specs + prefills
        if not batch:
            return None
        return ScheduledBatch([s for s, _ in batch], [n for _, n in batch], len(decodes), forks, copies,
                              num_spec=len(specs))

    def _fork(self, leader: Sequence, forks: list, copies: list) -> None:
        """The leader's chunk this step computes the prompt's last token: each follower gets a
        page-table row sharing every full prompt page (one more reference each) and a fresh copy
        of the partial last page (copied on the device after the forward), counts the whole
        prompt as computed, and samples its first token from the leader's logits this step.
        Followers that find no row or page become ordinary waiting sequences."""
        L, P = leader.prompt_len, self.P
        full, partial = divmod(L, P)
        num_running = sum(s.status == RUNNING for s in self.running)
        for f in list(leader.followers):
            if num_running >= self.cfg.max_num_seqs:
                break
            fresh = self._grab(1) if partial else []
            if fresh is None:
                break
            shared = leader.pages[:full]
            self.pool.incref(shared)
            f.row = self.table.alloc_row()
            f.pages = shared + fresh
            self.table.write(f.row, 0, f.pages)
            if partial:
                copies.append((leader.pages[full], fresh[0]))
            f.num_computed, f.cached_tokens = L, leader.cached_tokens
            f.status, f.leader, f.last_step = RUNNING, None, self._step
            del self.held[f.id]
            leader.followers.remove(f)
            bisect.insort(self.running, f)
            forks.append((leader, f))
            num_running += 1
            self.forked_seqs += 1
        self._unhold(leader)

    def _room_for_draft(self, seq: Sequence, budget: int) -> bool:
        """Trim seq's draft to the step budget and get pages for it; never preempts for a draft."""
        del seq.draft[max(budget - 1, 0):]
        return bool(seq.draft) and self._ensure_pages(seq, seq.num_computed + 1 + len(seq.draft))

    def _make_room(self, seq: Sequence, num_tokens: int) -> tuple[bool, bool]:
        """Pages for num_tokens of seq, preempting the newest running sequences not scheduled this
        step if need be. Returns (seq may run, something was preempted)."""
        preempted = False
        while not self._ensure_pages(seq, num_tokens):
            victim = next((s for s in reversed(self.running)
                           if s.status == RUNNING and s.last_step != self._step), None)
            if victim is None:
                return False, preempted
            if victim is seq and sum(s.status == RUNNING for s in self.running) == 1:
                seq.finish_reason = "length"  # alone and still out of pages: the pool is too small
                self.finish(seq)
                self.finished_by_scheduler.append(seq)
                return False, preempted
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

    def _admit(self, budget: int, prefills: list[tuple[Sequence, int]]) -> int:
        reserve = max(1, self.pool.num_pages // 100)
        admitted_pages: set[tuple[int, tuple]] = set()  # (page index, its tokens) of this step's admissions
        num_running = sum(s.status == RUNNING for s in self.running)
        if budget <= 0 or num_running >= self.cfg.max_num_seqs or not self.waiting:
            return budget
        for seq in self._order_waiting():
            if budget <= 0 or num_running >= self.cfg.max_num_seqs:
                break
            if seq.num_pending:  # preempted while a token was in flight: wait for it
                continue
            pages, node, loaded = [], None, 0
            if self.cache is not None and not seq.prompt_lps_left:  # (a scored prompt is computed whole)
                pages, node, loaded = self.cache.load_prefix(seq.token_ids[: self._cacheable(seq)])
                i, P = len(pages) * self.P, self.P
                if i + P <= self._cacheable(seq) and (len(pages), tuple(seq.token_ids[i:i + P])) in admitted_pages:
                    continue  # it shares an uncached page with one admitted this step: let that one compute it
            cached = len(pages) * self.P
            total_pages = -(-len(seq.token_ids) // self.P)
            if node is not None:
                self.cache.lock(node)
            evictable = self.cache.evictable_pages if self.cache is not None else 0
            if self.pool.num_free + evictable < total_pages - len(pages) + reserve:
                if node is not None:
                    self.cache.unlock(node)
                break  # FCFS: do not let later requests overtake this one
            n = min(len(seq.token_ids) - cached, budget)
            self.pool.incref(pages)
            seq.row = self.table.alloc_row()
            self.table.write(seq.row, 0, pages)
            seq.pages, seq.node, seq.num_tree_pages, seq.num_computed = list(pages), node, len(pages), cached
            if not self._ensure_pages(seq, cached + n):
                self.release(seq, keep_prefix=False)
                break
            if seq.cached_tokens < 0:
                seq.cached_tokens = cached
                self.prefix_hit_tokens += cached
                self.prefix_host_hit_tokens += loaded * self.P
                self.prefix_query_tokens += seq.prompt_len
            seq.status = RUNNING
            seq.last_step = self._step
            bisect.insort(self.running, seq)
            num_running += 1
            if self.cache is not None:
                P = self.P
                admitted_pages.update((k, tuple(seq.token_ids[k * P:(k + 1) * P]))
                                      for k in range(len(seq.token_ids) // P))
            prefills.append((seq, n))
            budget -= n
        return budget

    def update(self, batch: ScheduledBatch) -> None:
        """Advance the computed counts once the step is launched; cache prefixes of prefill chunks."""
        self.prefill_tokens += sum(batch.num_tokens[batch.num_decodes + batch.num_spec:])  # not decodes, not verifies
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            if n > 1:
                self.cache_prefix(seq)

    def take_finished(self) -> list[Sequence]:
        out, self.finished_by_scheduler = self.finished_by_scheduler, []
        return out
