"""The mixture-of-experts layer's experts in Triton: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]).

The design of vLLM's and SGLang's fused_moe (`moe_align_block_size` + `fused_moe_kernel`):

1. Alignment (`_align_kernel`, one program): the T*k (token, slot) pairs are sorted by expert and
   each expert's run padded to a multiple of BLOCK_M, so that a block of BLOCK_M rows belongs to one
   expert. `sorted_ids[p]` is the flat pair index t*k+j at padded position p (T*k for a padding
   row) and `block_expert[b]` the expert of block b (E or more: a block past the end, which exits).
   The padded length is bounded by T*k + min(E, T*k) * (BLOCK_M - 1), which sizes the buffers and
   the grids from shapes alone: no host sync, so a decode step captures in a CUDA graph. Counting
   is by comparison against every expert ([CHUNK, E] tiles): no sort, one launch; one program walks
   the pairs, so past ALIGN_KERNEL_MAX_PAIRS (prefill) torch's sort and sums do it instead.
2. `_up_kernel`, grid (blocks, I / BLOCK_N1): x's rows of the block (gathered by token) times the
   expert's gate and up rows of w13 (+ bias), in two fp32 accumulators, and the activation (SiLU(gate)
   * up, or gpt-oss's clamped SwiGLU) fused: act [padded rows, I] in x's dtype.
3. `_down_kernel`, grid (blocks, H / BLOCK_N2): act's rows times w2[e]^T (+ bias), times the routing
   weight, stored in fp32 at the pair's row of a [T*k, H] buffer; `_sum_k_kernel` adds a token's k rows
   in fp32 and writes x's dtype (deterministic: no atomics; one launch). Long prefills run in chunks of tokens, so that buffer stays
   near CHUNK_FLOATS.

Tiles follow the tokens per expert (T*k/E): BLOCK_M 16 at decode (a step reads each routed expert's
weights once; vLLM's tuned H100 table for E=128, N=768 uses BLOCK_M 16 up to 128 tokens), 32-64 in
prefill. Weights are read as [BLOCK_K, BLOCK_N] tiles of rows contiguous over K, with the column
index wrapped (% N) so the inner loop needs no column mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import dot_precision, inner_contiguous, interpreting, next_pow2
from .attn_common import mma
from .moe_reference import ACTIVATIONS

CHUNK_FLOATS = 1 << 25  # the fp32 [chunk*k, H] buffer of a chunk: 128 MiB at most (unless k*H alone is bigger)
ALIGN_KERNEL_MAX_PAIRS = 256  # token-expert pairs up to which the one-program alignment runs (a decode step)


class MoEConfig(NamedTuple):
    block_m: int  # rows (token-expert pairs) of a block, all one expert's
    block_n1: int  # columns of gate (and as many of up) per program of the up kernel
    block_n2: int  # output columns per program of the down kernel
    block_k: int
    num_warps: int
    num_stages: int


def config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoEConfig:
    """The tiles for a call on num_tokens tokens, from the tokens each expert gets on average."""
    if interpreting():  # one program at a time, in numpy: few, wide programs (tiny test shapes)
        return MoEConfig(16, max(16, min(64, next_pow2(inter))), max(16, min(64, next_pow2(hidden))),
                         max(16, min(64, next_pow2(min(hidden, inter)))), 1, 1)
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        if num_tokens <= 16:  # decode: many narrow programs stream the routed experts' weights
            return MoEConfig(16, 32, 64, 128, 4, 4)
        return MoEConfig(16, 64, 128, 128, 4, 3)
    if per_expert <= 48:
        return MoEConfig(32, 64, 128, 64, 4, 3)
    return MoEConfig(64, 64, 128, 64, 8, 3)


@triton.jit(do_not_specialize=["TK", "NUM_BLOCKS"])
def _align_kernel(Ids, SortedIds, BlockExpert, TK, NUM_BLOCKS,
                  BLOCK_M: tl.constexpr, EP: tl.constexpr, CHUNK: tl.constexpr):
    """One program: counts per expert, padded offsets, each pair's padded position (its rank among
    the pairs of its expert, in pair order), the padding rows, and each block's expert."""
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for t0 in range(0, TK, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        ids = tl.load(Ids + t, mask=t < TK, other=-1)
        counts += tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    total = tl.sum(padded, axis=0)
    seen = tl.zeros([EP], dtype=tl.int32)
    for t0 in range(0, TK, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        ids = tl.load(Ids + t, mask=t < TK, other=-1)
        hit = (ids[:, None] == ex[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit + seen[None, :]  # earlier pairs of the same expert
        dest = tl.sum(hit * (pstart[None, :] + rank), axis=1)
        tl.store(SortedIds + dest, t, mask=(t < TK) & (tl.sum(hit, axis=1) > 0))  # (an id outside [0, E): dropped)
        seen += tl.sum(hit, axis=0)
    for p0 in range(0, total, CHUNK):  # the padding rows: inside no expert's run of real pairs
        p = p0 + tl.arange(0, CHUNK)
        inside = (p[:, None] >= pstart[None, :]) & (p[:, None] < (pstart + counts)[None, :])
        real = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(SortedIds + p, p * 0 + TK, mask=(p < total) & (real == 0))
    for b0 in range(0, NUM_BLOCKS, CHUNK):  # a block's expert: the number of experts ending at or before it
        b = b0 + tl.arange(0, CHUNK)
        e = tl.sum((pend[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + b, e, mask=b < NUM_BLOCKS)


@triton.jit
def _activate(gate, up, ACT: tl.constexpr, alpha, limit):
    """fp32 [M, N] gate and up -> SiLU(gate) * up (ACT 0), or gpt-oss's clamped SwiGLU (ACT 1)."""
    if ACT == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["TK"])
def _up_kernel(X, W13, B13, SortedIds, BlockExpert, Act, TK, num_experts, K, INTER,
               stride_xm, stride_we, stride_wn, stride_be, stride_am, alpha, limit,
               TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:  # past the last expert's padded run
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + rows)
    real = pair < TK
    tok = (pair // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + tok[:, None] * stride_xm + rk[None, :]
    g_ptrs = W13 + e.to(tl.int64) * stride_we + (rn % INTER).to(tl.int64)[None, :] * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=real[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = rk < K - k0
            a = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g += mma(a, g, PRECISION)
        acc_u += mma(a, u, PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_row = B13 + e.to(tl.int64) * stride_be + rn % INTER
        acc_g += tl.load(b_row).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + INTER).to(tl.float32)[None, :]
    h = _activate(acc_g, acc_u, ACT, alpha, limit)
    a_ptrs = Act + rows.to(tl.int64)[:, None] * stride_am + rn[None, :]
    tl.store(a_ptrs, h.to(Act.dtype.element_ty), mask=(rn < INTER)[None, :])


@triton.jit(do_not_specialize=["TK"])
def _down_kernel(Act, W2, B2, SortedIds, BlockExpert, TopkW, Out, TK, num_experts, N, K,
                 stride_am, stride_we, stride_wn, stride_be, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + rows)
    real = pair < TK
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = Act + rows.to(tl.int64)[:, None] * stride_am + rk[None, :]
    w_ptrs = W2 + e.to(tl.int64) * stride_we + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc += mma(a, w, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B2 + e.to(tl.int64) * stride_be + rn % N).to(tl.float32)[None, :]
    acc = acc * tl.load(TopkW + pair, mask=real, other=0.0)[:, None]
    o_ptrs = Out + pair.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, acc, mask=real[:, None] & (rn < N)[None, :])


@triton.jit
def _sum_k_kernel(Parts, Out, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Out[t] = sum of Parts[t*k : t*k + k] (fp32), in Out's dtype: the sum over a token's k experts."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Parts + (t * TOP_K + j) * N + cols, mask=ok, other=0.0)
    tl.store(Out + t * N + cols, acc.to(Out.dtype.element_ty), mask=ok)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [padded], block_expert int32 [padded / block_m]) for flat pairs sorted by
    expert, each expert's run padded to block_m (see the module docstring); sizes from shapes alone.
    Up to ALIGN_KERNEL_MAX_PAIRS pairs (decode) one launch of _align_kernel; more (prefill) a handful of
    torch ops (a stable sort, sums, a search), which spread over the GPU where the one program would not."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tk = ids.numel()
    num_blocks = triton.cdiv(tk + min(num_experts, tk) * (block_m - 1), block_m)
    if tk > ALIGN_KERNEL_MAX_PAIRS:
        return _align_torch(ids, num_experts, block_m, num_blocks)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    ep = max(16, next_pow2(num_experts))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, tk, num_blocks, BLOCK_M=block_m, EP=ep,
                        CHUNK=max(16, 4096 // ep), num_warps=4)
    return sorted_ids, block_expert


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_align_kernel's result from torch ops, none of which syncs with the host (no bincount: it reads the
    largest id on the host). An id outside [0, E) is dropped, as the kernel drops it."""
    tk, dev = ids.numel(), ids.device
    ids64 = ids.long()
    valid = (ids64 >= 0) & (ids64 < num_experts)
    key = torch.where(valid, ids64, num_experts)  # the dropped ones sort last, into a bin of their own
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    pend = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    e = key[order]
    rank = torch.arange(tk, device=dev) - (counts.cumsum(0) - counts)[e]
    dest = torch.where(e < num_experts, pend[e] - padded[e] + rank, num_blocks * block_m)  # dropped: the spare slot
    sorted_ids = torch.full((num_blocks * block_m + 1,), tk, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pend[:num_experts], starts, right=True).to(torch.int32)
    return sorted_ids[:-1], block_expert


def _check(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if H != x.shape[1] or two_i % 2 or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"fused_moe: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T, k] with T = {x.shape[0]}")
    for name, b, want in (("w13_bias", w13_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if b is not None and tuple(b.shape) != want:
            raise ValueError(f"fused_moe: {name} must be {want}, got {tuple(b.shape)}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
              cfg: MoEConfig | None = None) -> torch.Tensor:
    """kernels/moe_reference.fused_moe_ref's result: [T, H] in x's dtype. `cfg` overrides the tiles."""
    _check(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    T, H = x.shape
    E, I, k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if T == 0 or k == 0:
        return torch.zeros_like(x)
    chunk = max(1, CHUNK_FLOATS // (k * H))
    if T > chunk:
        kw = dict(activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, alpha=alpha, limit=limit, cfg=cfg)
        return torch.cat([fused_moe(x[s:s + chunk], w13, w2, topk_weights[s:s + chunk], topk_ids[s:s + chunk], **kw)
                          for s in range(0, T, chunk)])
    x, w13, w2 = inner_contiguous(x), inner_contiguous(w13), inner_contiguous(w2)
    b13 = inner_contiguous(w13_bias) if w13_bias is not None else None
    b2 = inner_contiguous(w2_bias) if w2_bias is not None else None
    c = cfg or config(T, k, E, H, I)
    sorted_ids, block_expert = align(topk_ids, E, c.block_m)
    nb, tk = block_expert.numel(), T * k
    precision = dot_precision(x.dtype)
    act = torch.empty((sorted_ids.numel(), I), dtype=x.dtype, device=x.device)
    _up_kernel[(nb, triton.cdiv(I, c.block_n1))](
        x, w13, b13 if b13 is not None else w13, sorted_ids, block_expert, act, tk, E, H, I,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, act.stride(0),
        float(alpha), float(limit), TOP_K=k, BLOCK_M=c.block_m, BLOCK_N=c.block_n1, BLOCK_K=c.block_k,
        EVEN_K=H % c.block_k == 0, HAS_BIAS=b13 is not None, ACT=ACTIVATIONS.index(activation), PRECISION=precision,
        num_warps=c.num_warps, num_stages=c.num_stages)
    out = torch.empty((tk, H), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(nb, triton.cdiv(H, c.block_n2))](
        act, w2, b2 if b2 is not None else w2, sorted_ids, block_expert, weights, out, tk, E, H, I,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0, out.stride(0),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n2, BLOCK_K=c.block_k, EVEN_K=I % c.block_k == 0,
        HAS_BIAS=b2 is not None, PRECISION=precision, num_warps=c.num_warps, num_stages=c.num_stages)
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(H))
    _sum_k_kernel[(T, triton.cdiv(H, block))](out, y, H, TOP_K=k, BLOCK=block, num_warps=4)
    return y
