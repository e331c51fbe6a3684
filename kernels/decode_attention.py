"""Paged decode attention (flash-decoding / split-KV) in Triton.

Stage 1: grid (batch, kv_head, split). Each program takes the query heads that share one
KV head (GQA, padded to a 16-row tile so the scores are a tensor-core dot), walks its share
of the sequence's KV positions through the page table with an online softmax, and writes a
partial output plus its log-sum-exp. Stage 2: grid (batch, q_head) merges the splits,
weighting each by exp(lse_split - lse_max). Splitting the KV range keeps every SM busy at
small batch sizes, where one program per (sequence, head) would leave most of the GPU idle.

Same math as reference.paged_decode_attention_ref; logits are handled in base 2 (exp2).
The split count is a runtime value (not a compile-time constant), so one compiled kernel
serves every batch size.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attn_common import attend_kv_block, scale_and_cap
from ._common import check_cache, kv_quant, dot_precision, inner_contiguous, interpreting, next_pow2, num_sms

MAX_KV_SPLITS = 16


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    Q, K, V, KScale, VScale, PageTable, SeqLens, MidO, MidLse,
    scale_log2, num_splits, window, softcap_log2,
    stride_qb, stride_qh,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_ks_slot, stride_vs_slot,
    stride_pt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    lo = 0
    if SLIDING:  # the splits share only the window's blocks: pages wholly before it are never read
        lo = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    page_row = PageTable + b * stride_pt
    win_start = tl.zeros([BLOCK_H], tl.int32) + (seq_len - window)  # the query sits at seq_len - 1
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, offs_h, n0, end, K, V, page_row, kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, scale_log2, offs_d, mask_d,
            KScale, VScale, stride_ks_slot, stride_vs_slot, BLOCK_N, PAGE_SIZE, PRECISION,
            BOUNDED=True, CAUSAL=False, QUANT=QUANT, win_start=win_start, softcap_log2=softcap_log2,
            SLIDING=SLIDING, SOFTCAP=SOFTCAP)

    has_keys = l_i > 0.0  # False for an empty split (short sequence, many splits)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
             out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MidO, MidLse, O, Sinks, num_splits,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(MidLse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if SINKS:  # gpt-oss: the head's sink logit (natural base; lse is base 2) joins the denominator
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty sequence: all weights 0
    w = tl.exp2(lse - lse_max)
    o = tl.load(MidO + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - lse_max)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


PROGRAMS_PER_SM = 6  # the split count aims at about this many stage-1 programs per SM


def default_num_kv_splits(batch: int, num_kv_heads: int, device_tensor: torch.Tensor) -> int:
    """About PROGRAMS_PER_SM programs per SM (rounded), between 1 and MAX_KV_SPLITS.

    Measured on an H200 (132 SMs), 8B shape (8 KV heads), split counts 1-16 at batch 1-96 and 512
    and 2,048 tokens (results/decode-splits-nvidia-h200.json): the best count gives 770-1,150
    programs at every batch; this rule is within 3% of it at each point, where the earlier
    ~2 per SM was 6-20% slower at batch 4-64 (batch 16: 3 splits, 49.6 us a layer at 2,048
    tokens, against 6 splits, 40.4 us). Depends only on host-known sizes (no GPU sync), so it is
    safe inside CUDA graph capture.
    """
    programs = max(1, batch * num_kv_heads)
    return max(1, min(MAX_KV_SPLITS, round(PROGRAMS_PER_SM * num_sms(device_tensor) / programs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_kv_splits: int | None = None, *, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] attends to seq_lens[b] cached tokens of its sequence -> o [B, Hq, D].

    k_scale / v_scale: the scales of a quantized (int8 / fp8) cache.
    window > 0: sliding window, the query sees its last `window` keys only; the splits then cover
    only the window's KV blocks (pages before it are kept but never read). softcap > 0: scores
    are soft-capped, softcap * tanh(score / softcap). sinks ([Hq], gpt-oss): per-head logits that
    join each softmax's denominator (added where the splits merge).

    The split count is a runtime argument and the partial-result buffers always have
    MAX_KV_SPLITS slots, so every batch size and split count runs the same compiled kernels
    (no JIT after the first call, and a CUDA graph may capture any batch size).
    """
    check_cache(k_cache, v_cache)
    quant, k_scale, v_scale = kv_quant(k_cache, v_cache, k_scale, v_scale)
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {num_kv_heads} KV heads of dim {cache_dim}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    q = inner_contiguous(q)
    group = num_q_heads // num_kv_heads
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q)
    if not 1 <= splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {splits}")
    mid_o = torch.empty((batch, num_q_heads, MAX_KV_SPLITS, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_q_heads, MAX_KV_SPLITS), dtype=torch.float32, device=q.device)
    block_d = max(16, next_pow2(head_dim))
    block_n = 16 if interpreting() else 32  # SGLang's grouped decode tile

    window, softcap = max(0, int(window or 0)), float(softcap or 0.0)
    scale_log2, softcap_log2 = scale_and_cap(scale, softcap)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, k_scale, v_scale, page_table, seq_lens, mid_o, mid_lse,
        scale_log2, splits, window, softcap_log2,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), k_scale.stride(1),
        v_scale.stride(1),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n, PAGE_SIZE=page_size, PRECISION=dot_precision(q.dtype), QUANT=quant,
        SLIDING=window > 0, SOFTCAP=softcap > 0,
        num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out, mid_lse if sinks is None else sinks, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(MAX_KV_SPLITS), SINKS=sinks is not None,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
