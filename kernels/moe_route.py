"""The mixture-of-experts router's top-k in Triton: router logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]).

One program a token, in one launch: softmax over the experts, the k largest by k passes of an argmax
(the lowest index on a tie), renormalised to sum 1 ("softmax_topk", Qwen3-MoE with norm_topk_prob,
Mixtral); or the k largest logits and a softmax over them ("topk_softmax", gpt-oss). The torch
reference (moe_reference.moe_route_ref) is a softmax, a topk, a sum, a division and two casts: about
six launches in each MoE layer of a decode step, where each costs more than its arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import inner_contiguous, next_pow2
from .moe_reference import SCORINGS


@triton.jit
def _route_kernel(Logits, Weights, Ids, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ex = tl.arange(0, BLOCK_E)
    ok = ex < E
    x = tl.load(Logits + t * stride_l + ex, mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        p = tl.exp(x - tl.max(x, axis=0))
        x = tl.where(ok, p / tl.sum(p, axis=0), -1.0)  # probabilities; padding below every one
    top_first = tl.max(x, axis=0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, ex, BLOCK_E), axis=0)
        v = m if SOFTMAX_FIRST else tl.exp(m - top_first)
        total += v
        tl.store(Weights + t * TOP_K + j, v)
        tl.store(Ids + t * TOP_K + j, i)
        x = tl.where(ex == i, float("-inf"), x)
    if RENORMALIZE:  # each program reads back only what it wrote
        for j in tl.static_range(TOP_K):
            w = tl.load(Weights + t * TOP_K + j)
            tl.store(Weights + t * TOP_K + j, w / total)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax_topk",
              renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_reference.moe_route_ref's result (ties aside: the lowest expert index wins one here)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"moe_route: top_k {top_k} must be in [1, {E}]")
    logits = inner_contiguous(router_logits)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    softmax_first = scoring == "softmax_topk"
    _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k, BLOCK_E=max(16, next_pow2(E)),
                        SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize or not softmax_first, num_warps=1)
    return weights, ids
