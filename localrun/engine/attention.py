"""Attention metadata (one object per step) and the ops the model calls.

KV layout, shared with localrun.kernels: per layer one K and one V tensor of shape
[num_pages, page_size, num_kv_heads, head_dim]; token slot = page_id * page_size + offset.

The ops themselves live in localrun.kernels: one torch reference each (the CPU path, and the
oracle of the Triton kernels) and a Triton kernel (CUDA). `Ops` orchestrates a step (store
then attend, the decode/extend split, the no-cache embedding path); `make_ops` picks the
Triton kernels on CUDA and the references elsewhere. Triton is never imported on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from localrun import kernels
from localrun.kernels.reference import causal_attention

log = logging.getLogger("localrun.engine")

_OPS = ("store_kv", "paged_decode_attention", "extend_attention", "fused_add_rmsnorm", "apply_rope", "silu_and_mul")


@dataclass
class AttnMetadata:
    """What attention needs for one step over a flat batch of T tokens from B sequences.

    Sequences are ordered decodes first (q_len 1), then prefill/extend chunks.
    """

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor | None  # int64 [T]; None: no KV cache (embeddings)
    page_table: torch.Tensor | None  # int32 [B, P], padded with 0
    seq_lens: torch.Tensor  # int32 [B], full length incl. prefix and this chunk
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    prefix_lens: torch.Tensor  # int32 [B], tokens already in the cache before this step
    num_decodes: int  # the first num_decodes sequences have q_len 1
    is_decode_only: bool
    seq_lens_list: list[int] = field(default_factory=list)  # host copies (no device syncs)
    q_lens_list: list[int] = field(default_factory=list)
    k_caches: list[torch.Tensor] | None = None
    v_caches: list[torch.Tensor] | None = None

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.cu_seqlens_q


class Ops:
    """The model's compute primitives: localrun.kernels' ops, which run the Triton kernel on
    CUDA tensors and the torch reference otherwise; reference=True always runs the reference."""

    def __init__(self, reference: bool = False) -> None:
        for name in _OPS:
            setattr(self, name, getattr(kernels, f"{name}_ref" if reference else name))

    def attention(self, q, k, v, layer: int, meta: AttnMetadata, scale: float):
        """Store this step's K/V into the pages, then attend through the page table."""
        if meta.k_caches is None:  # no cache (embeddings): plain causal attention per sequence
            return self._no_cache_attention(q, k, v, meta, scale)
        kc, vc = meta.k_caches[layer], meta.v_caches[layer]
        self.store_kv(k, v, kc, vc, meta.slot_mapping)
        nd, lens = meta.num_decodes, meta.seq_lens_list or None
        if meta.is_decode_only:
            return self._decode(q, kc, vc, meta.page_table, meta.seq_lens, scale, lens)
        if nd == 0:
            return self.extend_attention(q, kc, vc, meta.page_table, meta.cu_seqlens_q, meta.seq_lens, scale, lens=lens)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], kc, vc, meta.page_table[:nd], meta.seq_lens[:nd], scale, lens and lens[:nd])
        cu = meta.cu_seqlens_q[nd:] - nd
        out[nd:] = self.extend_attention(q[nd:], kc, vc, meta.page_table[nd:], cu, meta.seq_lens[nd:], scale,
                                         lens=lens and lens[nd:])
        return out

    def _decode(self, q, kc, vc, pt, seq_lens, scale, lens: list[int] | None):
        """With host lengths the reference attends in groups of similar length (little padding)."""
        return self.paged_decode_attention(q, kc, vc, pt, seq_lens, scale, lens=lens)

    @staticmethod
    def _no_cache_attention(q, k, v, meta, scale):
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for s, e in zip(starts[:-1], starts[1:]):
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e], scale)
        return out


def make_ops(device: str, use_triton: bool | None) -> Ops:
    """The Triton kernels on CUDA (use_triton None or True, when Triton imports); else the torch references."""
    if not str(device).startswith("cuda") or use_triton is False:
        return Ops(reference=True)
    if not kernels.triton_available():
        if use_triton:
            raise RuntimeError("use_triton=True but triton is not importable")
        log.warning("triton unavailable; using torch attention")
        return Ops(reference=True)
    return Ops()
