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

import time

import numpy as np
import torch

from localrun.engine.sampler import SamplingBatch, sample

SPECULATIVE_MODES = ("off", "ngram", "draft")


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


class SpecDecoder:
    """The engine's step while speculation is on: draft, schedule, verify, emit."""

    def __init__(self, engine) -> None:
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

    # -- drafting ----------------------------------------------------------------------------
    def _candidates(self) -> list:
        eng = self.engine
        out = []
        for seq in eng.scheduler.running:
            if seq.status != "running" or seq.num_pending or len(seq.token_ids) - seq.num_computed != 1:
                continue
            p = seq.params
            if getattr(p, "grammar", None) is not None:
                continue  # constrained rows: the grammar, not the target alone, decides the next token
            room = min(self.k, p.max_tokens - seq.num_output - 1,
                       eng.config.max_model_len - len(seq.token_ids) - 1)
            if room > 0:
                out.append((seq, room))
        return out

    def propose(self) -> None:
        cands = self._candidates()
        # the step's sampled rows live in buffers of max_num_seqs entries: the drafts share what
        # the running sequences leave free
        left = self.engine.config.max_num_seqs - len(self.engine.scheduler.running)
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
        sched, runner = eng.scheduler, eng.runner
        self.propose()
        try:
            batch = sched.schedule()
            if eng.host_pool is not None:
                eng.host_pool.flush()
            for seq in sched.take_finished():
                eng._finish(eng._requests[seq.id], seq.finish_reason, release=False)
            if batch is None:
                return
            if not batch.num_spec:  # nothing to verify: the engine's plain step
                handle = runner.launch(batch)
                sched.update(batch)
                handle.positions = [seq.add_pending(row) for row, seq in enumerate(handle.seqs)]
                eng._handle(handle)
                return
            self._verify(batch)
        finally:
            for seq in sched.running:
                seq.draft = []

    def _verify(self, batch) -> None:
        eng, runner = self.engine, self.engine.runner
        step, rows, _ = runner.host_step(batch)
        starts = {id(s): s.num_computed for s in batch.seqs}
        logits, _ = runner._forward(step, None)
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
        out = sample(logits, sb, None)
        eng.scheduler.update(batch)
        tokens, lps = out.to_host(sb)
        now = time.perf_counter()
        self.steps += 1
        r = 0
        while r < len(rows):
            seq = rows[r]
            draft = seq.draft if len(seq.token_ids) - starts[id(seq)] == 1 else []
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
                req = eng._requests.get(seq.id)
                if req is None or req.seq is not seq or seq.finish_reason:
                    break
                eng._on_token(req, t, l, now)
                if seq.finish_reason:
                    break

    def stats(self) -> dict:
        return {"speculative": self.mode, "spec_steps": self.steps, "spec_verified_rows": self.verified_rows,
                "spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                "spec_tokens_per_row_step": self.emitted_tokens / self.verified_rows if self.verified_rows else 0.0}
