"""A linear layer over one or a few rows of activations in Triton: y = x @ w.T (+ bias).

At one row (a decode step of one sequence) a linear layer is a matrix-vector product: it reads
the whole weight once and does two flops per weight, so its time is the weight's bytes over the
memory bandwidth. cuBLAS picks GEMM tiles (8 rows wide, split-K for the smaller matrices) that
reach 2.1-2.8 TB/s on an H100 for Llama-3.1-8B's matrices; this kernel 2.4-3.2 TB/s
(results/itl-diag-nvidia-h100.json, 2026-11-26). With more rows cuBLAS wins (its tiles reuse
each weight for 8 rows; here each row is another pass over registers), so the engine calls
it for one row only (layers/ops.Ops.linear).

Each program owns BLOCK_N output columns (BLOCK_N rows of w, contiguous over K) and streams
them in BLOCK_K chunks. At one row (_gemv_row_kernel, the engine's case) products are summed
elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator with x read as a vector; at 2-MAX_M rows
(_gemv_kernel) into a [BLOCK_M, BLOCK_N, BLOCK_K] one. Each is reduced once at the end: the same
results as F.linear up to fp32 summation order. On an H100 (8B shape, batch-1 ITL, alternated on
one engine, 2026-11-27: results/gemv-ab-nvidia-h100.json) the one-row kernel took the step from
5.88 to 5.65 ms against the M-row kernel at one row; launching it as a programmatic dependent
launch (its first weight tile loaded before waiting for the kernel that writes x) was slower,
5.70 ms, and is not done. N is not specialised (only masks read it): any matrix of a model runs
the variant its load's kernel trial compiled (engine/fallbacks.py), which depends on K alone.

gemv(x, w, bias) takes x [M, K] (M <= MAX_M), w [N, K] (unit stride on K), bias [N] or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, interpreting, next_pow2

MAX_M = 8


@triton.jit(do_not_specialize=["M", "N", "stride_ym"])
def _gemv_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = X + rm[:, None] * stride_xm  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BN, BK]: read once
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        y += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _gemv_row_kernel(X, W, Bias, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """One row of x: a [BLOCK_N, BLOCK_K] accumulator, x read as a vector."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BN, BK]: read once
        x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=n_ok)


def config(k: int, m: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for rows of K weights (and m rows of x). Swept on an H100 over
    BLOCK_N 1-16, BLOCK_K 256-2048 and 2-8 warps for each of Llama-3.1-8B's matrices at one row:
    (4, 2048, 4) was within 2.1% of the best configuration for every matrix. Triton's CPU
    interpreter runs one program at a time (each in numpy), so there the blocks are wide: few
    programs, as wide as its largest block (2**20 elements, the [m, BLOCK_N, BLOCK_K] sum) allows."""
    bk = min(2048, max(16, next_pow2(k)))
    if interpreting():
        return min(1024, (1 << 20) // (bk * next_pow2(m))), bk, 1
    return 4, bk, 4


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T + bias -> [M, N] in x's dtype (M <= MAX_M)."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M:
        raise ValueError(f"gemv takes at most {MAX_M} rows, got {M}")
    if w.shape[1] != K:
        raise ValueError(f"gemv: x has {K} columns, w {tuple(w.shape)}")
    x, w = inner_contiguous(x), inner_contiguous(w)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bn, bk, warps = cfg or config(K, M)
    if M == 1:
        _gemv_row_kernel[(triton.cdiv(N, bn),)](x, w, bias if bias is not None else w, y, N, K, w.stride(0),
                                                 BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, num_warps=warps)
        return y
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(1, next_pow2(M)), BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, num_warps=warps,
    )
    return y

