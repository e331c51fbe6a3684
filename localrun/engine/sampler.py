"""Sampling parameters and the batched sampler: one pass over the [batch, vocab] logits.

Order per row: penalties (repetition on prompt+output, presence/frequency on output),
then temperature, top-k, top-p, min-p, then a draw. Every step is a tensor operation over
the whole batch on the logits' device; the host builds the per-row parameters once per step
(`SamplingBatch.build`) and reads the results back once (`SampleOutput.to_host`).

The draw is an exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1), which picks i
with probability p_i / sum(p) (no normalisation, no cumulative sums). E comes from the
device's generator, except for seeded requests: their E is a counter-based hash of (seed,
output position, token id), so a seeded request draws the same tokens whatever it is
batched with, preempted or not. Greedy rows (temperature 0 or top_k 1) take the argmax.
With the Triton kernels, the plain temperature draws (no top-k / top-p / min-p, no seed) of a
batch of up to runner.FUSED_SAMPLING_ROWS rows (of every batch with EngineConfig.fused_sampling)
are one kernel: a Gumbel-max draw in one pass over the logits (kernels/sampling.py), the same
distribution; its seed comes from torch's (CPU) generator.
Logprobs are those of the model's raw distribution (before penalties and temperature), as
vLLM reports them. Rows with a grammar first get -inf on the tokens their bitmask disallows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localrun.kernels import ops as kernels


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
    grammar: object | None = None  # a compiled grammar.Grammar: only tokens it allows are sampled
    # each prompt token's logprob and this many alternatives (None: off). The whole prompt is computed
    # (the prefix cache keeps no logits); max_tokens 0 then scores the prompt and generates nothing
    prompt_logprobs: int | None = None
    keep_special: frozenset[int] = frozenset()  # special tokens whose text the output keeps (Tokenizer.kept_specials)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError("top_k must be >= 0 and min_p in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (0: the prompt scored, nothing generated)")
        if not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs (top alternatives) must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs (top alternatives) must be between 0 and 20")
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


# -- the seeded noise: a counter-based hash (integer ops that never overflow int64) -------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def seed_key(seed: int, position: int) -> int:
    """The 64-bit key of a seeded request's draw at an output position."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ position)


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab] (float32), a pure function of (key, token id)."""
    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    k1, k2 = (keys & _M32)[:, None], ((keys >> 32) & _M32)[:, None]
    x = _mix32((_mul32(idx, 0x9E3779B1) + k1) & _M32)
    x = _mix32(x ^ k2)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -torch.log(u)


# -- per-step inputs -----------------------------------------------------------------------
def to_device(data, dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device`: on a GPU through pinned memory, so the copy does not
    wait for the device."""
    t = torch.tensor(data, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


@dataclass
class Penalties:
    """Histories of the rows with penalties, as (row, token id) pairs; a pending last token (still
    on the device, the row's input this step) is added on the device."""

    rows: torch.Tensor  # int64 [P]: which sampling rows have penalties
    rep: torch.Tensor  # float [P]
    presence: torch.Tensor  # float [P]
    frequency: torch.Tensor  # float [P]
    seen_pairs: torch.Tensor  # int64 [2, N]: (penalty row, token) over the prompt+output window
    out_pairs: torch.Tensor  # int64 [2, M]: over the output window
    pending_rows: torch.Tensor | None  # int64: penalty rows whose last token is pending


@dataclass
class SamplingBatch:
    n: int
    all_greedy: bool
    greedy: torch.Tensor | None  # bool [n] (None: no greedy row)
    temperature: torch.Tensor | None  # float [n] (1.0 on greedy rows)
    top_k: torch.Tensor | None  # int64 [n], 0: off
    top_k_max: int
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeded_rows: torch.Tensor | None  # int64 [s]
    seed_keys: torch.Tensor | None  # int64 [s]
    penalties: Penalties | None
    logprob_rows: torch.Tensor | None  # int64 [l]
    logprob_rows_list: list[int]
    top_n: list[int]  # per logprob row: alternatives wanted
    mask_rows: torch.Tensor | None = None  # int64 [g]: rows constrained by a grammar (set after build)
    token_mask: torch.Tensor | None = None  # int32 [g, ceil(V/32)]: their allowed-token bitmasks
    fused: bool = False  # the runner sets it: plain temperature draws may use the one-pass kernel

    @property
    def plain_temperature(self) -> bool:
        """No row filters (top-k / top-p / min-p) or seeds: a draw from softmax(x / T) alone."""
        return self.top_k is None and self.top_p is None and self.min_p is None and self.seeded_rows is None

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[list[int]], prompt_lens: list[int],
              positions: list[int], pending: list[bool], vocab: int, device) -> "SamplingBatch":
        """One row per sampling sequence. histories: prompt + output token ids known on the host;
        positions: the output index of the token being drawn; pending: the row's last token is
        still on the device (it is the row's input this step, and counts for penalties)."""
        device = torch.device(device)
        n = len(params)
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        temp = top_k = top_p = min_p = seeded_rows = seed_keys = None
        kmax = 0
        if not all_greedy:
            temp = to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device)
            ks = [p.top_k if 0 < p.top_k < vocab and not g else 0 for p, g in zip(params, greedy)]
            kmax = max(ks)
            if kmax:
                top_k = to_device(ks, torch.int64, device)
            if any(p.top_p < 1.0 for p in params):
                top_p = to_device([p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32, device)
            if any(p.min_p > 0 for p in params):
                min_p = to_device([p.min_p for p in params], torch.float32, device)
            seeded = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
            if seeded:
                seeded_rows = to_device(seeded, torch.int64, device)
                keys = [seed_key(params[i].seed, positions[i]) for i in seeded]
                seed_keys = to_device([k - (1 << 64) if k >= 1 << 63 else k for k in keys], torch.int64, device)
        lp_rows = [i for i, p in enumerate(params) if p.needs_logprobs]
        return cls(
            n=n, all_greedy=all_greedy, greedy=to_device(greedy, torch.bool, device) if any(greedy) and not all_greedy else None,
            temperature=temp, top_k=top_k, top_k_max=kmax, top_p=top_p, min_p=min_p,
            seeded_rows=seeded_rows, seed_keys=seed_keys,
            penalties=_penalties(params, histories, prompt_lens, pending, device),
            logprob_rows=to_device(lp_rows, torch.int64, device) if lp_rows else None, logprob_rows_list=lp_rows,
            top_n=[params[i].logprobs for i in lp_rows],
        )


def _penalties(params, histories, prompt_lens, pending, device) -> Penalties | None:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return None
    seen_r, seen_t, out_r, out_t, pend = [], [], [], [], []
    for j, i in enumerate(rows):
        p, hist = params[i], histories[i]
        w = p.penalty_window if p.penalty_window > 0 else None  # None: the whole history
        if pending[i]:  # the pending token takes one place of the window
            pend.append(j)
            w = None if w is None else w - 1

        def window(seq: list[int]) -> list[int]:
            return seq if w is None else seq[len(seq) - w:] if w else []

        if p.repetition_penalty != 1.0:
            seen = set(window(hist))
            seen_r += [j] * len(seen)
            seen_t += seen
        if p.presence_penalty or p.frequency_penalty:
            o = window(hist[prompt_lens[i]:])
            out_r += [j] * len(o)
            out_t += o
    return Penalties(
        rows=to_device(rows, torch.int64, device),
        rep=to_device([params[i].repetition_penalty for i in rows], torch.float32, device),
        presence=to_device([params[i].presence_penalty for i in rows], torch.float32, device),
        frequency=to_device([params[i].frequency_penalty for i in rows], torch.float32, device),
        seen_pairs=to_device([seen_r, seen_t], torch.int64, device), out_pairs=to_device([out_r, out_t], torch.int64, device),
        pending_rows=to_device(pend, torch.int64, device) if pend else None,
    )


def _apply_penalties(logits: torch.Tensor, pen: Penalties, last_tokens: torch.Tensor | None) -> torch.Tensor:
    x = logits[pen.rows]  # [P, V] copy
    P, V = x.shape
    seen = torch.zeros((P, V), dtype=torch.bool, device=x.device)
    counts = torch.zeros((P, V), dtype=x.dtype, device=x.device)
    seen[pen.seen_pairs[0], pen.seen_pairs[1]] = True
    counts.index_put_((pen.out_pairs[0], pen.out_pairs[1]), torch.ones_like(pen.out_pairs[0], dtype=x.dtype),
                      accumulate=True)
    if pen.pending_rows is not None and last_tokens is not None:
        toks = last_tokens[pen.rows[pen.pending_rows]].long()
        seen[pen.pending_rows, toks] = True
        counts.index_put_((pen.pending_rows, toks), torch.ones_like(toks, dtype=x.dtype), accumulate=True)
    rp = pen.rep[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)
    out = logits.clone()
    out[pen.rows] = x
    return out


# -- the sampler -----------------------------------------------------------------------------
@dataclass
class SampleOutput:
    tokens: torch.Tensor  # int64 [n] (device)
    lp_chosen: torch.Tensor | None = None  # float [l]
    lp_top_values: torch.Tensor | None = None  # float [l, k]
    lp_top_ids: torch.Tensor | None = None  # int64 [l, k]
    _host: tuple | None = None
    _event: object = None

    def start_copy(self) -> None:
        """Start the device-to-host copy of everything the host needs (non-blocking on CUDA)."""
        self._host, self._event = start_host_copy((self.tokens, self.lp_chosen, self.lp_top_values, self.lp_top_ids))

    def to_host(self, batch: SamplingBatch) -> tuple[list[int], list]:
        """(tokens, per row (logprob, [(id, logprob)...]) or None): the step's one host sync."""
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        tokens, chosen, top_v, top_i = self._host
        tokens = tokens.tolist()
        logprobs: list = [None] * batch.n
        if chosen is not None:
            chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
            for j, (i, k) in enumerate(zip(batch.logprob_rows_list, batch.top_n)):
                logprobs[i] = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return tokens, logprobs


def start_host_copy(parts: tuple) -> tuple[tuple, object]:
    """(the tensors on the host, an event to wait on before reading them, or None): on a GPU each
    copy is queued without waiting for the device; on the CPU the tensors are the host's already.
    None parts stay None."""
    if all(t is None or t.device.type == "cpu" for t in parts):
        return parts, None
    host = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in parts)
    event = torch.cuda.Event()
    event.record()
    return host, event


