"""Rotary position embedding, NeoX (half-split) style, in Triton.

Grid (tokens,): one program rotates every q and k head of one token with the cos/sin row of
its position (cos_sin_cache [max_pos, rot]: cos in the first rot/2 columns, sin in the last;
build it with reference.rope_cos_sin_cache, which also applies llama3 scaling). Dims past
rot (partial rotary) pass through. Writes new tensors; same result as reference.apply_rope_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, next_pow2


@triton.jit
def _rotate_heads(X, Out, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_r < HALF)[None, :]
    x_row = X + t * stride_xt + offs_h[:, None] * stride_xh
    o_row = Out + t * stride_ot + offs_h[:, None] * stride_oh
    x1 = tl.load(x_row + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs_r[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + offs_r[None, :], (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + offs_r[None, :], (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        offs_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pmask = (offs_h < NUM_HEADS)[:, None] & (offs_p < HEAD_DIM)[None, :]
        tl.store(o_row + offs_p[None, :], tl.load(x_row + offs_p[None, :], mask=pmask), mask=pmask)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, Positions, CosSin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    cs_row = CosSin + pos * stride_cs
    cos = tl.load(cs_row + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, BLOCK_HQ, HEAD_DIM, HALF, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, BLOCK_HK, HEAD_DIM, HALF, BLOCK_HALF, BLOCK_PASS)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T]; returns new (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or rot > head_dim or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and cos/sin cache "
                         f"{tuple(cos_sin_cache.shape)} do not fit together")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q, k, cos_sin_cache = inner_contiguous(q), inner_contiguous(k), inner_contiguous(cos_sin_cache)
    half = rot // 2
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_pow2(half),
        BLOCK_PASS=0 if rot == head_dim else next_pow2(head_dim - rot),
        num_warps=4,
    )
    return q_out, k_out
