"""Temperature sampling in one pass over the logits (Triton): a Gumbel-max draw.

token = argmax_i(x_i / T + G_i), G_i = -log(-log U_i), U_i uniform (Philox, tl.rand): the same
distribution as drawing from softmax(x / T) (the exponential race argmax(p_i / E_i) the torch
sampler runs is this with E_i = -log U_i), but one read of the logits instead of the five
passes (divide, softmax, noise, divide, argmax) over [batch, vocab] fp32 that the torch path
makes. Rows with temperature 0 take the argmax. Top-k / top-p / min-p and seeded rows stay on
the torch path (engine/sampler.py decides).

Grid (rows, vocab chunks): each program keeps a running best per lane over its chunk and
writes the chunk's best value and index; the host picks each row's best chunk (a [rows,
chunks] argmax). The random stream is a function of (seed, row * vocab + token id), so the
same seed gives the same tokens. Same distribution as reference.sample_temperature_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, interpreting


@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(Logits, Temp, OutVal, OutIdx, stride_l, vocab, seed,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(Temp + row)
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)
    noise = t > 0  # temperature 0: greedy, no noise
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + lanes
        mask = cols < vocab
        x = tl.load(Logits + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * vocab + cols)  # [0, 1): u = 0 gives -inf (never drawn)
        g = -tl.log(-tl.log(u))
        s = tl.where(noise, x * inv_t + g, x)
        s = tl.where(mask, s, float("-inf"))
        take = s > best_v
        best_v = tl.where(take, s, best_v)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best_v, axis=0)
    # the lowest token id among the lanes at the maximum (ties: as torch.argmax)
    idx = tl.min(tl.where(best_v == m, best_i, 2147483647), axis=0)
    nchunks = tl.num_programs(1)
    tl.store(OutVal + row * nchunks + chunk, m)
    tl.store(OutIdx + row * nchunks + chunk, idx)


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [n, V] (any float dtype), temperature float32 [n] (0: greedy row), seed: an int
    (a new one each call) -> token ids int64 [n]. No host sync."""
    n, vocab = logits.shape
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = inner_contiguous(logits)
    if interpreting():
        block, chunk = 256, 1024
    else:
        block, chunk = 1024, 8192
    chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(n, chunks)](
        logits, temperature, vals, idx, logits.stride(0), vocab, int(seed) & 0x7FFFFFFF,
        CHUNK=chunk, BLOCK=block, num_warps=4,
    )
    if chunks == 1:
        return idx[:, 0].long()
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0].long()
