"""localrun.kernels.ops: the native engine's attention, KV-write, norm, RoPE, activation and sampling ops.

Each op exists twice: a pure-torch reference (`*_ref`, in reference.py: the CPU path and the
test oracle) and a Triton kernel (one module per op). The names exported here pick the
Triton kernel when Triton is installed and the first tensor argument is on a CUDA device
(or TRITON_INTERPRET=1, Triton's CPU interpreter, is set), and the reference otherwise.
Triton is imported lazily, on the first call that needs it, so this module imports
without Triton. Matmuls stay on cuBLAS through torch, but for one: `gemv`, a linear layer over
one row of activations (a decode step of one sequence), which streams the weight faster than
cuBLAS's kernels for that shape (kernels/matvec.py).

KV cache layout: per layer K and V of shape [num_pages, page_size, num_kv_heads, head_dim];
slot = page_id * page_size + offset; page_table int32 [B, max_pages]; seq_lens int32 [B].
Quantized KV (int8 / float8_e4m3fn caches) adds float32 scales [num_pages, page_size, num_kv_heads]
per cache (keyword arguments k_scale / v_scale of store_kv and the attention ops; reference.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable

import torch

from ._common import interpreting
from .reference import (
    KV_QMAX,
    KV_SCALE_DTYPE,
    apply_rope_ref,
    dequantize_kv_ref,
    extend_attention_ref,
    fused_add_rmsnorm_ref,
    gelu_tanh_and_mul_ref,
    gemv_ref,
    longrope_inv_freq,
    paged_decode_attention_ref,
    quantize_kv_ref,
    rms_norm_ref,
    rope_cos_sin_cache,
    rope_inv_freq,
    sample_temperature_ref,
    silu_and_mul_ref,
    store_kv_ref,
)
from .moe_reference import fused_moe_ref, moe_activation_ref, moe_route_ref

__all__ = [
    "store_kv", "paged_decode_attention", "extend_attention", "fused_add_rmsnorm", "apply_rope", "silu_and_mul",
    "store_kv_ref", "paged_decode_attention_ref", "extend_attention_ref", "fused_add_rmsnorm_ref",
    "apply_rope_ref", "silu_and_mul_ref", "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref",
    "rope_cos_sin_cache", "rope_inv_freq", "longrope_inv_freq", "rms_norm", "rms_norm_ref",
    "sample_temperature", "sample_temperature_ref", "gemv", "gemv_ref",
    "fused_moe", "fused_moe_ref", "moe_route", "moe_route_ref", "moe_activation_ref",
    "triton_available", "uses_triton", "KV_QMAX", "KV_SCALE_DTYPE", "quantize_kv_ref", "dequantize_kv_ref",
]

_triton_ok: bool | None = None


def triton_available() -> bool:
    """Whether Triton imports here (checked once; a broken install counts as absent)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            _triton_ok = importlib.util.find_spec("triton") is not None and bool(importlib.import_module("triton"))
        except Exception:  # noqa: BLE001 - any failure to import means: use the torch path
            _triton_ok = False
    return _triton_ok


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the ops below run their Triton kernel for tensors like t."""
    return (t.is_cuda or interpreting()) and triton_available()


def _dispatch(module: str, ref: Callable, ref_hints: tuple[str, ...] = ()) -> Callable:
    # ref_hints: keyword arguments only the reference takes (host-side lengths that spare it
    # device syncs and padding); they are dropped when the Triton kernel runs.
    name = ref.__name__.removesuffix("_ref")
    kernel: list[Callable] = []

    @functools.wraps(ref)
    def op(*args, **kwargs):
        if not uses_triton(args[0] if args else next(iter(kwargs.values()))):
            return ref(*args, **kwargs)
        if not kernel:
            kernel.append(getattr(importlib.import_module(f".{module}", __package__), name))
        for hint in ref_hints:
            kwargs.pop(hint, None)
        return kernel[0](*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    return op


store_kv = _dispatch("kv_store", store_kv_ref)
paged_decode_attention = _dispatch("decode_attention", paged_decode_attention_ref, ("lens", "group"))
extend_attention = _dispatch("extend_attn", extend_attention_ref, ("lens",))
fused_add_rmsnorm = _dispatch("rmsnorm", fused_add_rmsnorm_ref)
rms_norm = _dispatch("head_rmsnorm", rms_norm_ref)
apply_rope = _dispatch("rope", apply_rope_ref)
silu_and_mul = _dispatch("activation", silu_and_mul_ref)
gelu_tanh_and_mul = _dispatch("activation", gelu_tanh_and_mul_ref)
sample_temperature = _dispatch("sampling", sample_temperature_ref)
gemv = _dispatch("matvec", gemv_ref)
# mixture of experts (moe_reference.py): the experts' weighted sum runs as grouped-GEMM kernels
# (kernels/moe.py) on the GPU, the router's softmax and top-k as one launch (kernels/moe_route.py)
fused_moe = _dispatch("moe", fused_moe_ref)
moe_route = _dispatch("moe_route", moe_route_ref)
