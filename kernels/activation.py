"""SiLU-and-mul (SwiGLU gate) in Triton: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] in fp32.

Grid (tokens, column blocks). Same result as reference.silu_and_mul_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, interpreting


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x = inner_contiguous(x)
    block = 64 if interpreting() else 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4,
    )
    return out
