"""gpt-oss (OpenAI's open-weight MoE) on the Llama-family machinery of llama.py.

What differs from Llama, and where it is handled:
  * attention: q/k/v and o projections with biases; a learned per-head sink logit that joins each
    softmax's denominator (`sinks`, passed to the attention backend: kernels/reference.py's
    softmax_with_sinks, and the Triton decode / extend kernels); sliding window (128) on every other
    layer (ModelConfig.layer_types); YaRN RoPE (kernels/reference.py's yarn_inv_freq);
  * MLP: a mixture of experts (layers/moe.py's MoEMLP with biases): router with bias, top-k of its
    logits then a softmax over the k (moe_scoring "topk_softmax"), experts with the clamped SwiGLU
    (moe_activation "swiglu_oai": limit 7.0, alpha 1.702, (up + 1) * gate * sigmoid(alpha * gate));
  * checkpoints: transformers' bf16 layout stores gate_up_proj [E, H, 2I] with gate and up
    interleaved (gate = columns 0::2, up = 1::2) and down_proj [E, I, H]; they are de-interleaved and
    transposed into MoEMLP's w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] at load. The
    released checkpoints store the experts in MXFP4 (`*_blocks` uint8 [E, rows, cols / 32, 16]: two
    FP4 e2m1 values a byte, low nibble first; `*_scales` uint8 [E, rows, cols / 32]: e8m0 exponents,
    bias 127): with no MXFP4 kernel here they are dequantised at load, expert by expert, to the model
    dtype (bf16 on a GPU: 16 bits a weight where MXFP4 holds 4.25), and the load log says so.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from localrun.engine.config import ModelConfig
from localrun.engine.layers import quant
from localrun.engine.layers.attention import AttentionBackend, AttnMetadata
from localrun.engine.layers.moe import MoEMLP
from localrun.engine.layers.ops import Ops
from localrun.engine.models.llama import DecoderLayer, LlamaModel
from localrun.engine.models.registry import register
from localrun.engine.parallel.group import TPGroup

log = logging.getLogger("localrun.engine")

# FP4 e2m1: sign bit, 2 exponent bits, 1 mantissa bit (the OCP microscaling format's element)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one e8m0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> floats: blocks uint8 [..., G, 16] (32 FP4 values a group, two a byte, the low nibble the
    earlier value), scales uint8 [..., G] (e8m0: 2 ** (s - 127)) -> [..., G * 32] in dtype. Each value is
    exact in bf16 (a 2-bit mantissa times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks [..., G, {MXFP4_BLOCK // 2}], scales [..., G])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    vals = vals.reshape(*scales.shape, MXFP4_BLOCK)
    out = torch.ldexp(vals, scales.to(torch.int32).sub(127).unsqueeze(-1))
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK).to(dtype)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32, weight_dtype: str = "auto",
                 device="meta", tp: TPGroup | None = None):
        super().__init__(cfg, layer_id, dtype, weight_dtype, device, tp)
        del self.gate_up_proj, self.down_proj  # the experts replace the dense MLP
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        # the sink logits of this rank's heads, in float32 (the softmax's precision)
        self.sinks = nn.Parameter(torch.empty(self.nq, dtype=torch.float32), requires_grad=False)
        self.moe = MoEMLP(cfg, dtype, self.tp, bias=True)

    def forward(self, x, residual, positions, meta: AttnMetadata, ops: Ops, attn: AttentionBackend, cos_sin):
        h, residual = ops.fused_add_rmsnorm(x, residual, self.input_layernorm, self.eps)
        qkv = ops.linear(h, self.qkv_proj, self.qkv_bias)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k = ops.apply_rope(q.reshape(T, self.nq, self.d), k.reshape(T, self.nkv, self.d), positions, cos_sin)
        o = attn.forward(q, k, v.reshape(T, self.nkv, self.d), self.layer_id, meta, self.scale, window=self.window,
                         sinks=self.sinks)
        bias = self.o_bias if self.tp.rank == 0 else None  # row-parallel: the sum carries the bias once
        x = self.tp.all_reduce(ops.linear(o.reshape(T, self.nq * self.d), self.o_proj, bias))
        h, residual = ops.fused_add_rmsnorm(x, residual, self.post_attention_layernorm, self.eps)
        return self.moe(h, ops), residual


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer

    @staticmethod
    def pointwise_kernels(cfg: ModelConfig) -> tuple[str, ...]:
        return ("fused_add_rmsnorm", "apply_rope")

    def load_hf_state(self, get, names: set[str]) -> None:
        """Weights by transformers' names (bf16 experts, or MXFP4 `*_blocks` / `*_scales` dequantised here).
        With tensor parallelism each rank reads its heads, its experts' intermediate rows and its
        vocabulary rows."""
        cfg, tp = self.cfg, self.tp
        r, world = tp.rank, tp.world

        def rows(name: str, start: int, n: int, dim: int = 0) -> torch.Tensor:
            part = getattr(get, "part", None)
            if world == 1:
                return get(name)
            return part(name, dim, start, n) if part and dim in (0, 1) else get(name).narrow(dim, start, n)

        def put(dst, src: torch.Tensor, name: str) -> None:
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} does not match the config's "
                                 f"{tuple(dst.shape)}")
            dst.copy_(src)

        def put_heads(dst, name: str, per_rank: list[int], suffix: str) -> None:
            """q | k | v rows (weights or biases) of this rank's heads, fused."""
            if isinstance(dst, quant.QuantizedWeight):  # (one rank only: never sharded)
                return dst.load(get, [(f"{name}.{n}_proj.{suffix}", w) for n, w in zip("qkv", per_rank)])
            at = 0
            for n, w in zip("qkv", per_rank):
                src = f"{name}.{n}_proj.{suffix}"
                put(dst[at:at + w], rows(src, r * w, w), src)
                at += w

        with torch.no_grad():
            vocab = (self.vocab_start, self.vocab_rows)
            put(self.embed_tokens[:self.vocab_rows] if world > 1 else self.embed_tokens,
                rows("model.embed_tokens.weight", *vocab), "model.embed_tokens.weight")
            if self.lm_head is not None:
                head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
                if isinstance(self.lm_head, quant.QuantizedWeight):
                    self.lm_head.load(get, [(head, self.lm_head.shape[0])])
                else:
                    put(self.lm_head[:self.vocab_rows] if world > 1 else self.lm_head, rows(head, *vocab), head)
            put(self.norm, get("model.norm.weight"), "model.norm.weight")
            dequantised = 0
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                put(layer.input_layernorm, get(p + "input_layernorm.weight"), p + "input_layernorm.weight")
                put(layer.post_attention_layernorm, get(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm.weight")
                widths = [layer.nq * layer.d, layer.nkv * layer.d, layer.nkv * layer.d]
                put_heads(layer.qkv_proj, p + "self_attn", widths, "weight")
                put_heads(layer.qkv_bias, p + "self_attn", widths, "bias")
                if isinstance(layer.o_proj, quant.QuantizedWeight):
                    layer.o_proj.load(get, [(p + "self_attn.o_proj.weight", layer.o_proj.shape[0])])
                else:
                    n = layer.o_proj.shape[1]
                    put(layer.o_proj, rows(p + "self_attn.o_proj.weight", r * n, n, dim=1), p + "self_attn.o_proj.weight")
                put(layer.o_bias, get(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
                put(layer.sinks, rows(p + "self_attn.sinks", r * layer.nq, layer.nq), p + "self_attn.sinks")
                dequantised += self._load_moe(layer.moe, p + "mlp.", get, names)
        if dequantised:
            log.info("gpt-oss: MXFP4 expert weights dequantised at load to %s (no MXFP4 kernel): %.1f MiB as stored "
                     "-> %.1f MiB in memory", str(self.dtype).removeprefix("torch."), dequantised * 17 / 32 / 2**20,
                     dequantised * self.dtype.itemsize / 2**20)
            self.dequantised_experts = True

    def _load_moe(self, mlp: MoEMLP, p: str, get, names: set[str]) -> int:
        """The router and the experts of one layer; returns the number of MXFP4 weights dequantised (0: bf16)."""
        r, world = self.tp.rank, self.tp.world
        inter = mlp.w2.shape[2]  # this rank's share of each expert's intermediate size
        mine = slice(r * inter, (r + 1) * inter)
        for dst, name in ((mlp.gate, "router.weight"), (mlp.gate_bias, "router.bias")):
            src = get(p + name)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {p}{name}: shape {tuple(src.shape)} does not match the config's "
                                 f"{tuple(dst.shape)}")
            dst.copy_(src)
        e = p + "experts."
        if e + "gate_proj.weight" in names:  # a GGUF: stacked gate / up [E, I, H], down [E, H, I], biases [E, rows]
            return self._load_stacked(mlp, e, get, mine)
        b = get(e + "gate_up_proj_bias")  # [E, 2I], gate / up interleaved
        mlp.w13_bias[:, :inter].copy_(b[:, 0::2][:, mine])
        mlp.w13_bias[:, inter:].copy_(b[:, 1::2][:, mine])
        mlp.w2_bias.copy_(get(e + "down_proj_bias"))
        if e + "gate_up_proj_blocks" in names:  # MXFP4: [E, rows, cols / 32, 16] + [E, rows, cols / 32]
            gu_b, gu_s = get(e + "gate_up_proj_blocks"), get(e + "gate_up_proj_scales")
            dn_b, dn_s = get(e + "down_proj_blocks"), get(e + "down_proj_scales")
            count = 0
            for x in range(mlp.w13.shape[0]):  # one expert at a time: never the whole layer in float
                gate_up = dequantize_mxfp4(gu_b[x], gu_s[x], mlp.w13.dtype)  # [2I (interleaved), H]
                self._check(gate_up.shape, (2 * inter * world, mlp.w13.shape[2]), e + "gate_up_proj_blocks")
                mlp.w13[x, :inter].copy_(gate_up[0::2][mine])
                mlp.w13[x, inter:].copy_(gate_up[1::2][mine])
                down = dequantize_mxfp4(dn_b[x], dn_s[x], mlp.w2.dtype)  # [H, I]
                self._check(down.shape, (mlp.w2.shape[1], inter * world), e + "down_proj_blocks")
                mlp.w2[x].copy_(down[:, mine])
                count += gate_up.numel() + down.numel()
            return count
        gate_up = get(e + "gate_up_proj")  # [E, H, 2I], gate / up interleaved in the last dim
        self._check(gate_up.shape, (mlp.w13.shape[0], mlp.w13.shape[2], 2 * inter * world), e + "gate_up_proj")
        mlp.w13[:, :inter].copy_(gate_up[:, :, 0::2][:, :, mine].transpose(1, 2))
        mlp.w13[:, inter:].copy_(gate_up[:, :, 1::2][:, :, mine].transpose(1, 2))
        down = get(e + "down_proj")  # [E, I, H]
        self._check(down.shape, (mlp.w2.shape[0], inter * world, mlp.w2.shape[1]), e + "down_proj")
        mlp.w2.copy_(down[:, mine].transpose(1, 2))
        return 0

    def _load_stacked(self, mlp: MoEMLP, e: str, get, mine: slice) -> int:
        """llama.cpp's layout of the experts (its converter de-interleaves gate_up_proj): w13 = gate rows, then
        up rows; MXFP4 tensors (cfg.experts_mxfp4) come dequantised by the GGUF getter. Returns the number of
        MXFP4 weights so dequantised (0: bf16 / f32 experts)."""
        inter, world = mlp.w2.shape[2], self.tp.world
        E, H = mlp.w13.shape[0], mlp.w13.shape[2]
        for half, n in ((slice(0, inter), "gate_proj"), (slice(inter, 2 * inter), "up_proj")):
            w, b = get(e + n + ".weight"), get(e + n + ".bias")
            self._check(w.shape, (E, inter * world, H), e + n + ".weight")
            self._check(b.shape, (E, inter * world), e + n + ".bias")
            mlp.w13[:, half].copy_(w[:, mine])
            mlp.w13_bias[:, half].copy_(b[:, mine])
        down, b = get(e + "down_proj.weight"), get(e + "down_proj.bias")
        self._check(down.shape, (E, H, inter * world), e + "down_proj.weight")
        self._check(b.shape, (E, H), e + "down_proj.bias")
        mlp.w2.copy_(down[:, :, mine])
        mlp.w2_bias.copy_(b)
        return mlp.w13.numel() + mlp.w2.numel() if self.cfg.experts_mxfp4 else 0

    @staticmethod
    def _check(shape, want, name: str) -> None:
        if tuple(shape) != tuple(want):
            raise ValueError(f"weight {name}: shape {tuple(shape)} does not match the config's {tuple(want)}")

    def init_random(self, seed: int = 0) -> None:
        """Random weights (benchmarks of exact shapes): the attention's through LlamaModel's draw (biases
        and sinks zero), the router and experts with std 1/sqrt(fan-in) and zero biases."""
        mlps = [layer.moe for layer in self.layers]
        for layer in self.layers:  # LlamaModel's draw knows 1-D and 2-D weights only
            del layer.moe
        try:
            super().init_random(seed)
        finally:
            for layer, mlp in zip(self.layers, mlps):
                layer.moe = mlp
        g = torch.Generator(device=self.cos_sin.device).manual_seed(seed + 1)
        with torch.no_grad():
            for m in mlps:
                for w in (m.gate, m.w13, m.w2):
                    w.copy_(torch.randn(w.shape, generator=g, device=w.device) / w.shape[-1] ** 0.5)
                for w in (m.gate_bias, m.w13_bias, m.w2_bias):
                    w.zero_()


register(GptOssModel, when=lambda cfg: cfg.arch == "gpt_oss")
