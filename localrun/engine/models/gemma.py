"""Gemma 2 and Gemma 3 (text) on the Llama-family machinery of llama.py.

What differs from Llama, and where it is handled:
  * embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype (as transformers);
  * RMSNorm with (1 + weight): the +1 is folded into the weights at load (`load_hf_state`), so the
    plain norm kernel serves; a GGUF file already stores 1 + weight (loader.read_gguf takes it off
    again, so both formats arrive here in the Hugging Face convention);
  * four norms per layer: input, post_attention (on the attention output, before the residual add),
    pre_feedforward, post_feedforward (on the MLP output);
  * GeGLU MLP: gelu_tanh(gate) * up (kernels.gelu_tanh_and_mul);
  * attention scale query_pre_attn_scalar ** -0.5; Gemma 2's attention logit soft-capping and
    final logit soft-capping (compute_logits);
  * sliding-window layers (ModelConfig.layer_types: Gemma 2 every other layer, Gemma 3 five local to
    one global); Gemma 3's local layers use their own RoPE base (a second cos/sin table, no scaling)
    and q_norm / k_norm (per head, also 1 + weight) before RoPE;
  * tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from localrun.engine.config import ModelConfig
from localrun.engine.layers import quant
from localrun.engine.layers.attention import AttentionBackend, AttnMetadata
from localrun.engine.layers.ops import Ops
from localrun.engine.models.llama import DecoderLayer, LlamaModel
from localrun.engine.models.registry import register
from localrun.engine.parallel.group import TPGroup
from localrun.kernels.ops import rope_cos_sin_cache

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32, weight_dtype: str = "auto",
                 device="meta", tp: TPGroup | None = None):
        super().__init__(cfg, layer_id, dtype, weight_dtype, device, tp)
        h, d = cfg.hidden_size, cfg.head_dim
        self.scale = float(cfg.query_pre_attn_scalar or d) ** -0.5
        self.softcap = float(cfg.attn_logit_softcap or 0.0)
        self.local_rope = bool(cfg.rope_local_theta) and self.window > 0  # Gemma 3's sliding layers
        # norm weights in float32 whatever the model dtype: 1 + w rounded to bf16 would lose w's low bits
        # (transformers computes 1 + w in float32; the norm kernels read the weight as float32 anyway)
        norm = lambda n: nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(h), norm(h)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(h), norm(h)
        qk_norm = cfg.arch == "gemma3"
        self.q_norm = norm(d) if qk_norm else None
        self.k_norm = norm(d) if qk_norm else None

    def forward(self, x, residual, positions, meta: AttnMetadata, ops: Ops, attn: AttentionBackend, cos_sin):
        h, residual = ops.fused_add_rmsnorm(x, residual, self.input_layernorm, self.eps)
        qkv = ops.linear(h, self.qkv_proj, self.qkv_bias)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        if self.q_norm is not None:  # per-head RMSNorm of q and k (Gemma 3), before RoPE
            q = ops.fused_add_rmsnorm(q.reshape(T * self.nq, self.d), None, self.q_norm, self.eps)[0]
            k = ops.fused_add_rmsnorm(k.reshape(T * self.nkv, self.d), None, self.k_norm, self.eps)[0]
        q, k = ops.apply_rope(q.reshape(T, self.nq, self.d), k.reshape(T, self.nkv, self.d), positions, cos_sin)
        o = attn.forward(q, k, v.view(T, self.nkv, self.d), self.layer_id, meta, self.scale,
                         window=self.window, softcap=self.softcap)
        x = self.tp.all_reduce(ops.linear(o.reshape(T, self.nq * self.d), self.o_proj))  # row-parallel
        x = ops.fused_add_rmsnorm(x, None, self.post_attention_layernorm, self.eps)[0]
        h, residual = ops.fused_add_rmsnorm(x, residual, self.pre_feedforward_layernorm, self.eps)
        x = self.tp.all_reduce(ops.linear(ops.gelu_tanh_and_mul(ops.linear(h, self.gate_up_proj)), self.down_proj))
        return ops.fused_add_rmsnorm(x, None, self.post_feedforward_layernorm, self.eps)[0], residual


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer

    @staticmethod
    def pointwise_kernels(cfg: ModelConfig) -> tuple[str, ...]:
        return ("fused_add_rmsnorm", "apply_rope", "gelu_tanh_and_mul")  # its q/k norms are fused_add_rmsnorm too

    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, device, ops: Ops,
                 weight_dtype: str = "auto", tp: TPGroup | None = None):
        super().__init__(cfg, max_pos, dtype, device, ops, weight_dtype, tp)
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=torch.float32, device=device), requires_grad=False)
        # sqrt(hidden) rounded to the model dtype first, as transformers multiplies by a tensor of that dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype))
        self.final_softcap = float(cfg.final_logit_softcap or 0.0)
        cos_sin_local = self.cos_sin
        if cfg.rope_local_theta:  # Gemma 3: sliding layers rotate with their own base, unscaled
            cos_sin_local = rope_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_local_theta, None, device=device,
                                               dtype=dtype)
        self.register_buffer("cos_sin_local", cos_sin_local, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        attn = attn or self.attn
        x, residual = self._embed(input_ids) * self.embed_scale, None
        for layer in self.layers:
            cos_sin = self.cos_sin_local if layer.local_rope else self.cos_sin
            x, residual = layer(x, residual, positions, meta, self.ops, attn, cos_sin)
        return self.ops.fused_add_rmsnorm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None or not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_hf_state(self, get, names: set[str]) -> None:
        """The Llama-shaped weights, then Gemma's extra norms; every norm gets its +1 folded in."""
        super().load_hf_state(get, names)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                extra = [("pre_feedforward_layernorm", layer.pre_feedforward_layernorm),
                         ("post_feedforward_layernorm", layer.post_feedforward_layernorm)]
                if layer.q_norm is not None:
                    extra += [("self_attn.q_norm", layer.q_norm), ("self_attn.k_norm", layer.k_norm)]
                for name, dst in extra:
                    src = get(p + name + ".weight")
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(f"weight {p}{name}.weight: shape {tuple(src.shape)} does not match the "
                                         f"config's {tuple(dst.shape)}")
                    dst.copy_(src)
            for norm in self._norms():
                norm.add_(1.0)

    def init_random(self, seed: int = 0) -> None:
        super().init_random(seed)
        with torch.no_grad():  # norm weights as loaded (1 + 0): the plain RMSNorm
            for norm in self._norms():
                norm.fill_(1.0)

    def _norms(self) -> list[torch.Tensor]:
        out = [self.norm]
        for layer in self.layers:
            out += [getattr(layer, n) for n in _NORMS]
            out += [w for w in (layer.q_norm, layer.k_norm) if w is not None]
        return out


register(GemmaModel, when=lambda cfg: cfg.is_gemma)
