"""SiLU-and-mul (SwiGLU gate) and GELU(tanh)-and-mul (GeGLU, Gemma) in Triton:
x [T, 2I] -> act(x[:, :I]) * x[:, I:] in fp32.

Grid (tokens, column blocks). Same results as reference.silu_and_mul_ref / gelu_tanh_and_mul_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, interpreting


@triton.jit
def _act_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    # act(gate) * up for one row's column block; act = GELU (tanh approximation) or SiLU
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (x + 0.044715 x^3)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # exact at both ends (exp overflows to inf -> 1)
        out = 0.5 * gate * (1.0 + tanh) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    return _gated(x, False, "silu_and_mul")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:] ([T, I])."""
    return _gated(x, True, "gelu_tanh_and_mul")


def _gated(x: torch.Tensor, gelu: bool, name: str) -> torch.Tensor:
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"{name} needs an even last dimension, got {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x = inner_contiguous(x)
    block = 64 if interpreting() else 1024
    _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, GELU=gelu, num_warps=4,
    )
    return out
