"""Fused residual add + RMSNorm (Triton).

Grid (tokens,): one program per row. new_residual = x + residual is rounded to x's dtype and
stored, then out = new_residual * rsqrt(mean(new_residual^2) + eps) * weight in fp32, one
rounding at the end. Same result as reference.fused_add_rmsnorm_ref (to within that rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, next_pow2


@triton.jit
def _add_rmsnorm_kernel(
    X, Residual, Weight, Out, NewResidual,
    stride_x, stride_r, stride_o, stride_nr,
    eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(NewResidual + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (h * rstd * w).to(Out.dtype.element_ty), mask=mask)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (RMSNorm(x + residual) * weight, x + residual); residual None: just x."""
    num_tokens, hidden = x.shape
    x = inner_contiguous(x)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if residual is None:
        new_residual, residual_in = x, x
    else:
        residual_in = inner_contiguous(residual)
        new_residual = torch.empty_like(out)
    if num_tokens == 0:
        return out, new_residual
    block = next_pow2(hidden)
    _add_rmsnorm_kernel[(num_tokens,)](
        x, residual_in, weight, out, new_residual,
        x.stride(0), residual_in.stride(0), out.stride(0), new_residual.stride(0),
        eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual
