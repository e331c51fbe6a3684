"""The model's pointwise ops (RMSNorm, RoPE, SiLU / GELU-tanh gates): Triton kernels or torch references."""

from __future__ import annotations

from localrun import kernels

_POINTWISE = ("fused_add_rmsnorm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm")


class Ops:
    """The model's pointwise ops: localrun.kernels' Triton kernels on CUDA tensors (reference=False)
    or their torch references."""

    def __init__(self, reference: bool = False) -> None:
        self.reference = reference
        for name in _POINTWISE:
            setattr(self, name, getattr(kernels, f"{name}_ref" if reference else name))
