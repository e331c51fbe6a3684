"""Sampling parameters and the batched sampler.

Order per row: penalties (repetition on prompt+output, presence/frequency on output),
then temperature, top-k, top-p, min-p, then a draw with the request's own generator
(seeded requests are reproducible whatever they are batched with). Logprobs are those of
the model's raw distribution (before penalties and temperature), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM style: logit>0 ? logit/p : logit*p, over prompt + output
    presence_penalty: float = 0.0  # OpenAI style, over the output so far
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0  # top-n alternatives per token; <0: none. 0 with want_logprobs: chosen only
    want_logprobs: bool = False  # report the chosen token's logprob even when logprobs == 0
    penalty_window: int = -1  # penalties look at the last N tokens only (-1: all)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError("top_k must be >= 0 and min_p in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs (top alternatives) must be between 0 and 20")
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_logprobs(self) -> bool:
        return self.want_logprobs or self.logprobs > 0


def _apply_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> None:
    w = p.penalty_window
    out = output[-w:] if w > 0 else output
    if p.repetition_penalty != 1.0:
        hist = (prompt + output)[-w:] if w > 0 else prompt + output
        ids = torch.tensor(sorted(set(hist)), dtype=torch.long, device=row.device)
        if len(ids):
            v = row[ids]
            row[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled probabilities after top-k / top-p / min-p."""
    row = row / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        drop = (sp.cumsum(-1) - sp) > p.top_p  # keep the smallest set whose mass reaches top_p
        probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
           outputs: list[list[int]], generators: list[torch.Generator | None]):
    """logits [n, V] float32 -> (token ids, per-row (logprob, [(id, logprob)...]) or None)."""
    n = logits.shape[0]
    logprobs: list = [None] * n
    if any(p.needs_logprobs for p in params):
        lp = torch.log_softmax(logits, dim=-1)
        for i, p in enumerate(params):
            if p.needs_logprobs:
                logprobs[i] = lp[i]
    if all(p.greedy and not p.has_penalties for p in params):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = []
        for i, p in enumerate(params):
            row = logits[i].clone() if p.has_penalties else logits[i]
            if p.has_penalties:
                _apply_penalties(row, p, prompts[i], outputs[i])
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            probs = _filter(row, p)
            tokens.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    for i, lp_row in enumerate(logprobs):
        if lp_row is not None:
            top = []
            if params[i].logprobs > 0:
                v, ix = lp_row.topk(params[i].logprobs)
                top = list(zip(ix.tolist(), v.tolist()))
            logprobs[i] = (float(lp_row[tokens[i]]), top)
    return tokens, logprobs
