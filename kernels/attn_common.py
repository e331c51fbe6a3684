"""@triton.jit helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """tl.dot(a, b) with an fp32 accumulator.

    PRECISION "interp_upcast" works around Triton's CPU interpreter (3.x), whose tl.dot
    returns garbage for bf16/fp16 operands: the operands (already rounded to 16 bits by
    the caller) are widened to fp32, which gives the same products as a tensor-core dot.
    """
    if PRECISION == "interp_upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out
