"""Llama-family decoder in plain torch, over a flat batch of tokens from many sequences.

Covers Llama 2 / 3.x ("llama3" rope scaling), Qwen2 / 2.5 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm before RoPE), Mistral (sliding window), SmolLM2 (tied embeddings) and Phi-3 / Phi-4
(checkpoints with fused qkv_proj / gate_up_proj, "longrope" scaling, partial rotary, sliding
window). Weights use fused layouts (q|k|v in one matrix, gate|up in
one) so a step does few, large matmuls. The model sees only token ids, positions and
one AttnMetadata object per step; the attention backend it is given (layers/attention/) does
everything paged. It is built on the meta device and its weights are allocated once, on
the target device, in the target dtype; checkpoints are copied straight into the fused
slices (no float32 copy, no concatenation on the host). With an int8/fp8 weight_dtype the
2-D weights are quant.QuantizedWeight, quantized at load (see layers/quant.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from localrun.engine.config import ModelConfig
from localrun.engine.layers import quant
from localrun.engine.layers.attention import AttentionBackend, AttnMetadata
from localrun.engine.layers.ops import Ops
from localrun.engine.models.registry import register
from localrun.engine.parallel.group import TPGroup
from localrun.kernels.ops import rope_cos_sin_cache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32, weight_dtype: str = "auto",
                 device="meta", tp: TPGroup | None = None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_id = layer_id
        self.tp = tp or TPGroup()
        world = self.tp.world  # this rank's shard: its q heads, its kv heads, its MLP columns
        self.nq, self.nkv, self.d = cfg.num_heads // world, cfg.num_kv_heads // world, d
        inter = cfg.intermediate_size // world
        self.eps = cfg.rms_norm_eps
        self.scale = d ** -0.5
        self.window = cfg.layer_window(layer_id)  # sliding window (Mistral, Qwen2); 0: global

        def e(*shape):
            return torch.empty(*shape, dtype=dtype)

        self.input_layernorm = nn.Parameter(e(h), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(e(h), requires_grad=False)
        w = lambda n, k: quant.make_weight(n, k, dtype, weight_dtype, device)  # noqa: E731 - float or int8/fp8
        self.qkv_proj = w((self.nq + 2 * self.nkv) * d, h)
        self.qkv_bias = nn.Parameter(e((self.nq + 2 * self.nkv) * d), requires_grad=False) if cfg.attention_bias else None
        self.q_norm = nn.Parameter(e(d), requires_grad=False) if cfg.qk_norm else None  # Qwen3: per head, pre-RoPE
        self.k_norm = nn.Parameter(e(d), requires_grad=False) if cfg.qk_norm else None
        self.o_proj = w(h, self.nq * d)
        self.gate_up_proj = w(2 * inter, h)
        self.down_proj = w(h, inter)

    def forward(self, x, residual, positions, meta: AttnMetadata, ops: Ops, attn: AttentionBackend, cos_sin):
        h, residual = ops.fused_add_rmsnorm(x, residual, self.input_layernorm, self.eps)
        qkv = ops.linear(h, self.qkv_proj, self.qkv_bias)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k = q.view(T, self.nq, self.d), k.view(T, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = ops.rms_norm(q, self.q_norm, self.eps), ops.rms_norm(k, self.k_norm, self.eps)
        q, k = ops.apply_rope(q, k, positions, cos_sin)
        o = attn.forward(q, k, v.view(T, self.nkv, self.d), self.layer_id, meta, self.scale,
                         **({"window": self.window} if self.window else {}))
        x = self.tp.all_reduce(ops.linear(o.reshape(T, self.nq * self.d), self.o_proj))  # row-parallel
        h, residual = ops.fused_add_rmsnorm(x, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h, ops), residual

    def mlp(self, h: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The feed-forward block (a mixture of experts in models/moe_llama.py), all-reduced over the ranks."""
        return self.tp.all_reduce(ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up_proj)), self.down_proj))