def filtered_probs(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled probabilities [n, V] after top-k / top-p / min-p (not renormalised)."""
    x = x / b.temperature[:, None]
    if b.top_k is not None:
        kth = torch.topk(x, b.top_k_max, dim=-1).values.gather(1, (b.top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(b.top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if b.top_p is not None:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) > b.top_p[:, None]  # keep the smallest set whose mass reaches top_p
        probs = probs.scatter(1, si, sp.masked_fill(drop, 0.0))
    if b.min_p is not None:
        probs = probs.masked_fill(probs < b.min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def sample(logits: torch.Tensor, b: SamplingBatch, last_tokens: torch.Tensor | None = None) -> SampleOutput:
    """logits [n, V] float32 -> SampleOutput (device tensors; no host sync here).

    last_tokens [n]: each row's input token this step (needed only when a penalty row's last
    token is still pending on the device)."""
    out = SampleOutput(tokens=torch.empty(0))
    if b.logprob_rows is not None:
        lp = torch.log_softmax(logits[b.logprob_rows], dim=-1)
    if b.token_mask is not None:  # grammar rows: disallowed tokens never drawn (logprobs stay raw)
        from localrun.structured.masks import apply_token_mask

        logits = apply_token_mask(logits, b.mask_rows, b.token_mask)
    x = logits if b.penalties is None else _apply_penalties(logits, b.penalties, last_tokens)
    if b.all_greedy:
        tokens = x.argmax(dim=-1)
    elif b.fused and b.plain_temperature:  # one pass over the logits (kernels/sampling.py)
        temp = b.temperature if b.greedy is None else b.temperature.masked_fill(b.greedy, 0.0)
        tokens = kernels.sample_temperature(x, temp, int(torch.randint(0, 0x7FFFFFFF, (1,))))
    else:
        probs = filtered_probs(x, b)
        noise = torch.empty_like(probs).exponential_()
        if b.seeded_rows is not None:
            noise[b.seeded_rows] = seeded_exponential(b.seed_keys, probs.shape[1])
        tokens = (probs / noise).argmax(dim=-1)
        if b.greedy is not None:
            tokens = torch.where(b.greedy, x.argmax(dim=-1), tokens)
    out.tokens = tokens
    if b.logprob_rows is not None:
        out.lp_chosen = lp.gather(1, tokens[b.logprob_rows][:, None])[:, 0]
        k = max(max(b.top_n), 1)
        out.lp_top_values, out.lp_top_ids = lp.topk(k, dim=-1)
    return out
