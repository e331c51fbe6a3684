"""Prefill / extend attention over a paged KV cache in Triton.

A flat batch of new tokens from several sequences (rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
belong to sequence b) attends causally to the sequence's cached prefix and to itself. The
new tokens' K/V were already written to the cache (store_kv), so one loop over cache
positions, read through the page table, covers the prefix and the new tokens alike.

Grid (batch, q_head, query block). A query block at positions [p0, p1) stops reading keys at
p1: keys past it are masked for every row, so they are never loaded.
Same math as reference.extend_attention_ref.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attn_common import mma
from ._common import check_cache, dot_precision, inner_contiguous, interpreting, next_pow2


@triton.jit
def _extend_kernel(
    Q, K, V, O, PageTable, CuSeqlensQ, SeqLens,
    scale_log2,
    stride_qt, stride_qh,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        page = tl.load(PageTable + b * stride_pt + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slot[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = mma(q, tl.trans(k), PRECISION) * scale_log2
        # Causal: key position <= query position (key 0 is always allowed, so no row is empty).
        qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     max_q_len: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] (new tokens of all sequences, concatenated) -> o [T, Hq, D].

    max_q_len (the longest q_len in the batch) sizes the grid; pass it when the caller
    knows it, else it is read from cu_seqlens_q (one device-to-host sync).
    """
    check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {num_kv_heads} KV heads of dim {cache_dim}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    q = inner_contiguous(q)
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q_len == 0:
        return out
    if interpreting():
        block_m, block_n, warps = 16, 16, 4
    else:
        block_m, block_n, warps = (128, 64, 8) if head_dim <= 64 else (64, 64, 4) if head_dim <= 128 else (32, 32, 4)
    grid = (batch, num_q_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, cu_seqlens_q, seq_lens,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size, PRECISION=dot_precision(q.dtype),
        num_warps=warps, num_stages=2,
    )
    return out
