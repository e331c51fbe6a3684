"""The torch reference attention backend (the CPU path, and the oracle for the Triton one)."""

from __future__ import annotations

from localrun.kernels import ops as kernels
from localrun.engine.layers.attention.base import AttentionBackend


class TorchAttention(AttentionBackend):
    """The torch references (localrun.kernels.reference): exact, and cheap on CPU where host-side
    lengths let decode attend in groups of similar length."""

    def store_kv(self, k, v, kv, slots) -> None:
        kernels.store_kv_ref(k, v, kv[0], kv[1], slots, kv[2], kv[3])

    def decode(self, q, kv, meta, a, b, scale, window=0, softcap=0.0, sinks=None):
        lens = meta.seq_lens_list[a:b] if meta.seq_lens_list is not None else None
        return kernels.paged_decode_attention_ref(q, kv[0], kv[1], meta.page_table[a:b], meta.seq_lens[a:b], scale,
                                                  lens=lens, k_scale=kv[2], v_scale=kv[3], window=window,
                                                  softcap=softcap, sinks=sinks)

    def extend(self, q, kv, meta, a, b, scale, window=0, softcap=0.0, sinks=None):
        lens = meta.seq_lens_list[a:b] if meta.seq_lens_list is not None else None
        cu = meta.cu_seqlens_q[a:b + 1] - meta.cu_seqlens_q[a] if a else meta.cu_seqlens_q
        return kernels.extend_attention_ref(q, kv[0], kv[1], meta.page_table[a:b], cu, meta.seq_lens[a:b],
                                            scale, lens=lens, k_scale=kv[2], v_scale=kv[3], window=window,
                                            softcap=softcap, sinks=sinks)
