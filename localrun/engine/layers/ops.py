"""The model's pointwise ops (RMSNorm, RoPE, SiLU / GELU-tanh gates): Triton kernels or torch references."""

from __future__ import annotations

from localrun import kernels

_POINTWISE = ("fused_add_rmsnorm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm")


class Ops:
    """The model's pointwise ops: localrun.kernels' Triton kernels on CUDA tensors (reference=False)
    or their torch references. `refs`: the kernels (pointwise or attention) that run their torch
    reference although the Triton kernels are on (their warm-up trial failed: engine/fallbacks.py);
    the attention backend reads it too."""

    def __init__(self, reference: bool = False, refs: frozenset[str] = frozenset()) -> None:
        self.reference, self.refs = reference, frozenset(refs)
        for name in _POINTWISE:
            setattr(self, name, getattr(kernels, f"{name}_ref" if reference or name in self.refs else name))
