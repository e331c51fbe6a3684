"""ModelRunner: runs a scheduled batch on the device (forward, then sampling) and hands back its tokens.

It turns a scheduled batch into a step (host arrays -> persistent buffers ->
AttnMetadata), runs the model (eagerly, or a decode batch by replaying the CUDA graph of its
padded size), and samples on the device. `launch` returns at once with the step's sampled
tokens still on the device; `StepHandle.result()` is the step's one host sync.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from localrun.engine import faults
from localrun.engine.config import EngineConfig
from localrun.engine.kv.pool import KVPool, PageTable
from localrun.engine.layers.attention import AttnMetadata, HostStep, StepBuffers, make_backend, padding_step
from localrun.engine.models.llama import LlamaModel
from localrun.engine.parallel.group import apply_journal
from localrun.engine.sampler import SampleOutput, SamplingBatch, SamplingParams, sample, start_host_copy, to_device
from localrun.engine.scheduler import PENDING, ScheduledBatch, Sequence

log = logging.getLogger("localrun.engine")

# Batches of up to this many sampling rows draw plain temperature rows with the one-pass kernel
# (kernels/sampling.py) by default. At one row the torch path's softmax and argmax are one thread
# block each over the vocabulary (~30 us each on an H100 at 128k tokens); with the kernel the ITL
# of the 8B shape fell 0.9-1.1% (results/gpu-check-nvidia-h100.txt). At full batches its A/Bs
# disagreed (-10% to +1%), so larger batches keep the torch path unless EngineConfig.fused_sampling.
FUSED_SAMPLING_ROWS = 8


@dataclass
class StepHandle:
    """A launched step: the sequences that sample, and their tokens on the way to the host."""

    seqs: list[Sequence]
    out: SampleOutput | None
    sampling: SamplingBatch | None
    positions: list[int] = field(default_factory=list)  # where each sampled token goes in its token_ids
    deferred: tuple | None = None  # (logits, inputs): launched, sampling waits for grammar masks
    scores: "PromptScores | None" = None  # the step's scored prompt rows, on their way to the host

    def result(self) -> tuple[list[int], list]:
        if self.scores is not None:
            self.scores.apply()
        if self.out is None:
            return [], []
        return self.out.to_host(self.sampling)


SCORE_ROWS = 64  # prompt rows whose logits one pass computes (a 128k vocabulary: 32 MB of float32 logits)


@dataclass
class PromptScores:
    """A step's scored prompt rows (SamplingParams.prompt_logprobs): each row's logprob of the prompt
    token after it and its top alternatives, copied to the host without waiting for the device;
    apply() (after the step) writes them into each sequence's prompt_lps."""

    seqs: list  # (sequence, position of its first scored row, rows)
    next_ids: list[int]  # the prompt token each row predicts
    chosen: torch.Tensor  # float [R]
    top_v: torch.Tensor  # float [R, k]
    top_i: torch.Tensor  # int64 [R, k]
    event: object = None

    def apply(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        chosen, top_v, top_i = self.chosen.tolist(), self.top_v.tolist(), self.top_i.tolist()
        nxt = self.next_ids
        j = 0
        for seq, first, n in self.seqs:
            k = seq.params.prompt_logprobs or 0
            for pos in range(first + 1, first + 1 + n):
                if seq.prompt_lps[pos] is None:
                    seq.prompt_lps_left -= 1
                seq.prompt_lps[pos] = (nxt[j], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
                j += 1


class DecodeGraphs:
    """Decode steps at padded batch sizes over the persistent step buffers: captured as CUDA
    graphs at load and replayed (capture=True), or run eagerly over the same buffers and
    padding (capture=False: CPU, where this path is tested)."""

    def __init__(self, runner: "ModelRunner", sizes: list[int], capture: bool) -> None:
        self.runner, self.sizes, self.capture = runner, sorted(sizes), capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.failed: dict[int, str] = {}  # batch size -> why its capture failed (it runs eagerly)
        self.meta: dict[int, AttnMetadata] = {}
        cfg = runner.model.cfg
        self.logits = torch.zeros((max(sizes), cfg.vocab_size), dtype=torch.float32, device=runner.device)

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def _forward(self, bs: int) -> None:
        r = self.runner
        hidden = r.model(r.buffers.view("input_ids", bs), r.buffers.view("positions", bs), self.meta[bs], r.attn)
        logits = r.model.compute_logits(hidden)  # None on a tensor-parallel follower
        if logits is not None:
            self.logits[:bs] = logits

    @torch.inference_mode()
    def capture_all(self) -> None:
        r = self.runner
        pool = None
        injected = faults.active("graph_capture")
        for bs in reversed(self.sizes):  # largest first: the smaller graphs fit in its memory pool
            try:
                r.buffers.write(padding_step(bs, r.table.dummy_row))
                self.meta[bs] = r.attn.prepare(padding_step(bs, r.table.dummy_row), for_graph=True)
                self._forward(bs)  # warm-up: every kernel compiled before capture
            except Exception as exc:  # noqa: BLE001 - not padded to this size: the next larger, or unpadded
                self.failed[bs] = f"warm-up failed, not padded to it: {type(exc).__name__}: {exc}"
                self.meta.pop(bs, None)
                continue
            try:  # a size that cannot be captured runs eagerly over the same buffers and padding
                if None in injected or str(bs) in injected:
                    raise faults.InjectedFault(f"injected capture failure at batch {bs} (LOCALRUN_FAULTS)")
                if self.capture:
                    torch.cuda.synchronize(r.device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        self._forward(bs)
                    pool = g.pool() if pool is None else pool
                    self.graphs[bs] = g
            except Exception as exc:  # noqa: BLE001
                self.failed[bs] = f"capture failed: {type(exc).__name__}: {exc}"
                if self.capture:
                    torch.cuda.synchronize(r.device)
        self.sizes = [s for s in self.sizes if s in self.meta]
        if self.capture:
            torch.cuda.synchronize(r.device)

    def run(self, bs: int) -> torch.Tensor:
        """Logits [bs, vocab] of the padded decode step now in the buffers."""
        g = self.graphs.get(bs)
        if g is not None:
            g.replay()
        else:
            self._forward(bs)
        return self.logits[:bs]


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, config: EngineConfig, triton: bool) -> None:
        self.model, self.pool, self.config = model, pool, config
        self.tp = model.tp
        self.device = torch.device(config.device)
        self.P = pool.page_size
        self.table = PageTable(config.max_num_seqs, -(-config.max_model_len // self.P), self.device)
        if self.tp.world > 1 and self.tp.rank == 0:
            self.table.journal = []  # page-table writes, sent to the other ranks with each step
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        # speculative decoding samples every drafted position: up to a step's tokens
        samples = max_tokens if getattr(config, "speculative", "off") != "off" else None
        self.buffers = StepBuffers(max_tokens, config.max_num_seqs, self.device, max_samples=samples)
        self.attn = make_backend(triton, pool, self.table, self.buffers, model.ops.refs)
        model.attn = self.attn
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=self.device)
        # plain temperature draws in one kernel (its warm-up trial passed: engine/fallbacks.py) in batches of up
        # to this many sampling rows; every batch with EngineConfig.fused_sampling (a speculative step samples
        # every drafted position: more rows than sequences)
        if not triton or "sample_temperature" in model.ops.refs:
            self.fused_rows: float = 0
        else:
            self.fused_rows = math.inf if config.fused_sampling else FUSED_SAMPLING_ROWS
        self.graphs: DecodeGraphs | None = None
        self.defer_grammar = False  # the engine sets it: see launch()
        self._scores: PromptScores | None = None  # the last forward's scored prompt rows (launch takes them)
        self.step_faults = False  # the engine sets it when LOCALRUN_FAULTS has step_oom (its own runner only)

    # -- CUDA graphs -------------------------------------------------------------------------
    def setup_graphs(self, capture: bool) -> float:
        """Capture (or, without CUDA, prepare the eager padded path for) the decode batch sizes."""
        t = time.perf_counter()
        self.graphs = DecodeGraphs(self, self.config.graph_batch_sizes(), capture)
        self.graphs.capture_all()
        return time.perf_counter() - t

    # -- a step ------------------------------------------------------------------------------
    def host_step(self, batch: ScheduledBatch) -> tuple[HostStep, list[Sequence], int | None]:
        """The step's host arrays (vectorised: O(batch + tokens)), the sequences that sample, and
        the padded size when the step replays a decode graph."""
        seqs, P, B = batch.seqs, self.P, len(batch.seqs)
        n = np.asarray(batch.num_tokens, dtype=np.int32)
        starts = np.fromiter((s.num_computed for s in seqs), np.int32, B)
        rows = np.fromiter((s.row for s in seqs), np.int32, B)
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(n, out=cu[1:])
        T = int(cu[-1])
        owner = np.repeat(np.arange(B, dtype=np.int32), n)
        pos = starts[owner] + np.arange(T, dtype=np.int32) - cu[:-1][owner]
        slots = self.table.host[rows[owner], pos // P] * P + pos % P
        prev = np.full(T, -1, dtype=np.int32)
        ids: list[int] = []
        nd = batch.num_decodes
        for i in range(nd):  # a decode's input is its last token, maybe still on the device
            tok = seqs[i].token_ids[starts[i]]
            if tok == PENDING:
                prev[i], tok = seqs[i].pending_row, 0
            ids.append(tok)
        ns = batch.num_spec
        for i in range(nd, nd + ns):  # a speculative row: its last token, then its draft
            ids.append(seqs[i].token_ids[starts[i]])
            ids += seqs[i].draft[:n[i] - 1]
        for i in range(nd + ns, B):
            ids += seqs[i].token_ids[starts[i]:starts[i] + n[i]]
        # the sequences whose chunk ends at their last token sample it; a speculative row samples
        # every position (verification)
        sampling = [i for i in range(B) if nd <= i < nd + ns or starts[i] + n[i] == len(seqs[i].token_ids)]
        if ns:
            sample_idx = np.concatenate([np.arange(cu[i], cu[i + 1]) if nd <= i < nd + ns else cu[i + 1:i + 2] - 1
                                         for i in sampling]).astype(np.int32)
            sampling = [i for i in sampling for _ in range(n[i] if nd <= i < nd + ns else 1)]
        else:
            sample_idx = cu[1:][sampling] - 1
        step = HostStep(input_ids=np.asarray(ids, dtype=np.int32), prev_idx=prev, positions=pos, slots=slots,
                        seq_lens=starts + n, cu_seqlens_q=cu, rows=rows, sample_idx=sample_idx,
                        num_decodes=nd, num_real_seqs=B)
        # (not under tensor parallelism: the followers would have to compute the same logits)
        scored = [i for i in range(nd + ns, B) if seqs[i].prompt_lps is not None] if self.tp.world == 1 else []
        if scored:  # rows of prompt positions whose next prompt token is scored
            idx, nxt, owners = [], [], []
            for i in scored:
                s, start = seqs[i], int(starts[i])
                rows_i = max(0, min(int(n[i]), s.prompt_len - 1 - start))
                if rows_i:
                    idx += range(int(cu[i]), int(cu[i]) + rows_i)
                    nxt += s.token_ids[start + 1:start + 1 + rows_i]
                    owners.append((s, start, rows_i))
            if owners:
                step.score_idx, step.score_next, step.score_seqs = idx, nxt, owners
        bs = self.graphs.size_for(B) if self.graphs is not None and nd == B else None
        if bs is not None and bs > B:
            step = _pad_decode(step, bs, self.table.dummy_row)
        return step, [seqs[i] for i in sampling], bs

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Run the model on the step and sample, without waiting for the device. With
        defer_grammar set and a sampling row that has a grammar, only the forward is launched
        (handle.deferred): the caller brings the matchers up to date, then sample_with_masks()."""
        step, sample_seqs, bs = self.host_step(batch)
        if self.tp.world > 1:  # the other ranks run the same forward
            self.tp.send_step(step, bs, self.table.journal)
        logits, ids, sample_idx, sample_seqs = self.forward_sampling(batch, step, bs, sample_seqs)
        scores, self._scores = self._scores, None
        if not sample_seqs:
            return StepHandle([], None, None, scores=scores)
        sb = self.sampling_batch(sample_seqs, step)
        inputs = ids.index_select(0, sample_idx) if sb.penalties is not None else None
        handle = StepHandle(sample_seqs, None, sb, scores=scores)
        if any(s.params.grammar is not None for s in sample_seqs):
            if self.defer_grammar:
                handle.deferred = (logits, inputs)
                return handle
            self.grammar_masks(handle)
        self._sample(handle, logits, inputs)
        return handle

    def forward_sampling(self, batch: ScheduledBatch, step: HostStep, bs: int | None, sample_seqs: list[Sequence]
                         ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, list[Sequence]]:
        """Run the step's forward, copy its group forks' pages, and return (logits, input ids,
        sample_idx, sampling sequences) with one row per group follower appended."""
        logits, ids = self._forward(step, bs)
        if batch.copies:  # group forks: each follower's own copy of the prompt's partial last page
            self.pool.copy_pages([s for s, _ in batch.copies], [d for _, d in batch.copies])
        sample_idx = self.buffers.view("sample_idx", len(sample_seqs))
        if batch.forks:  # followers sample from their leader's logits row, each with its own params
            logits, sample_idx, sample_seqs = _fork_rows(logits, sample_idx, sample_seqs, batch.forks)
        return logits, ids, sample_idx, sample_seqs

    def _sample(self, handle: StepHandle, logits: torch.Tensor, inputs: torch.Tensor | None) -> None:
        S = len(handle.seqs)
        out = sample(logits, handle.sampling, inputs)
        self.last_tokens[:S].copy_(out.tokens)
        self.tp.broadcast(self.last_tokens[:S])  # a follower's next decode may read them
        out.start_copy()
        handle.out = out

    def grammar_masks(self, handle: StepHandle) -> None:
        """Fill the grammar rows' bitmasks from their matchers (host) and attach them (device)."""
        from localrun.structured.masks import fill_masks

        rows = [i for i, s in enumerate(handle.seqs) if s.matcher is not None]
        sb = handle.sampling
        sb.mask_rows = to_device(rows, torch.int64, self.device)
        sb.token_mask = fill_masks([handle.seqs[i].matcher for i in rows], self.model.cfg.vocab_size, self.device)

    @torch.inference_mode()
    def sample_with_masks(self, handle: StepHandle) -> None:
        """Finish a deferred launch: grammar masks from the matchers as they are now, then sample."""
        logits, inputs = handle.deferred
        handle.deferred = None
        self.grammar_masks(handle)
        self._sample(handle, logits, inputs)

    def _forward(self, step: HostStep, bs: int | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Logits of the sampling tokens (None when none samples, or on a tensor-parallel
        follower) and the step's input ids on the device."""
        T, S = step.num_tokens, len(step.sample_idx)
        self.buffers.write(step)
        meta = self.attn.prepare(step, for_graph=bs is not None)
        ids = self.buffers.view("input_ids", T)
        if step.has_pending:  # last step's tokens, straight from the device
            prev = self.buffers.view("prev_idx", T)
            ids.copy_(torch.where(prev >= 0, self.last_tokens[prev.clamp(min=0).long()], ids))
        if self.step_faults and faults.take("step_oom"):
            raise torch.OutOfMemoryError("injected: out of memory in the forward (LOCALRUN_FAULTS step_oom)")
        if bs is not None:
            logits = self.graphs.run(bs)[:S]
        else:
            hidden = self.model(ids, self.buffers.view("positions", T), meta, self.attn)
            if step.score_idx is not None:
                self._scores = self._score_prompts(step, hidden)
            if not S:
                return None, ids
            logits = self.model.compute_logits(hidden.index_select(0, self.buffers.view("sample_idx", S)))
        return logits, ids

    def _score_prompts(self, step: HostStep, hidden: torch.Tensor) -> PromptScores:
        """The scored prompt rows' logprobs (the raw distribution, as the sampler reports output
        logprobs), SCORE_ROWS rows a pass; their copy to the host is started, not waited for."""
        dev = hidden.device
        idx = to_device(step.score_idx, torch.int64, dev)
        nxt = to_device(step.score_next, torch.int64, dev)
        k = max(1, max(s.params.prompt_logprobs or 0 for s, _, _ in step.score_seqs))
        chosen, top_v, top_i = [], [], []
        for a in range(0, len(idx), SCORE_ROWS):
            lp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, idx[a:a + SCORE_ROWS])).float(),
                                   dim=-1)
            chosen.append(lp.gather(1, nxt[a:a + SCORE_ROWS, None])[:, 0])
            v, i = lp.topk(k, dim=-1)
            top_v.append(v)
            top_i.append(i)
        parts, event = start_host_copy((torch.cat(chosen), torch.cat(top_v), torch.cat(top_i)))
        return PromptScores(step.score_seqs, step.score_next, *parts, event=event)

    def follow_step(self, step: HostStep, bs: int | None, journal: np.ndarray) -> None:
        """A tensor-parallel follower's share of a step rank 0 launched."""
        apply_journal(self.table, journal)
        self._forward(step, bs)
        S = len(step.sample_idx)
        if S:
            self.tp.broadcast(self.last_tokens[:S])

    def sampling_batch(self, seqs: list[Sequence], step: HostStep) -> SamplingBatch:
        params = [s.params for s in seqs]
        pen = any(p.has_penalties for p in params)
        hist = [s.token_ids[: len(s.token_ids) - s.num_pending] if s.params.has_penalties else [] for s in seqs]
        prev, idx = step.prev_idx, step.sample_idx
        # rows past the step's own (group followers) sample after a prefill: nothing pending
        pending = [pen and j < len(idx) and bool(prev[int(idx[j])] >= 0) for j in range(len(seqs))]
        sb = SamplingBatch.build(params, hist, [s.prompt_len for s in seqs], [s.num_output for s in seqs],
                                 pending, self.model.cfg.vocab_size, self.device)
        sb.fused = sb.n <= self.fused_rows
        return sb

    # -- no KV cache (embeddings) ------------------------------------------------------------
    @torch.inference_mode()
    def hidden_states(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states of each sequence, with no KV cache (embeddings)."""
        if self.tp.world > 1 and self.tp.rank == 0:
            self.tp.send_embed(token_lists)
        lens = [len(t) for t in token_lists]
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        dev = self.device
        meta = AttnMetadata(
            positions=torch.tensor([p for n in lens for p in range(n)], dtype=torch.int32, device=dev),
            slot_mapping=None, page_table=None, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev), num_decodes=0, max_q_len=max(lens))
        ids = torch.tensor([x for t in token_lists for x in t], dtype=torch.int32, device=dev)
        h = self.model(ids, meta.positions, meta, self.attn)
        return [h[a:b] for a, b in zip(cu[:-1], cu[1:])]


def _fork_rows(logits: torch.Tensor, sample_idx: torch.Tensor, seqs: list[Sequence],
               forks: list[tuple[Sequence, Sequence]]) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
    """Append one sampling row per group follower: a copy of its leader's logits row (and
    token index), so n members draw from the same last-position logits in one sampler call."""
    at = {id(s): j for j, s in enumerate(seqs)}
    rows = to_device([at[id(leader)] for leader, _ in forks], torch.int64, logits.device)
    return (torch.cat([logits, logits.index_select(0, rows)]), torch.cat([sample_idx, sample_idx.index_select(0, rows)]),
            seqs + [f for _, f in forks])


def _pad_decode(step: HostStep, bs: int, dummy_row: int) -> HostStep:
    """A decode step padded to bs rows: padding rows have no KV (seq_len 0), write nothing (slot
    -1) and read the all-zero page-table row."""
    pad = padding_step(bs - step.num_real_seqs, dummy_row)
    B = step.num_real_seqs
    return HostStep(
        input_ids=np.concatenate([step.input_ids, pad.input_ids]),
        prev_idx=np.concatenate([step.prev_idx, pad.prev_idx]),
        positions=np.concatenate([step.positions, pad.positions]),
        slots=np.concatenate([step.slots, pad.slots]),
        seq_lens=np.concatenate([step.seq_lens, pad.seq_lens]),
        cu_seqlens_q=np.arange(bs + 1, dtype=np.int32), rows=np.concatenate([step.rows, pad.rows]),
        sample_idx=np.arange(B, dtype=np.int32), num_decodes=bs, num_real_seqs=B)


# -- load-time profiling and warm-up ---------------------------------------------------------
def _profile_batch(pool: KVPool, table: PageTable, config: EngineConfig, vocab: int) -> ScheduledBatch:
    """A step as large as the budget allows: one decode plus prefills of up to max_model_len
    tokens, sampling with top-k and top-p (the widest sampler path)."""
    P, budget = pool.page_size, config.max_num_batched_tokens
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=0, want_logprobs=True,
                            logprobs=5, repetition_penalty=1.1)
    seqs, sizes = [], []
    dec = Sequence("warm-decode", [1, 2], params)
    dec.num_computed = 1
    seqs.append(dec)
    sizes.append(1)
    left = budget - 1
    while left > 0 and len(seqs) < config.max_num_seqs:
        n = min(left, config.max_model_len - 1)
        seqs.append(Sequence(f"warm-{len(seqs)}", [(7 * i) % vocab for i in range(n)], params))
        sizes.append(n)
        left -= n
    for s, n in zip(seqs, sizes):
        s.row = table.alloc_row()
        s.pages = pool.alloc(-(-(s.num_computed + n) // P))
        table.write(s.row, 0, s.pages)
    return ScheduledBatch(seqs, sizes, 1)


def profile_and_warm(model: LlamaModel, config: EngineConfig, triton: bool) -> int:
    """Run one widest step (a decode and prefills filling the token budget, then sampling
    max_num_seqs rows) on a throw-away KV pool: compiles every Triton kernel the engine will
    launch, and returns the step's peak activation bytes (CUDA; 0 elsewhere)."""
    cuda = torch.device(config.device).type == "cuda"
    cfg = model.cfg
    pages = -(-config.max_num_batched_tokens // config.page_size) + config.max_num_seqs + 2
    pool = KVPool(model.tp.local_config(cfg), pages, config.page_size, config.kv_torch_dtype, config.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    runner = ModelRunner(model, pool, config, triton)
    if model.tp.rank:  # a tensor-parallel follower runs its share of rank 0's profiling step
        order = model.tp.recv()
        if order[0] != "step":
            raise RuntimeError("tensor-parallel rank 0 stopped during the profiling step")
        runner.follow_step(*order[1:])
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        model.attn = None
        del runner, pool
        return int(peak)
    handle = runner.launch(_profile_batch(pool, runner.table, config, cfg.vocab_size))
    handle.result()
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    # the sampler at its widest: max_num_seqs rows through top-k / top-p
    n = config.max_num_seqs
    logits = torch.randn((n, cfg.vocab_size), dtype=torch.float32, device=config.device)
    seqs = handle.seqs[:1] * n
    sb = SamplingBatch.build([s.params for s in seqs], [[1]] * n, [1] * n, list(range(n)), [False] * n,
                             cfg.vocab_size, config.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        mid = torch.cuda.memory_allocated()
    sample(logits, sb).to_host(sb)
    if cuda:
        peak += torch.cuda.max_memory_allocated() - mid
    model.attn = None
    del runner, pool, handle, logits
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return int(peak)
