"""Attention backends, the per-step metadata they read, and the persistent buffers it lives in.

KV layout, shared with localrun.kernels: per layer one K and one V tensor of shape
[num_pages, page_size, num_kv_heads, head_dim]; token slot = page_id * page_size + offset.
A quantized pool (int8 / fp8) adds a float32 scale tensor [num_pages, page_size, num_kv_heads]
for each; the backends pass a layer's (k, v, k_scale, v_scale) to the kernels as they are.

A step's inputs (token ids, positions, KV slots, sequence lengths, query offsets, page-table
rows) are written into one preallocated int32 host array and uploaded in one copy into one
preallocated device buffer (`StepBuffers`; pinned and double-buffered on CUDA, the same
memory on CPU). Every field sits at a fixed offset, so a CUDA graph captured over these
buffers replays any later step of its batch size. An `AttentionBackend` turns a step into
`AttnMetadata` (views of those buffers plus host-side facts), runs attention for a layer
(store this step's K/V, then attend through the page table), and has the capture/replay
hooks the decode graphs use. Two backends: `TritonAttention` (localrun.kernels' Triton
kernels, CUDA) and `TorchAttention` (their torch references: the CPU path and the oracle).
`Ops` holds the pointwise ops (norm, RoPE, SiLU / GELU-tanh gates), Triton or reference alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from localrun import kernels
from localrun.engine.kv_pool import KVPool, PageTable
from localrun.kernels.reference import causal_attention

log = logging.getLogger("localrun.engine")

_POINTWISE = ("fused_add_rmsnorm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm")


@dataclass
class AttnMetadata:
    """What attention needs for one step over a flat batch of T tokens from B sequences.

    Sequences are ordered decodes first (q_len 1), then prefill/extend chunks.
    """

    positions: torch.Tensor  # int32 [T]
    slot_mapping: torch.Tensor | None  # int32 [T]; None: no KV cache (embeddings)
    page_table: torch.Tensor | None  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B], full length incl. prefix and this chunk
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    num_decodes: int  # the first num_decodes sequences have q_len 1
    max_q_len: int
    seq_lens_list: list[int] | None = None  # host copies (the reference path needs no device syncs)
    q_lens_list: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs


@dataclass
class HostStep:
    """One scheduled step, as host arrays (built by the model runner, O(batch + tokens))."""

    input_ids: np.ndarray  # int32 [T]; a pending token (not yet on the host) is 0 here ...
    prev_idx: np.ndarray  # int32 [T]; ... and its row in the previous step's sampled tokens here (else -1)
    positions: np.ndarray  # int32 [T]
    slots: np.ndarray  # int32 [T]; -1: padding, writes nothing
    seq_lens: np.ndarray  # int32 [B]
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    rows: np.ndarray  # int32 [B] page-table rows
    sample_idx: np.ndarray  # int32 [S]: token index of each sampling sequence's last token
    num_decodes: int
    num_real_seqs: int  # sequences before padding (a padded decode batch has more rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def has_pending(self) -> bool:
        return bool(self.prev_idx.size) and int(self.prev_idx.max()) >= 0


class StepBuffers:
    """Persistent step inputs: one int32 host array and one int32 device buffer, every field at
    a fixed offset. On CUDA the host side is two pinned arrays used in turn (the CPU fills one
    while the previous step's upload may still read the other); on CPU host and device are one."""

    def __init__(self, max_tokens: int, max_seqs: int, device, separate: bool | None = None) -> None:
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        sizes = {"input_ids": max_tokens, "prev_idx": max_tokens, "positions": max_tokens, "slots": max_tokens,
                 "seq_lens": max_seqs, "cu_seqlens_q": max_seqs + 1, "rows": max_seqs, "sample_idx": max_seqs}
        self.offsets, total = {}, 0
        for name, n in sizes.items():
            self.offsets[name] = (total, n)
            total += -(-n // 32) * 32  # 128-byte aligned fields
        self.size = total
        cuda = self.device.type == "cuda"
        # separate host and device memory (CUDA; on CPU only to test that path)
        self.separate = cuda if separate is None else separate
        self._hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=cuda) for _ in range(2 if self.separate else 1)]
        self._events: list = [None] * len(self._hosts)
        self._turn = 0
        self.device_buf = (torch.zeros(total, dtype=torch.int32, device=self.device) if self.separate
                           else self._hosts[0])
        self.d = {name: self.device_buf[o:o + n] for name, (o, n) in self.offsets.items()}

    def write(self, step: HostStep) -> None:
        """Fill the host array with the step and upload it (one copy, in stream order)."""
        if step.num_tokens > self.max_tokens or len(step.seq_lens) > self.max_seqs:
            raise ValueError(f"a step of {step.num_tokens} tokens / {len(step.seq_lens)} sequences exceeds the "
                             f"buffers ({self.max_tokens} / {self.max_seqs})")
        self._turn = (self._turn + 1) % len(self._hosts)
        host, event = self._hosts[self._turn], self._events[self._turn]
        if event is not None:
            event.synchronize()  # the upload that last read this array is done (long ago, in practice)
        h = host.numpy()
        for name in ("input_ids", "prev_idx", "positions", "slots", "seq_lens", "cu_seqlens_q", "rows", "sample_idx"):
            arr = getattr(step, name)
            o = self.offsets[name][0]
            h[o:o + len(arr)] = arr
        if self.separate:
            end = self.offsets["sample_idx"][0] + len(step.sample_idx)
            self.device_buf[:end].copy_(host[:end], non_blocking=True)
            if self.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
                self._events[self._turn] = ev

    def view(self, name: str, n: int) -> torch.Tensor:
        return self.d[name][:n]


