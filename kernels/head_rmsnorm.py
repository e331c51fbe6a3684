"""Plain RMSNorm over the last dim of [T, H, D] (Triton): Qwen3's per-head q/k norm.

Grid (tokens,): one program normalises every head of one token (a [BLOCK_H, BLOCK_D] tile),
reading strided rows (q and k are views into the fused qkv output) and writing a new
contiguous tensor: out = x * rsqrt(mean(x^2) + eps) * weight, in fp32, one rounding at the
end. Same result as reference.rms_norm_ref. (Module named apart from the op: importing a
submodule binds its name on the package.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _head_rmsnorm_kernel(X, Weight, Out, stride_xt, stride_xh, stride_ot, stride_oh, eps,
                         NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < DIM)[None, :]
    x = tl.load(X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / DIM + eps)
    w = tl.load(Weight + offs_d, mask=offs_d < DIM, other=0.0).to(tl.float32)
    out = h * rstd[:, None] * w[None, :]
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim of x [T, H, D] or [T, D]; returns a new tensor."""
    flat = x.dim() == 2
    x3 = x.unsqueeze(1) if flat else x
    if x3.dim() != 3 or weight.shape != (x3.shape[-1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit together")
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    num_tokens, num_heads, dim = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _head_rmsnorm_kernel[(num_tokens,)](
            x3, weight, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), eps,
            NUM_HEADS=num_heads, BLOCK_H=next_pow2(num_heads), DIM=dim, BLOCK_D=next_pow2(dim),
            num_warps=4,
        )
    return out.squeeze(1) if flat else out
