"""Write new tokens' K and V into the paged KV cache (Triton).

Grid (tokens,): each program copies one token's [Hkv, D] key and value rows to its slot
(page_id * page_size + offset). A negative slot marks a padding token (e.g. a CUDA-graph
batch padded to its captured size) and is skipped. A quantized cache (int8 / fp8 e4m3)
gets each head vector divided by its own scale (max|x| / QMAX), written beside it in the
scale tensor. Same result as reference.store_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache, inner_contiguous, interpreting, kv_quant, next_pow2


@triton.jit
def _round_to_e4m3_grid(y):
    """y (fp32, |y| <= 448) rounded to nearest even on the fp8 e4m3 grid, in fp32 arithmetic.

    Only under the interpreter: Triton 3.x's interpreter casts fp32 -> fp8 with a carry bug
    (126.8 becomes 64, not 128); given a value already on the grid, its cast is exact. Adding
    and subtracting C = 1.5 * 2^(k + 23) rounds to a multiple of 2^k, k the e4m3 ulp exponent
    of y (binade exponent - 3; subnormals below 2^-6 share the ulp 2^-9)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(e, -6) - 3
    c = ((k + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    return (y + c) - c


@triton.jit
def _quantize(x, QUANT: tl.constexpr, INTERP_FP8: tl.constexpr):
    """x [H, D] fp32 (masked entries 0) -> (values scaled into the dtype's range, scales [H]).

    QUANT 1 (int8): rounded half away from zero (the caller's cast truncates); 2 (fp8): the cast
    rounds to nearest even."""
    if QUANT == 1:
        qmax = 127.0
    else:
        qmax = 448.0
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-8) / qmax
    y = x / scale[:, None]
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if QUANT == 1:
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
    elif INTERP_FP8:
        y = _round_to_e4m3_grid(y)
    return y, scale


@triton.jit
def _store_kv_kernel(
    Kin, Vin, KCache, VCache, KScale, VScale, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, stride_ks_slot, stride_vs_slot,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, INTERP_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask_h = tl.arange(0, BLOCK_H) < NUM_HEADS
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(Kin + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(Vin + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if QUANT:
        k, k_scale = _quantize(k.to(tl.float32), QUANT, INTERP_FP8)
        v, v_scale = _quantize(v.to(tl.float32), QUANT, INTERP_FP8)
        heads = tl.arange(0, BLOCK_H)
        tl.store(KScale + slot * stride_ks_slot + heads, k_scale, mask=mask_h)
        tl.store(VScale + slot * stride_vs_slot + heads, v_scale, mask=mask_h)
    tl.store(KCache + slot * stride_kc_slot + h * stride_kc_head + d, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vc_slot + h * stride_vc_head + d, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping [T] (in place; slots < 0 skipped).

    k_scale / v_scale: the scales of a quantized (int8 / fp8) cache, written too."""
    check_cache(k_cache, v_cache)
    quant, k_scale, v_scale = kv_quant(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = k.shape
    if (num_heads, head_dim) != tuple(k_cache.shape[2:]) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if num_tokens == 0:
        return
    k, v = inner_contiguous(k), inner_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(1), v_scale.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
        QUANT=quant, INTERP_FP8=quant == 2 and interpreting(), num_warps=4,
    )
