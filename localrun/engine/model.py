"""Llama-family decoder in plain torch, over a flat batch of tokens from many sequences.

Covers Llama 2 / 3.x ("llama3" rope scaling), Qwen2 / 2.5 (q/k/v bias), Mistral and
SmolLM2 (tied embeddings). Weights use fused layouts (q|k|v in one matrix, gate|up in
one) so a step does few, large matmuls. The model sees only token ids, positions and
one AttnMetadata object per step; the attention backend it is given (attention.py) does
everything paged. It is built on the meta device and its weights are allocated once, on
the target device, in the target dtype; checkpoints are copied straight into the fused
slices (no float32 copy, no concatenation on the host). With an int8/fp8 weight_dtype the
2-D weights are quant.QuantizedWeight, quantized at load (see quant.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from localrun.engine import quant
from localrun.engine.attention import AttentionBackend, AttnMetadata, Ops
from localrun.engine.config import ModelConfig
from localrun.kernels import rope_cos_sin_cache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32, weight_dtype: str = "auto",
                 device="meta"):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_id = layer_id
        self.nq, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.scale = d ** -0.5

        def e(*shape):
            return torch.empty(*shape, dtype=dtype)

        self.input_layernorm = nn.Parameter(e(h), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(e(h), requires_grad=False)
        w = lambda n, k: quant.make_weight(n, k, dtype, weight_dtype, device)  # noqa: E731 - float or int8/fp8
        self.qkv_proj = w((self.nq + 2 * self.nkv) * d, h)
        self.qkv_bias = nn.Parameter(e((self.nq + 2 * self.nkv) * d), requires_grad=False) if cfg.attention_bias else None
        self.o_proj = w(h, self.nq * d)
        self.gate_up_proj = w(2 * cfg.intermediate_size, h)
        self.down_proj = w(h, cfg.intermediate_size)

    def forward(self, x, residual, positions, meta: AttnMetadata, ops: Ops, attn: AttentionBackend, cos_sin):
        h, residual = ops.fused_add_rmsnorm(x, residual, self.input_layernorm, self.eps)
        qkv = quant.linear(h, self.qkv_proj, self.qkv_bias)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k = ops.apply_rope(q.view(T, self.nq, self.d), k.view(T, self.nkv, self.d), positions, cos_sin)
        o = attn.forward(q, k, v.view(T, self.nkv, self.d), self.layer_id, meta, self.scale)
        x = quant.linear(o.reshape(T, self.nq * self.d), self.o_proj)
        h, residual = ops.fused_add_rmsnorm(x, residual, self.post_attention_layernorm, self.eps)
        x = quant.linear(ops.silu_and_mul(quant.linear(h, self.gate_up_proj)), self.down_proj)
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, device, ops: Ops,
                 weight_dtype: str = "auto"):
        super().__init__()
        self.cfg, self.ops, self.dtype = cfg, ops, dtype
        w = lambda n, k: quant.make_weight(n, k, dtype, weight_dtype, device)  # noqa: E731 - float or int8/fp8
        self.attn: AttentionBackend | None = None  # set by the model runner (it owns the KV pool)
        with torch.device("meta"):  # shapes only: the weights are allocated once, below
            self.embed_tokens = w(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, weight_dtype, device) for i in range(cfg.num_layers))
            self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
            self.lm_head = None if cfg.tie_word_embeddings else w(cfg.vocab_size, cfg.hidden_size)
        self.to_empty(device=device)
        # [max_pos, head_dim]: cos | sin (NeoX half-split), with the config's rope scaling
        cos_sin = rope_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, device=device, dtype=dtype)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of tokens."""
        attn = attn or self.attn
        x, residual = quant.embedding(input_ids, self.embed_tokens, self.dtype), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta, self.ops, attn, self.cos_sin)
        return self.ops.fused_add_rmsnorm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return quant.linear(hidden, w).float()

    # -- weights -----------------------------------------------------------------------------
    def load_hf_state(self, get, names: set[str]) -> None:
        """Copy weights given by HF name. `get(name)` returns a tensor (any device and dtype);
        `names` lists what exists. Each tensor goes straight into its slice of a fused weight."""
        def put(dst: torch.Tensor, name: str, start: int = 0, n: int | None = None) -> None:
            if isinstance(dst, quant.QuantizedWeight):  # quantized at load, straight from the source
                return dst.load(get, [(name, dst.shape[0])])
            src = get(name)
            if n is not None:
                dst = dst[start:start + n]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} does not match the config's {tuple(dst.shape)}")
            dst.copy_(src)

        def put_fused(dst: torch.Tensor, parts: list[tuple[str, int]]) -> None:
            if isinstance(dst, quant.QuantizedWeight):
                return dst.load(get, parts)
            start = 0
            for name, n in parts:
                put(dst, name, start, n)
                start += n

        with torch.no_grad():
            put(self.embed_tokens, "model.embed_tokens.weight")
            put(self.norm, "model.norm.weight")
            if self.lm_head is not None:
                put(self.lm_head, "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                put(layer.input_layernorm, p + "input_layernorm.weight")
                put(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
                widths = [layer.nq * layer.d, layer.nkv * layer.d, layer.nkv * layer.d]
                put_fused(layer.qkv_proj, [(p + f"self_attn.{n}_proj.weight", w) for n, w in zip("qkv", widths)])
                if layer.qkv_bias is not None:
                    put_fused(layer.qkv_bias, [(p + f"self_attn.{n}_proj.bias", w) for n, w in zip("qkv", widths)])
                put(layer.o_proj, p + "self_attn.o_proj.weight")
                inter = layer.down_proj.shape[1]
                put_fused(layer.gate_up_proj, [(p + "mlp.gate_proj.weight", inter), (p + "mlp.up_proj.weight", inter)])
                put(layer.down_proj, p + "mlp.down_proj.weight")

    def init_random(self, seed: int = 0) -> None:
        """Random weights with sane scales (for throughput benchmarks of exact shapes), drawn on
        the model's device."""
        dev = self.cos_sin.device
        g = torch.Generator(device=dev).manual_seed(seed)
        with torch.no_grad():
            for name, p in quant.named_weights(self):  # parameters and quantized weights, one order
                if isinstance(p, quant.QuantizedWeight):
                    p.allocate()
                elif p.dim() == 1:
                    p.fill_(1.0) if "layernorm" in name or name == "norm" else p.zero_()
                    continue
                std = 1.0 / math.sqrt(p.shape[1])
                for start in range(0, p.shape[0], 4096):  # in slices: never a second full fp32 copy
                    rows = min(4096, p.shape[0] - start)
                    w = torch.randn(rows, p.shape[1], generator=g, device=dev) * std
                    p.set_rows(start, w) if isinstance(p, quant.QuantizedWeight) else p[start:start + rows].copy_(w)
