"""The model's pointwise ops (RMSNorm, RoPE, SiLU / GELU-tanh gates) and its linear layers: Triton kernels or torch references."""

from __future__ import annotations

import torch

from localrun.kernels import ops as kernels
from localrun.engine.layers import quant

_POINTWISE = ("fused_add_rmsnorm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm")


class Ops:
    """The model's pointwise ops: localrun.kernels' Triton kernels on CUDA tensors (reference=False)
    or their torch references. `refs`: the kernels (pointwise or attention) that run their torch
    reference although the Triton kernels are on (their warm-up trial failed: engine/fallbacks.py);
    the attention backend reads it too.

    `linear(x, w, bias)` is quant.linear (cuBLAS, or the quantized weights' own path), except for
    one row of activations times a float weight with the Triton kernels on: kernels.gemv, which
    streams the weight faster than cuBLAS does at one row (a decode step of one sequence)."""

    def __init__(self, reference: bool = False, refs: frozenset[str] = frozenset()) -> None:
        self.reference, self.refs = reference, frozenset(refs)
        for name in _POINTWISE:
            setattr(self, name, getattr(kernels, f"{name}_ref" if reference or name in self.refs else name))
        self.linear = quant.linear if reference or "gemv" in self.refs else _linear
        # the mixture of experts' grouped GEMM (kernels/moe.py) and router top-k (kernels/moe_route.py); their
        # references: kernels/moe_reference.py
        self.fused_moe = kernels.fused_moe_ref if reference or "fused_moe" in self.refs else kernels.fused_moe
        self.moe_route = kernels.moe_route_ref if reference or "moe_route" in self.refs else kernels.moe_route


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] == 1 and isinstance(w, torch.Tensor) and x.dim() == 2:
        return kernels.gemv(x, w, bias)  # the reference (F.linear) where Triton does not run
    return quant.linear(x, w, bias)
