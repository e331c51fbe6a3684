"""Speculative decoding: propose a few next tokens cheaply, verify them in one target step.

A decoding sequence with a draft of k tokens is scheduled with 1 + k tokens (its last token
and the draft, like an extend chunk); the target samples at every one of those positions,
each row with the request's own sampling transform (penalties, temperature, top-k/p, min-p)
over the history it would have if the draft so far is right, and with the same noise the
non-speculative sampler would draw at that output position (seeded rows: the same
counter-based hash). The longest prefix where draft == the sampled token is accepted, plus
the token sampled at the first mismatch (or after the whole draft).

That is exact: drafts here are a point mass q (n-gram lookup, or a draft model's greedy
choice), and with the exponential race a token is x with probability p(x); when it is not x
it is distributed as p with x removed, renormalised - rejection sampling's accept test and
residual, with shared noise. So greedy output is identical with and without speculation,
and so is a seeded request's; unseeded ones have the same distribution. Logprobs are those
of the target at each accepted position. Rows with a grammar (constrained decoding) get no
draft.

The engine runs serially while speculation is on (a verification needs the previous step's
tokens on the host); KV written for rejected draft positions is simply overwritten later
(num_computed is rolled back; the pages stay with the sequence).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch

from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.kv.pool import KVPool
from localrun.engine.layers.attention import use_triton
from localrun.engine.models import build_model
from localrun.engine.models.loader import recipe_source
from localrun.engine.runner import ModelRunner, StepHandle
from localrun.engine.sampler import SamplingBatch, SamplingParams, sample
from localrun.engine.scheduler import RUNNING, ScheduledBatch, Scheduler, Sequence

log = logging.getLogger("localrun.engine")



def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from max_n down to min_n); [] when none matches. O(len * n)."""
    a = np.asarray(tokens, dtype=np.int64)
    L = len(a)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(a[:-1], n)  # starts 0..L-1-n: never the suffix itself
        hits = np.flatnonzero((windows == a[L - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return a[i:i + k].tolist()
    return []


class StepOwner(Protocol):
    """What speculative decoding uses of the engine that owns it (LLMEngine; it imports nothing of it)."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    timings: dict
    pool: KVPool
    runner: ModelRunner
    scheduler: Scheduler

    def schedule_batch(self) -> ScheduledBatch | None: ...

    def launch_batch(self, batch: ScheduledBatch) -> StepHandle: ...

    def handle_step(self, handle: StepHandle) -> None: ...

    def on_token(self, seq: Sequence, tok: int, lp, now: float) -> bool: ...


class SpecDecoder:
    """The engine's step while speculation is on: draft, schedule, verify, emit."""

    def __init__(self, engine: StepOwner) -> None:
        self.engine = engine
        cfg = engine.config
        self.mode = cfg.speculative
        self.k = cfg.num_speculative_tokens
        self.min_n, self.max_n = cfg.ngram_min, cfg.ngram_max
        self.steps = 0  # steps that verified at least one draft
        self.verified_rows = 0  # (sequence, step) pairs that verified a draft
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.emitted_tokens = 0  # tokens produced by verified rows (accepted + one each)
        self.drafter = DraftModel(engine) if self.mode == "draft" else None

    # -- drafting ----------------------------------------------------------------------------
    def _candidates(self) -> list:
        eng = self.engine
        out = []
        for seq in eng.scheduler.running:
            if seq.status != RUNNING or seq.num_pending or len(seq.token_ids) - seq.num_computed != 1:
                continue
            p = seq.params
            if p.grammar is not None:
                continue  # constrained rows: the grammar, not the target alone, decides the next token
            room = min(self.k, p.max_tokens - seq.num_output - 1,
                       eng.config.max_model_len - len(seq.token_ids) - 1)
            if room > 0:
                out.append((seq, room))
        return out

    def propose(self) -> None:
        cands = self._candidates()
        # every draft token is a sampled row of the step (its buffers hold max_samples): the
        # drafts share what the running sequences leave free
        left = self.engine.runner.buffers.max_samples - len(self.engine.scheduler.running)
        if self.drafter is not None:
            capped = []
            for seq, room in cands:
                if left <= 0:
                    break
                capped.append((seq, min(room, left)))
                left -= capped[-1][1]
            self.drafter.propose(capped)
            return
        for seq, room in cands:
            if left <= 0:
                break
            d = propose_ngram(seq.token_ids, min(room, left), self.min_n, self.max_n)
            seq.draft = d
            left -= len(d)

    # -- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        eng = self.engine
        self.propose()
        try:
            batch = eng.schedule_batch()
            if batch is None:
                return
            if not batch.num_spec:  # nothing to verify: the engine's plain (serial) step
                eng.handle_step(eng.launch_batch(batch))
                return
            self._verify(batch)
        finally:
            for seq in eng.scheduler.running:
                seq.draft = []

    def _verify(self, batch) -> None:
        eng, runner = self.engine, self.engine.runner
        step, rows, _ = runner.host_step(batch)
        starts = {id(s): s.num_computed for s in batch.seqs}
        logits, _, _, rows = runner.forward_sampling(batch, step, None, rows)
        params, hists, plens, positions = [], [], [], []
        j = 0
        for r, seq in enumerate(rows):
            j = j + 1 if r and rows[r - 1] is seq else 0  # position within the sequence's group
            params.append(seq.params)
            hists.append(seq.token_ids + seq.draft[:j] if seq.params.has_penalties else [])
            plens.append(seq.prompt_len)
            positions.append(seq.num_output + j)
        sb = SamplingBatch.build(params, hists, plens, positions, [False] * len(rows), eng.model_config.vocab_size,
                                 eng.device)
        if any(seq.matcher is not None for seq in rows):  # grammar rows (never drafted): their masks
            runner.grammar_masks(StepHandle(rows, None, sb))
        out = sample(logits, sb, None)
        eng.scheduler.update(batch)
        tokens, lps = out.to_host(sb)
        now = time.perf_counter()
        self.steps += 1
        r = 0
        while r < len(rows):
            seq = rows[r]
            start = starts.get(id(seq))  # None: a group follower forked this step
            draft = seq.draft if start is not None and len(seq.token_ids) - start == 1 else []
            m = 1 + len(draft)
            toks, lp = tokens[r:r + m], lps[r:r + m]
            r += m
            a = 0
            while a < len(draft) and toks[a] == draft[a]:
                a += 1
            if draft:
                # KV is right up to the last accepted draft token; the rest is overwritten later
                seq.num_computed = starts[id(seq)] + 1 + a
                seq.spec_draft_tokens += len(draft)
                seq.spec_accepted_tokens += a
                self.verified_rows += 1
                self.draft_tokens += len(draft)
                self.accepted_tokens += a
                self.emitted_tokens += a + 1
            for t, l in zip(toks[:a + 1], lp[:a + 1]):
                seq.token_ids.append(t)
                if not eng.on_token(seq, t, l, now) or seq.finish_reason:
                    break

    def stats(self) -> dict:
        return {"speculative": self.mode, "spec_steps": self.steps, "spec_verified_rows": self.verified_rows,
                "spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                "spec_tokens_per_row_step": self.emitted_tokens / self.verified_rows if self.verified_rows else 0.0}


# -- a draft model ---------------------------------------------------------------------------
def draft_recipe(spec) -> tuple:
    """EngineConfig.draft_model -> a model recipe: a recipe tuple as is; 'random:SHAPE[:SEED]';
    a directory (safetensors); else a GGUF file."""
    if isinstance(spec, tuple):
        return spec
    from pathlib import Path

    text = str(spec)
    if text.startswith("random:"):
        _, shape, *seed = text.split(":")
        return ("random", shape, int(seed[0]) if seed else 0)
    p = Path(text).expanduser()
    if p.is_dir():
        return ("safetensors", str(p))
    if p.is_file():
        return ("gguf", str(p))
    raise ValueError(f"draft_model {text!r} is neither a GGUF file, a safetensors directory nor random:SHAPE[:SEED]")


def load_draft_model(recipe: tuple, config):
    """The draft's model (one rank, the engine's dtype and device), built and filled as the
    engine builds its own."""
    mcfg, fill, _ = recipe_source(recipe, config)
    model = build_model(mcfg, config)
    fill(model)
    return model, mcfg


class DraftModel:
    """A small model of the same tokenizer with its own KV pool: for each drafting sequence a
    shadow sequence mirrors its tokens (KV of the common prefix is kept across steps; rejected
    draft positions are recomputed); it catches up on the new tokens and then decodes k tokens
    greedily, batched over the sequences."""

    def __init__(self, engine: StepOwner) -> None:
        cfg = engine.config
        t = time.perf_counter()
        triton = use_triton(cfg.device, cfg.use_triton)
        self.model, self.model_config = load_draft_model(draft_recipe(cfg.draft_model), cfg)
        vocab = engine.model_config.vocab_size
        if self.model_config.vocab_size != vocab:
            raise ValueError(f"the draft model's vocabulary has {self.model_config.vocab_size} tokens, the model's "
                             f"{vocab}: a draft model must share the tokenizer")
        # as many tokens as the target's pool (the draft's pages are smaller)
        self.pool = KVPool(self.model_config, engine.pool.num_pages, cfg.page_size, cfg.kv_torch_dtype, cfg.device)
        self.runner = ModelRunner(self.model, self.pool, cfg, triton)
        self.P, self.budget = cfg.page_size, cfg.max_num_batched_tokens
        self.shadows: dict[str, tuple[Sequence, Sequence]] = {}  # id -> (target, shadow)
        self.greedy = SamplingParams(temperature=0, max_tokens=1 << 30)
        engine.timings["draft_model_s"] = time.perf_counter() - t
        log.info("draft model: %d layers, hidden %d, KV pool %d pages (%.1f MiB)", self.model_config.num_layers,
                 self.model_config.hidden_size, self.pool.num_pages, self.pool.nbytes / 2**20)

    def _drop(self, key: str) -> None:
        _, sh = self.shadows.pop(key)
        self.pool.decref(sh.pages)
        self.runner.table.free_row(sh.row)

    def _shadow(self, seq: Sequence, room: int) -> Sequence | None:
        t = seq.token_ids
        entry = self.shadows.get(seq.id)
        if entry is not None and entry[0] is not seq:
            self._drop(seq.id)
            entry = None
        if entry is None:
            if not self.runner.table.num_free_rows:
                return None
            sh = Sequence(seq.id, t, self.greedy)
            sh.row = self.runner.table.alloc_row()
            sh.base = len(t)
            self.shadows[seq.id] = (seq, sh)
        else:
            sh = entry[1]
            n, end = sh.base, min(len(sh.token_ids), len(t))
            while n < end and sh.token_ids[n] == t[n]:  # the accepted part of its last draft
                n += 1
            del sh.token_ids[n:]
            sh.token_ids.extend(t[n:])
            sh.num_computed = min(sh.num_computed, n, len(t) - 1)
            sh.base = len(t)
        need = -(-(len(t) + room) // self.P) - len(sh.pages)
        if need > 0:
            if self.pool.num_free < need:
                self._drop(seq.id)
                return None
            got = self.pool.alloc(need)
            self.runner.table.write(sh.row, len(sh.pages), got)
            sh.pages += got
        return sh

    @torch.inference_mode()
    def propose(self, cands: list) -> None:
        live = {s.id for s, _ in cands}
        for key, (target, _) in list(self.shadows.items()):
            if key not in live and target.status != RUNNING:
                self._drop(key)
        work = []
        for seq, room in cands:
            sh = self._shadow(seq, room)
            if sh is not None:
                work.append((seq, sh, room))
        if not work:
            return
        # catch up on the new tokens (chunked to the step budget); the last chunk drafts token 1
        pending = list(work)
        while pending:
            seqs, sizes, left = [], [], self.budget
            for _, sh, _ in pending:
                if left <= 0:
                    break
                n = min(len(sh.token_ids) - sh.num_computed, left)
                seqs.append(sh)
                sizes.append(n)
                left -= n
            self._run(ScheduledBatch(seqs, sizes, 0))
            pending = [w for w in pending if len(w[1].token_ids) - w[1].base < 1]
        # then greedy decodes, batched, for the sequences that want more
        for i in range(1, max(room for _, _, room in work)):
            active = [sh for _, sh, room in work if room > i]
            self._run(ScheduledBatch(active, [1] * len(active), len(active)))
        for seq, sh, room in work:
            seq.draft = sh.token_ids[sh.base:sh.base + room]

    def _run(self, batch: ScheduledBatch) -> None:
        handle = self.runner.launch(batch)
        for sh, n in zip(batch.seqs, batch.num_tokens):
            sh.num_computed += n
        tokens, _ = handle.result()
        for sh, tok in zip(handle.seqs, tokens):
            sh.token_ids.append(tok)
