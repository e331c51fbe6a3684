"""Prefill / extend attention over a paged KV cache in Triton.

A flat batch of new tokens from several sequences (rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
belong to sequence b) attends causally to the sequence's cached prefix and to itself. The
new tokens' K/V were already written to the cache (store_kv), so one loop over cache
positions, read through the page table, covers the prefix and the new tokens alike.

Grid (batch, q_head, query block). A query block at positions [p0, p1) reads keys below p0
(rounded down to a key block) without any mask, then the diagonal blocks up to p1 with the
causal mask; keys past p1 are masked for every row, so they are never loaded.
Same math as reference.extend_attention_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attn_common import attend_kv_block, scale_and_cap
from ._common import check_cache, kv_quant, dot_precision, inner_contiguous, interpreting, next_pow2


@triton.jit(do_not_specialize=["window"])
def _extend_kernel(
    Q, K, V, KScale, VScale, O, PageTable, CuSeqlensQ, SeqLens, Sinks,
    scale_log2, window, softcap_log2,
    stride_qt, stride_qh,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_ks_slot, stride_vs_slot,
    stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
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
    page_row = PageTable + b * stride_pt
    # Keys before the block's first query position are visible to every row: no masks (with a
    # sliding window: only the window mask, from the block holding the first row's first key).
    full_end = (prefix_len + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    lo = 0
    if SLIDING:
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    win_start = q_pos - window + 1  # each row's first visible key (used when SLIDING)
    for n0 in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, q_pos, n0, full_end, K, V, page_row, kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, scale_log2, offs_d, mask_d,
            KScale, VScale, stride_ks_slot, stride_vs_slot, BLOCK_N, PAGE_SIZE, PRECISION,
            BOUNDED=False, CAUSAL=False, QUANT=QUANT, win_start=win_start, softcap_log2=softcap_log2,
            SLIDING=SLIDING, SOFTCAP=SOFTCAP)
    # The diagonal, causally masked. Its first key (full_end) is <= every row's position, so
    # no row's softmax is ever empty; keys past the block's last query are never read.
    kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, q_pos, n0, kv_end, K, V, page_row, kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, scale_log2, offs_d, mask_d,
            KScale, VScale, stride_ks_slot, stride_vs_slot, BLOCK_N, PAGE_SIZE, PRECISION,
            BOUNDED=True, CAUSAL=True, QUANT=QUANT, win_start=win_start, softcap_log2=softcap_log2,
            SLIDING=SLIDING, SOFTCAP=SOFTCAP)

    if SINKS:  # gpt-oss: the head's sink logit (natural base; m_i is base 2) joins the denominator
        l_i += tl.exp2(tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


_configs: dict[tuple, tuple[int, int, int, int]] = {}  # (device, head_dim, dtype) -> a config that fits


def _default_config(capability: tuple[int, int] | None, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a GPU of this compute capability (None: the
    interpreter), after SGLang's choices for its extend kernel; bf16 tiles that fit the GPU's
    shared memory (a launch that does not fit is retried with smaller tiles)."""
    if capability is None:
        return 16, 16, 4, 1  # small tiles: tiny test shapes still cross block boundaries
    warps = 4 if head_dim <= 64 else 8
    if capability[0] >= 9:  # Hopper and newer
        tiles = (128, 64) if head_dim <= 256 else (32, 64)
    elif capability == (8, 0):  # A100: large shared memory
        tiles = (128, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 64)
    else:  # consumer Ampere/Ada (~100 KB shared memory) and older
        tiles = (64, 64) if head_dim <= 128 else (32, 32)
    return (*tiles, warps, 1)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     max_q_len: int | None = None, *, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (new tokens of all sequences, concatenated) -> o [T, Hq, D].

    max_q_len (the longest q_len in the batch) sizes the grid; pass it when the caller knows
    it. Without it the grid assumes the bound T (no device-to-host sync): query blocks past a
    sequence's q_len exit at once, which costs little next to the attention work.
    k_scale / v_scale: the scales of a quantized (int8 / fp8) cache.
    window > 0: sliding window (a query at position p sees keys p - window < j <= p; key blocks
    wholly before a query block's window are skipped); softcap > 0: soft-capped scores; sinks ([Hq],
    gpt-oss): per-head logits that join each softmax's denominator.
    """
    check_cache(k_cache, v_cache)
    quant, k_scale, v_scale = kv_quant(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {num_kv_heads} KV heads of dim {cache_dim}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    q = inner_contiguous(q)
    max_q_len = num_tokens if max_q_len is None else max_q_len
    if max_q_len == 0:
        return out
    key = (q.device, head_dim, q.dtype)
    config = _configs.get(key)
    if config is None:
        capability = torch.cuda.get_device_capability(q.device) if q.is_cuda and not interpreting() else None
        config = _default_config(capability, head_dim)
    block_m, block_n, warps, stages = config
    window, softcap = max(0, int(window or 0)), float(softcap or 0.0)
    scale_log2, softcap_log2 = scale_and_cap(scale, softcap)
    while True:
        try:
            _extend_kernel[(batch, num_q_heads, triton.cdiv(max_q_len, block_m))](
                q, k_cache, v_cache, k_scale, v_scale, out, page_table, cu_seqlens_q, seq_lens,
                seq_lens if sinks is None else sinks, scale_log2, window, softcap_log2,
                q.stride(0), q.stride(1),
                k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
                k_scale.stride(1), v_scale.stride(1),
                out.stride(0), out.stride(1),
                page_table.stride(0),
                GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
                BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size, PRECISION=dot_precision(q.dtype),
                QUANT=quant, SLIDING=window > 0, SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=warps, num_stages=stages,
            )
            break
        except triton.OutOfResources:  # shared memory of a smaller GPU: halve the tiles and retry
            if block_m <= 16 and block_n <= 16:
                raise
            block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    _configs[key] = (block_m, block_n, warps, stages)
    return out
