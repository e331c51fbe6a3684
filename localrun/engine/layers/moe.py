"""The mixture-of-experts MLP: a router (linear, bias optional), its top-k, and the stacked experts.

Weights (kernels/moe_reference.py's layout): `gate` [E, H] (the router, whole on every rank),
`w13` [E, 2*I, H] (gate rows then up rows), `w2` [E, H, I], and with `bias` (gpt-oss) `gate_bias` [E],
`w13_bias` [E, 2*I], `w2_bias` [E, H]. Tensor parallelism splits each expert's intermediate dimension:
a rank holds I / world rows of gate and of up and the matching columns of down, and the layer's output is
all-reduced (w2_bias is added on rank 0 only, so the sum carries it once). Routing is ops.moe_route and
the experts' weighted sum ops.fused_moe (Triton kernels on CUDA, the torch references elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from localrun.engine.config import ModelConfig
from localrun.engine.parallel.group import TPGroup


class MoEMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
                 bias: bool = False):
        super().__init__()
        self.tp = tp or TPGroup()
        E, h = cfg.num_experts, cfg.hidden_size
        full = cfg.moe_intermediate_size or cfg.intermediate_size
        if full % self.tp.world:
            raise ValueError(f"the experts' intermediate size {full} does not split over {self.tp.world} ranks")
        inter = full // self.tp.world
        self.top_k, self.scoring, self.renormalize = cfg.num_experts_per_tok, cfg.moe_scoring, cfg.norm_topk_prob
        self.activation = cfg.moe_activation

        def e(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.gate = e(E, h)
        self.w13 = e(E, 2 * inter, h)
        self.w2 = e(E, h, inter)
        self.gate_bias = e(E) if bias else None
        self.w13_bias = e(E, 2 * inter) if bias else None
        self.w2_bias = e(E, h) if bias else None

    def forward(self, h: torch.Tensor, ops) -> torch.Tensor:
        logits = torch.nn.functional.linear(h, self.gate, self.gate_bias)
        weights, ids = ops.moe_route(logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize)
        w2_bias = self.w2_bias if self.tp.rank == 0 else None
        out = ops.fused_moe(h, self.w13, self.w2, weights, ids, activation=self.activation,
                            w13_bias=self.w13_bias, w2_bias=w2_bias)
        return self.tp.all_reduce(out)