class LlamaModel(nn.Module):
    layer_cls = DecoderLayer  # a subclass's own decoder layer (models/gemma.py)

    @staticmethod
    def pointwise_kernels(cfg: ModelConfig) -> tuple[str, ...]:
        """The pointwise kernels (layers/ops.Ops) this family's forward calls: tried at load."""
        return ("fused_add_rmsnorm", "apply_rope", "silu_and_mul") + (("rms_norm",) if cfg.qk_norm else ())

    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, device, ops: Ops,
                 weight_dtype: str = "auto", tp: TPGroup | None = None):
        super().__init__()
        self.cfg, self.ops, self.dtype = cfg, ops, dtype
        self.tp = tp or TPGroup()
        w = lambda n, k: quant.make_weight(n, k, dtype, weight_dtype, device)  # noqa: E731 - float or int8/fp8
        self.attn: AttentionBackend | None = None  # set by the model runner (it owns the KV pool)
        self.vocab_start, self.vocab_rows, vocab = self.tp.vocab_shard(cfg.vocab_size)  # vocab-parallel rows
        with torch.device("meta"):  # shapes only: the weights are allocated once, below
            self.embed_tokens = w(vocab, cfg.hidden_size)
            self.layers = nn.ModuleList(self.layer_cls(cfg, i, dtype, weight_dtype, device, self.tp)
                                        for i in range(cfg.num_layers))
            self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
            self.lm_head = None if cfg.tie_word_embeddings else w(vocab, cfg.hidden_size)
        self.to_empty(device=device)
        if vocab > self.vocab_rows:  # the last shard's padding rows: zero embeddings and logits (cut off)
            for w in (self.embed_tokens, self.lm_head):
                if w is not None:
                    w.data[self.vocab_rows:].zero_()
        # [max_pos, rotary_dim]: cos | sin (NeoX half-split), with the config's rope scaling
        cos_sin = rope_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, device=device, dtype=dtype,
                                     rotary_dim=cfg.rotary_dim)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of tokens."""
        attn = attn or self.attn
        x, residual = self._embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta, self.ops, attn, self.cos_sin)
        return self.ops.fused_add_rmsnorm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return quant.embedding(input_ids, self.embed_tokens, self.dtype)
        local = input_ids - self.vocab_start  # vocab-parallel: look up the ids this rank holds, sum over ranks
        mine = (local >= 0) & (local < self.vocab_rows)
        x = quant.embedding(torch.where(mine, local, 0), self.embed_tokens, self.dtype) * mine.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, vocab] float32 logits (with tensor parallelism: on rank 0; None on the others)."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.tp.gather_logits(self.ops.linear(hidden, w), self.cfg.vocab_size)
        return None if logits is None else logits.float()

    # -- weights -----------------------------------------------------------------------------
    def load_hf_state(self, get, names: set[str]) -> None:
        """Copy weights given by HF name. `get(name)` returns a tensor (any device and dtype);
        `names` lists what exists. Each tensor goes straight into its slice of a fused weight.
        With tensor parallelism only this rank's shard is read: `get.part(name, dim, start, n)`
        when the getter has it (the loaders' getters slice the checkpoint), else a narrow().
        Quantized weights (int8/fp8) are quantized at load, straight from the source (one rank only)."""
        r = self.tp.rank

        def put(dst: torch.Tensor, name: str, start: int = 0, n: int | None = None, shard_dim: int | None = None,
                shard_at: int = 0, shard_n: int = 0) -> None:
            if isinstance(dst, quant.QuantizedWeight):  # EngineConfig refuses quantized weights with TP > 1
                return dst.load(get, [(name, dst.shape[0])])
            if n is not None:
                dst = dst[start:start + n]
            if shard_dim is None:
                src = get(name)
            else:  # this rank's rows (dim 0) or columns (dim 1) of the checkpoint tensor
                part = getattr(get, "part", None)
                src = part(name, shard_dim, shard_at, shard_n) if part else get(name).narrow(shard_dim, shard_at, shard_n)
                if shard_n < dst.shape[shard_dim]:  # the last vocabulary shard's padding
                    dst = dst.narrow(shard_dim, 0, shard_n)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} does not match the config's {tuple(dst.shape)}")
            dst.copy_(src)

        def put_fused(dst: torch.Tensor, parts: list[tuple[str, int]]) -> None:
            if isinstance(dst, quant.QuantizedWeight):
                return dst.load(get, parts)
            start = 0
            for name, n in parts:  # rank r holds rows [r*n, (r+1)*n) of each part
                put(dst, name, start, n, *((0, r * n, n) if self.tp.world > 1 else ()))
                start += n

        def put_rows(dst: torch.Tensor, name: str, segments: list[tuple[int, int]]) -> None:
            """A checkpoint tensor fused as `dst` is: this rank's row ranges (first row, rows) of it,
            stacked (all of it when unsharded)."""
            if isinstance(dst, quant.QuantizedWeight):  # one rank only: the whole tensor
                return dst.load(get, [(name, dst.shape[0])])
            if self.tp.world == 1:
                return put(dst, name)
            start = 0
            for at, n in segments:
                put(dst, name, start, n, 0, at, n)
                start += n

        def put_cols(dst: torch.Tensor, name: str) -> None:  # row-parallel: this rank's input columns
            n = dst.shape[1]
            put(dst, name, *((None, None, 1, r * n, n) if self.tp.world > 1 else ()))

        def put_vocab(dst: torch.Tensor, name: str) -> None:
            put(dst, name, *((None, None, 0, self.vocab_start, self.vocab_rows) if self.tp.world > 1 else ()))

        q_rows, kv_rows = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        with torch.no_grad():
            put_vocab(self.embed_tokens, "model.embed_tokens.weight")
            put(self.norm, "model.norm.weight")
            if self.lm_head is not None:
                put_vocab(self.lm_head, "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                put(layer.input_layernorm, p + "input_layernorm.weight")
                put(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
                widths = [layer.nq * layer.d, layer.nkv * layer.d, layer.nkv * layer.d]
                if p + "self_attn.qkv_proj.weight" in names:  # Phi-3: the checkpoint is fused already
                    put_rows(layer.qkv_proj, p + "self_attn.qkv_proj.weight", [
                        (r * widths[0], widths[0]), (q_rows + r * widths[1], widths[1]),
                        (q_rows + kv_rows + r * widths[2], widths[2])])
                else:
                    put_fused(layer.qkv_proj, [(p + f"self_attn.{n}_proj.weight", w) for n, w in zip("qkv", widths)])
                if layer.q_norm is not None:
                    put(layer.q_norm, p + "self_attn.q_norm.weight")
                    put(layer.k_norm, p + "self_attn.k_norm.weight")
                if layer.qkv_bias is not None:
                    put_fused(layer.qkv_bias, [(p + f"self_attn.{n}_proj.bias", w) for n, w in zip("qkv", widths)])
                put_cols(layer.o_proj, p + "self_attn.o_proj.weight")
                if layer.down_proj is None:  # a mixture-of-experts layer: its subclass loads the experts
                    continue
                inter = layer.down_proj.shape[1]
                if p + "mlp.gate_up_proj.weight" in names:  # Phi-3: gate | up fused in the checkpoint
                    put_rows(layer.gate_up_proj, p + "mlp.gate_up_proj.weight",
                             [(r * inter, inter), (self.cfg.intermediate_size + r * inter, inter)])
                else:
                    put_fused(layer.gate_up_proj, [(p + "mlp.gate_proj.weight", inter), (p + "mlp.up_proj.weight", inter)])
                put_cols(layer.down_proj, p + "mlp.down_proj.weight")

    def init_random(self, seed: int = 0) -> None:
        """Random weights with sane scales (for throughput benchmarks of exact shapes), drawn on
        the model's device."""
        dev = self.cos_sin.device
        g = torch.Generator(device=dev).manual_seed(seed)
        with torch.no_grad():
            for name, p in quant.named_weights(self):  # parameters and quantized weights, one order
                if isinstance(p, quant.QuantizedWeight):
                    p.allocate()
                elif p.dim() > 2:  # stacked experts: the subclass draws them (models/moe_llama.py)
                    continue
                elif p.dim() == 1:
                    p.fill_(1.0) if name.rsplit(".", 1)[-1].endswith("norm") else p.zero_()  # norms: 1, biases: 0
                    continue
                (full_rows, full_cols), segments, (c0, nc) = self._shard_layout(name, p)
                std = 1.0 / math.sqrt(full_cols)
                for start in range(0, full_rows, 4096):  # in slices: never a second full fp32 copy
                    rows = min(4096, full_rows - start)
                    chunk = torch.randn(rows, full_cols, generator=g, device=dev)  # the whole model's draw...
                    if isinstance(p, quant.QuantizedWeight):  # (one rank only: never sharded)
                        p.set_rows(start, chunk * std)
                        continue
                    for src, n, dst in segments:  # ... of which this rank keeps its shard
                        lo, hi = max(src, start), min(src + n, start + rows)
                        if lo < hi:
                            p[dst + lo - src:dst + hi - src].copy_(chunk[lo - start:hi - start, c0:c0 + nc] * std)

    def _shard_layout(self, name: str, p: torch.Tensor) -> tuple[tuple[int, int], list[tuple[int, int, int]],
                                                                  tuple[int, int]]:
        """A 2-D weight's unsharded shape, its row segments held here (first row in the full
        weight, rows, first row in `p`) and the column range held here: random weights equal
        for every tensor_parallel."""
        w, r, cfg = self.tp.world, self.tp.rank, self.cfg
        rows, cols = p.shape
        if w == 1:
            return (rows, cols), [(0, rows, 0)], (0, cols)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head"):
            return (cfg.vocab_size, cols), [(self.vocab_start, self.vocab_rows, 0)], (0, cols)
        d, nq, nkv = cfg.head_dim, cfg.num_heads // w, cfg.num_kv_heads // w
        if leaf == "qkv_proj":
            q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
            return (q + 2 * kv, cols), [(r * nq * d, nq * d, 0), (q + r * nkv * d, nkv * d, nq * d),
                                        (q + kv + r * nkv * d, nkv * d, (nq + nkv) * d)], (0, cols)
        if leaf == "gate_up_proj":
            i = rows // 2
            return (2 * i * w, cols), [(r * i, i, 0), (i * w + r * i, i, i)], (0, cols)
        if leaf in ("o_proj", "down_proj"):  # row-parallel: this rank's input columns
            return (rows, cols * w), [(0, rows, 0)], (r * cols, cols)
        raise ValueError(f"no tensor-parallel layout for weight {name}")


register(LlamaModel)  # the default family: every config no other family claims
