"""Write new tokens' K and V into the paged KV cache (Triton).

Grid (tokens,): each program copies one token's [Hkv, D] key and value rows to its slot
(page_id * page_size + offset). A negative slot marks a padding token (e.g. a CUDA-graph
batch padded to its captured size) and is skipped. Same result as reference.store_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache, inner_contiguous, next_pow2


@triton.jit
def _store_kv_kernel(
    Kin, Vin, KCache, VCache, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_HEADS * HEAD_DIM
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    k = tl.load(Kin + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(Vin + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(KCache + slot * stride_kc_slot + h * stride_kc_head + d, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vc_slot + h * stride_vc_head + d, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping [T] (in place; slots < 0 skipped)."""
    check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = k.shape
    if (num_heads, head_dim) != tuple(k_cache.shape[2:]) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if num_tokens == 0:
        return
    k, v = inner_contiguous(k), inner_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK=next_pow2(num_heads * head_dim),
        num_warps=4,
    )
