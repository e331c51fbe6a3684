"""The Triton attention backend (localrun.kernels' paged kernels, CUDA)."""

from __future__ import annotations

from localrun.kernels import ops as kernels
from localrun.engine.layers.attention.base import AttentionBackend


class TritonAttention(AttentionBackend):
    """localrun.kernels' Triton kernels: split-KV decode (split count from host-known sizes, a
    runtime argument: one compiled kernel for all batch sizes) and the paged extend kernel."""

    graphable = True

    def __init__(self, pool, table, buffers, refs: frozenset[str] = frozenset()) -> None:
        """refs: the kernels among store_kv, paged_decode_attention and extend_attention that run
        their torch reference (their warm-up trial failed); decode graphs are then off (the
        references read lengths on the host)."""
        super().__init__(pool, table, buffers)
        self.refs = frozenset(refs)
        self._store, self._decode, self._extend = (
            getattr(kernels, f"{n}_ref" if n in self.refs else n)
            for n in ("store_kv", "paged_decode_attention", "extend_attention"))
        self.graphable = not self.refs & {"store_kv", "paged_decode_attention", "extend_attention"}

    def store_kv(self, k, v, kv, slots) -> None:
        self._store(k, v, kv[0], kv[1], slots, kv[2], kv[3])

    def decode(self, q, kv, meta, a, b, scale, window=0, softcap=0.0, sinks=None):
        return self._decode(q, kv[0], kv[1], meta.page_table[a:b], meta.seq_lens[a:b], scale,
                            k_scale=kv[2], v_scale=kv[3], window=window, softcap=softcap,
                            **({"sinks": sinks} if sinks is not None else {}))

    def extend(self, q, kv, meta, a, b, scale, window=0, softcap=0.0, sinks=None):
        cu, seq_lens = meta.cu_seqlens_q, meta.seq_lens
        if a:  # fresh (aligned) tensors: an offset view would make Triton compile another variant
            cu, seq_lens = cu[a:b + 1] - cu[a], seq_lens[a:b].clone()
        return self._extend(q, kv[0], kv[1], meta.page_table[a:b], cu, seq_lens, scale,
                            max_q_len=meta.max_q_len, k_scale=kv[2], v_scale=kv[3], window=window, softcap=softcap,
                            **({"sinks": sinks} if sinks is not None else {}))
