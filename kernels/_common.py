"""Host-side helpers shared by the Triton kernel wrappers (no @triton.jit code here)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU (a small stand-in under the interpreter)."""
    if t.is_cuda:
        return sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4


def dot_precision(dtype: torch.dtype) -> str:
    """The PRECISION argument of attn_common.mma for operands of this dtype.

    "ieee": exact fp32 products for fp32 inputs (no TF32 rounding); "tf32" is ignored by
    tl.dot for 16-bit inputs; "interp_upcast" works around the interpreter's 16-bit tl.dot.
    """
    if dtype == torch.float32:
        return "ieee"
    return "interp_upcast" if interpreting() else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address a cache as [num_slots, Hkv, D] with unit stride on D."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be [num_pages, page_size, num_kv_heads, head_dim], got {tuple(c.shape)}")
        if c.stride(3) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} must be contiguous over (page, offset) and head_dim; got strides {c.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")


def inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride on its last dim (a copy only when needed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def kv_quant(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(QUANT, k_scale, v_scale) for a kernel launch: QUANT is 0 for an unquantized cache (the
    caches stand in for the unused scale pointers), 1 for int8, 2 for float8_e4m3fn; the
    scales of a quantized cache are checked: float32 [num_pages, page_size, num_kv_heads], contiguous."""
    from .reference import KV_QMAX, KV_SCALE_DTYPE

    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    if k_cache.dtype not in KV_QMAX:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"scales were given for an unquantized {k_cache.dtype} KV cache")
        return 0, k_cache, v_cache
    want = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != want or s.dtype != KV_SCALE_DTYPE or not s.is_contiguous():
            got = "none" if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise ValueError(f"a {k_cache.dtype} KV cache needs {name}: contiguous {KV_SCALE_DTYPE} {want}, got {got}")
    return (1 if k_cache.dtype == torch.int8 else 2), k_scale, v_scale
