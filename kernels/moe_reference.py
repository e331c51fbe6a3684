"""Mixture-of-experts references: the router's top-k and the experts' weighted sum, in plain torch.

The CPU path of every MoE family and the oracle the Triton kernel (kernels/moe.py) is checked against.

Weight layout (one stacked tensor per projection, as vLLM and SGLang keep them):
  w13 [E, 2*I, H]: rows [0, I) are the gate projection, rows [I, 2*I) the up projection;
  w2  [E, H, I]:   the down projection;
  w13_bias [E, 2*I] and w2_bias [E, H] (gpt-oss), None elsewhere.
Routing: topk_weights float32 [T, k], topk_ids int32 [T, k] (ids in [0, E)).
Activations: "silu" (SiLU(gate) * up: Qwen3-MoE, Mixtral) and "swiglu_oai" (gpt-oss:
gate clamped above at `limit`, up clamped to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)).
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("silu", "swiglu_oai")
SCORINGS = ("softmax_topk", "topk_softmax")


def moe_route_ref(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax_topk",
                  renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]) from router logits [T, E] (any bias added).

    softmax_topk: softmax over all experts, the k largest, renormalised to sum 1 when `renormalize`
    (Qwen3-MoE's norm_topk_prob; Mixtral renormalises, which equals a softmax over the k logits).
    topk_softmax: the k largest logits, then a softmax over those k (gpt-oss)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    logits = router_logits.float()
    if scoring == "topk_softmax":
        vals, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(vals, dim=-1), ids.to(torch.int32)
    probs = torch.softmax(logits, dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    return vals, ids.to(torch.int32)


def moe_activation_ref(gate_up: torch.Tensor, activation: str = "silu", *, alpha: float = 1.702,
                       limit: float = 7.0) -> torch.Tensor:
    """[N, 2*I] (gate then up) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for each token t: [T, H] in x's dtype.

    Each expert runs once on the tokens routed to it (gathered), and its weighted outputs are added
    into a float32 accumulator."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    tok = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        sel = order[start:start + n]
        start += n
        rows = tok[sel]
        h = x[rows] @ w13[e].t()
        if w13_bias is not None:
            h = h + w13_bias[e]
        h = moe_activation_ref(h, activation, alpha=alpha, limit=limit)
        y = h @ w2[e].t()
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, rows, y.float() * flat_w[sel, None])
    return out.to(x.dtype)
