"""@triton.jit helpers shared by the attention kernels."""

from __future__ import annotations

import math

import triton
import triton.language as tl


def scale_and_cap(scale: float, softcap: float) -> tuple[float, float]:
    """(scale_log2, softcap_log2) for attend_kv_block: without soft-capping the score scale in
    base 2; with it, the pre-tanh scale (scale / cap) and cap * log2(e)."""
    if softcap > 0:
        return scale / softcap, softcap * math.log2(math.e)
    return scale * math.log2(math.e), 0.0


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """tl.dot(a, b) with an fp32 accumulator.

    PRECISION "interp_upcast" works around Triton's CPU interpreter (3.x), whose tl.dot
    returns garbage for bf16/fp16 operands: the operands are widened to fp32, which gives
    the same products as a tensor-core dot.
    """
    if PRECISION == "interp_upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def attend_kv_block(
    acc, m_i, l_i, q, q_pos, n0, kv_end,
    K, V, page_row, kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, scale_log2,
    offs_d, mask_d, KScale, VScale, stride_ks_slot, stride_vs_slot,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    BOUNDED: tl.constexpr, CAUSAL: tl.constexpr, QUANT: tl.constexpr,
    win_start=None, softcap_log2=0.0, SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """One online-softmax step over cache positions [n0, n0 + BLOCK_N), read through the page table.

    acc [M, BLOCK_D] / m_i, l_i [M] (fp32, logits in base 2) are updated and returned.
    page_row: pointer to the sequence's page-table row. BOUNDED: mask positions >= kv_end.
    CAUSAL: mask positions > q_pos [M]. A block with neither mask is read without masks.
    QUANT (int8 / fp8 cache, per-token-per-head scales KScale / VScale): the stored values are
    cast (exactly) to q's dtype for the dots, and the scales applied outside them: a key's scale
    multiplies its score column, a value's scale its probability column (l_i sums the unscaled
    probabilities), so no dequantized K/V tile is ever built.
    SLIDING: mask positions < win_start [M] (the row's first key inside its window); a row may then
    see no key of this block, so the running max is guarded against -inf - -inf.
    SOFTCAP: logit soft-capping; the caller passes scale_log2 = scale / cap and softcap_log2 =
    cap * log2(e), so the score becomes tanh(q.k * scale / cap) * cap in base 2.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if BOUNDED:
        mask_n = offs_n < kv_end
        page = tl.load(page_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        page = tl.load(page_row + offs_n // PAGE_SIZE).to(tl.int64)
        kv_mask = mask_d[None, :]
    slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
    k = tl.load(K + slot[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                mask=kv_mask, other=0.0)
    # the dot's operand type (the interpreter: fp32, as mma widens anyway; its int8 -> bf16 cast is broken)
    k = k.to(tl.float32) if PRECISION == "interp_upcast" else k.to(q.dtype)
    qk = mma(q, tl.trans(k), PRECISION) * scale_log2
    if QUANT:
        if BOUNDED:
            k_scale = tl.load(KScale + slot * stride_ks_slot + kv_head, mask=mask_n, other=0.0)
        else:
            k_scale = tl.load(KScale + slot * stride_ks_slot + kv_head)
        qk = qk * k_scale[None, :]
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp2 overflows to inf -> 1)
        qk = (1.0 - 2.0 / (tl.exp2(qk * 2.8853900817779268) + 1.0)) * softcap_log2
    if BOUNDED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    if CAUSAL:
        qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
    if SLIDING:
        qk = tl.where(offs_n[None, :] >= win_start[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if SLIDING:  # a row with no visible key yet: keep its state at zero, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = v.to(tl.float32) if PRECISION == "interp_upcast" else v.to(q.dtype)
    if QUANT:
        if BOUNDED:
            v_scale = tl.load(VScale + slot * stride_vs_slot + kv_head, mask=mask_n, other=0.0)
        else:
            v_scale = tl.load(VScale + slot * stride_vs_slot + kv_head)
        p = p * v_scale[None, :]
    if PRECISION == "interp_upcast":  # the interpreter narrows by truncation (biased): keep p in fp32
        acc = acc * alpha[:, None] + mma(p, v, PRECISION)
    else:
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i
