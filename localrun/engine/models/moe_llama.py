"""Qwen3-MoE and Mixtral: Llama attention with a mixture of experts in place of the dense MLP.

The attention is llama.py's; layers/moe.py's MoEMLP replaces the dense MLP on the layers
ModelConfig.layer_is_moe marks.

Qwen3-MoE: q/k RMSNorm as Qwen3, top-8 of 128 experts, norm_topk_prob, dense layers where
mlp_only_layers / decoder_sparse_step say. Mixtral: top-2 of 8, the top-k weights renormalised,
an optional sliding window (every layer). The experts' weights are read from any of the layouts a
checkpoint has: one tensor per expert and projection (what transformers' save_pretrained writes:
Qwen3-MoE `mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.{w1,w3,w2}
.weight`), transformers 5's stacked `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
[E, H, I], or llama.cpp's stacked gate / up / down (loader.read_gguf names them
`mlp.experts.{gate,up,down}_proj.weight`). Each lands straight in its slice of MoEMLP's w13 / w2
(tensor parallelism: this rank's rows of each expert's intermediate dimension)."""

from __future__ import annotations

import math

import torch

from localrun.engine.config import ModelConfig
from localrun.engine.layers.moe import MoEMLP
from localrun.engine.layers.ops import Ops
from localrun.engine.models.llama import DecoderLayer, LlamaModel
from localrun.engine.models.registry import register
from localrun.engine.parallel.group import TPGroup

# the architectures whose mixture-of-experts configs this family runs (a Mixtral GGUF says "llama")
MOE_ARCHS = ("qwen3_moe", "mixtral", "llama", "mistral")
# per-expert checkpoint names: (gate, up, down) under `mlp.experts.{e}.` or Mixtral's `block_sparse_moe.experts.{e}.`
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32, weight_dtype: str = "auto",
                 device="meta", tp: TPGroup | None = None):
        super().__init__(cfg, layer_id, dtype, weight_dtype, device, tp)
        self.moe = MoEMLP(cfg, dtype, self.tp) if cfg.layer_is_moe(layer_id) else None
        if self.moe is not None:  # no dense MLP on a sparse layer
            self.gate_up_proj = self.down_proj = None

    def mlp(self, h: torch.Tensor, ops: Ops) -> torch.Tensor:
        return super().mlp(h, ops) if self.moe is None else self.moe(h, ops)


class MoELlamaModel(LlamaModel):
    layer_cls = MoEDecoderLayer

    def load_hf_state(self, get, names: set[str]) -> None:
        """The attention and dense layers as a Llama's, then each sparse layer's router and experts."""
        super().load_hf_state(get, names)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                if layer.moe is not None:
                    self._load_experts(layer.moe, f"model.layers.{i}.", get, names)

    def _load_experts(self, moe: MoEMLP, p: str, get, names: set[str]) -> None:
        pre = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in names else "mlp.")
        E, inter = moe.w13.shape[0], moe.w2.shape[2]
        full, at = inter * self.tp.world, inter * self.tp.rank  # this rank's rows of each expert's gate and up

        def copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} does not match the config's "
                                 f"{tuple(dst.shape)}")
            dst.copy_(src)

        copy(moe.gate, get(pre + "gate.weight"), pre + "gate.weight")
        x = pre + "experts."
        stacked_down = next((n for n in (x + "down_proj", x + "down_proj.weight") if n in names), None)
        if stacked_down is not None:  # [E, H, I] (transformers 5 in memory, llama.cpp's ffn_down_exps)
            copy(moe.w2, get(stacked_down).narrow(2, at, inter), stacked_down)
            fused = next((n for n in (x + "gate_up_proj", x + "gate_up_proj.weight") if n in names), None)
            if fused is not None:  # [E, 2I, H]: gate rows then up rows
                w = get(fused)
                copy(moe.w13[:, :inter], w.narrow(1, at, inter), fused)
                copy(moe.w13[:, inter:], w.narrow(1, full + at, inter), fused)
            else:  # [E, I, H] each
                copy(moe.w13[:, :inter], get(x + "gate_proj.weight").narrow(1, at, inter), x + "gate_proj.weight")
                copy(moe.w13[:, inter:], get(x + "up_proj.weight").narrow(1, at, inter), x + "up_proj.weight")
            return
        gate, up, down = next((t for t in _EXPERT_NAMES if f"{x}0.{t[0]}.weight" in names), _EXPERT_NAMES[0])
        part = getattr(get, "part", None)

        def read(name: str, dim: int) -> torch.Tensor:  # this rank's rows (gate, up) or columns (down)
            if self.tp.world == 1:
                return get(name)
            return part(name, dim, at, inter) if part else get(name).narrow(dim, at, inter)

        for e in range(E):
            ep = f"{x}{e}."
            copy(moe.w13[e, :inter], read(ep + gate + ".weight", 0), ep + gate + ".weight")
            copy(moe.w13[e, inter:], read(ep + up + ".weight", 0), ep + up + ".weight")
            copy(moe.w2[e], read(ep + down + ".weight", 1), ep + down + ".weight")

    def init_random(self, seed: int = 0) -> None:
        """Llama's random weights, then the experts': each expert's whole matrices drawn in one order,
        of which this rank keeps its shard (equal for every tensor_parallel)."""
        super().init_random(seed)
        dev = self.cos_sin.device
        g = torch.Generator(device=dev).manual_seed(seed + 1)
        h = self.cfg.hidden_size
        with torch.no_grad():
            for layer in self.layers:
                moe = layer.moe
                if moe is None:
                    continue
                inter = moe.w2.shape[2]
                full, at = inter * self.tp.world, inter * self.tp.rank
                for e in range(moe.w13.shape[0]):
                    w13 = torch.randn(2 * full, h, generator=g, device=dev) / math.sqrt(h)
                    moe.w13[e, :inter].copy_(w13[at:at + inter])
                    moe.w13[e, inter:].copy_(w13[full + at:full + at + inter])
                    w2 = torch.randn(h, full, generator=g, device=dev) / math.sqrt(full)
                    moe.w2[e].copy_(w2[:, at:at + inter])

    def _shard_layout(self, name: str, p: torch.Tensor):
        if name.rsplit(".", 1)[-1] == "gate":  # the router: whole on every rank
            rows, cols = p.shape
            return (rows, cols), [(0, rows, 0)], (0, cols)
        return super()._shard_layout(name, p)


register(MoELlamaModel, when=lambda cfg: cfg.is_moe and cfg.arch in MOE_ARCHS)