def padding_step(bs: int, dummy_row: int) -> HostStep:
    """A decode step of bs padding rows (what a CUDA graph is captured with)."""
    z = np.zeros(bs, dtype=np.int32)
    return HostStep(input_ids=z, prev_idx=z - 1, positions=z, slots=z - 1, seq_lens=z,
                    cu_seqlens_q=np.arange(bs + 1, dtype=np.int32), rows=z + dummy_row,
                    sample_idx=np.arange(bs, dtype=np.int32), num_decodes=bs, num_real_seqs=0)


class AttentionBackend:
    """Paged attention for the model: `prepare` a step's metadata from the persistent buffers,
    `forward` one layer, and the hooks decode CUDA graphs need (`graphable`, and metadata that
    references only persistent buffers: `prepare(step, for_graph=True)`)."""

    graphable = False  # whether forward() may be captured in a CUDA graph (no host syncs)

    def __init__(self, pool: KVPool, table: PageTable, buffers: StepBuffers) -> None:
        self.pool, self.table, self.buffers = pool, table, buffers
        # the batch's page-table rows, gathered on the device from the persistent table
        self.batch_table = torch.zeros((buffers.max_seqs, table.max_pages), dtype=torch.int32, device=buffers.device)

    def prepare(self, step: HostStep, for_graph: bool = False) -> AttnMetadata:
        """Metadata for a step whose arrays are already in `self.buffers` (StepBuffers.write).

        for_graph: the metadata a CUDA graph captures and replays, so no host-side hints."""
        B, T = len(step.seq_lens), step.num_tokens
        self.table.flush()
        b = self.buffers
        torch.index_select(self.table.table, 0, b.view("rows", B), out=self.batch_table[:B])
        lens = None if for_graph else step.seq_lens.tolist()
        q_lens = None if for_graph else np.diff(step.cu_seqlens_q).tolist()
        max_q = 1 if step.num_decodes == B else int(np.diff(step.cu_seqlens_q).max())
        return AttnMetadata(positions=b.view("positions", T), slot_mapping=b.view("slots", T),
                            page_table=self.batch_table[:B], seq_lens=b.view("seq_lens", B),
                            cu_seqlens_q=b.view("cu_seqlens_q", B + 1), num_decodes=step.num_decodes,
                            max_q_len=max_q, seq_lens_list=lens, q_lens_list=q_lens)

    def forward(self, q, k, v, layer: int, meta: AttnMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        """Store this step's K/V into the pages, then attend through the page table.

        window > 0: the layer's sliding window (a query at position p sees keys p - window < j <= p;
        every page is kept, the kernels skip those wholly outside it); softcap > 0: attention logit
        soft-capping (Gemma 2). Both are per-layer constants (nothing to sync: CUDA-graph safe)."""
        ws = {"window": window, "softcap": softcap} if window or softcap else {}
        if meta.slot_mapping is None:  # no cache (embeddings): plain causal attention per sequence
            return self._no_cache_attention(q, k, v, meta, scale, **ws)
        kv = self.pool.layers[layer]  # (k_cache, v_cache, k_scale, v_scale); scales None unless quantized
        self.store_kv(k, v, kv, meta.slot_mapping)
        nd = meta.num_decodes
        if meta.is_decode_only:
            return self.decode(q, kv, meta, 0, nd, scale, **ws)
        if nd == 0:
            return self.extend(q, kv, meta, 0, meta.num_seqs, scale, **ws)
        out = torch.empty_like(q)
        out[:nd] = self.decode(q[:nd], kv, meta, 0, nd, scale, **ws)
        out[nd:] = self.extend(q[nd:], kv, meta, nd, meta.num_seqs, scale, **ws)
        return out

    # the three primitives a backend implements (kv: one layer's KVPool.layers entry; sequences [a, b);
    # window / softcap: see forward)
    def store_kv(self, k, v, kv, slots) -> None:
        raise NotImplementedError

    def decode(self, q, kv, meta: AttnMetadata, a: int, b: int, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        raise NotImplementedError

    def extend(self, q, kv, meta: AttnMetadata, a: int, b: int, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _no_cache_attention(q, k, v, meta, scale, window: int = 0, softcap: float = 0.0):
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for s, e in zip(starts[:-1], starts[1:]):
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e], scale, softcap=softcap, window=window)
        return out


class TorchAttention(AttentionBackend):
    """The torch references (localrun.kernels.reference): exact, and cheap on CPU where host-side
    lengths let decode attend in groups of similar length."""

    def store_kv(self, k, v, kv, slots) -> None:
        kernels.store_kv_ref(k, v, kv[0], kv[1], slots, kv[2], kv[3])

    def decode(self, q, kv, meta, a, b, scale, window=0, softcap=0.0):
        lens = meta.seq_lens_list[a:b] if meta.seq_lens_list is not None else None
        return kernels.paged_decode_attention_ref(q, kv[0], kv[1], meta.page_table[a:b], meta.seq_lens[a:b], scale,
                                                  lens=lens, k_scale=kv[2], v_scale=kv[3], window=window,
                                                  softcap=softcap)

    def extend(self, q, kv, meta, a, b, scale, window=0, softcap=0.0):
        lens = meta.seq_lens_list[a:b] if meta.seq_lens_list is not None else None
        cu = meta.cu_seqlens_q[a:b + 1] - meta.cu_seqlens_q[a] if a else meta.cu_seqlens_q
        return kernels.extend_attention_ref(q, kv[0], kv[1], meta.page_table[a:b], cu, meta.seq_lens[a:b],
                                            scale, lens=lens, k_scale=kv[2], v_scale=kv[3], window=window,
                                            softcap=softcap)


class TritonAttention(AttentionBackend):
    """localrun.kernels' Triton kernels: split-KV decode (split count from host-known sizes, a
    runtime argument: one compiled kernel for all batch sizes) and the paged extend kernel."""

    graphable = True

    def store_kv(self, k, v, kv, slots) -> None:
        kernels.store_kv(k, v, kv[0], kv[1], slots, kv[2], kv[3])

    def decode(self, q, kv, meta, a, b, scale, window=0, softcap=0.0):
        return kernels.paged_decode_attention(q, kv[0], kv[1], meta.page_table[a:b], meta.seq_lens[a:b], scale,
                                              k_scale=kv[2], v_scale=kv[3], window=window, softcap=softcap)

    def extend(self, q, kv, meta, a, b, scale, window=0, softcap=0.0):
        cu, seq_lens = meta.cu_seqlens_q, meta.seq_lens
        if a:  # fresh (aligned) tensors: an offset view would make Triton compile another variant
            cu, seq_lens = cu[a:b + 1] - cu[a], seq_lens[a:b].clone()
        return kernels.extend_attention(q, kv[0], kv[1], meta.page_table[a:b], cu, seq_lens, scale,
                                        max_q_len=meta.max_q_len, k_scale=kv[2], v_scale=kv[3], window=window,
                                        softcap=softcap)


class Ops:
    """The model's pointwise ops: localrun.kernels' Triton kernels on CUDA tensors (reference=False)
    or their torch references."""

    def __init__(self, reference: bool = False) -> None:
        self.reference = reference
        for name in _POINTWISE:
            setattr(self, name, getattr(kernels, f"{name}_ref" if reference else name))


def check_kv_dtype(kv_dtype: torch.dtype, device, triton: bool) -> None:
    """fp8 pages on the Triton path need a GPU that converts fp8 (compute capability 8.9+)."""
    dev = torch.device(device)
    if triton and kv_dtype == torch.float8_e4m3fn and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 9):
            raise ValueError(f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this "
                             f"one is {cap[0]}.{cap[1]}: use kv_cache_dtype int8 (LOCALRUN_KV_CACHE_TYPE=int8)")


def use_triton(device: str, use: bool | None) -> bool:
    """The Triton kernels on CUDA (use None or True, when Triton imports); else the torch references."""
    if not str(device).startswith("cuda") or use is False:
        return False
    if not kernels.triton_available():
        if use:
            raise RuntimeError("use_triton=True but triton is not importable")
        log.warning("triton unavailable; using torch attention")
        return False
    return True


def make_backend(triton: bool, pool: KVPool, table: PageTable, buffers: StepBuffers) -> AttentionBackend:
    return (TritonAttention if triton else TorchAttention)(pool, table, buffers)
