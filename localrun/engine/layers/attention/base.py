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
hooks the decode graphs use. Two backends implement it: `TritonAttention` (triton_backend.py:
localrun.kernels' Triton kernels, CUDA) and `TorchAttention` (torch_backend.py: their torch
references, the CPU path and the oracle). The pointwise ops live in layers/ops.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from localrun.engine.kv.pool import KVPool, PageTable
from localrun.kernels.reference import causal_attention


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
    # prompt rows whose logits are scored (SamplingParams.prompt_logprobs): token index [R] of each, the
    # prompt token it predicts [R], and per scored sequence (sequence, position of its first row, rows)
    score_idx: list[int] | None = None
    score_next: list[int] | None = None
    score_seqs: list | None = None

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

    def __init__(self, max_tokens: int, max_seqs: int, device, separate: bool | None = None,
                 max_samples: int | None = None) -> None:
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.max_samples = max_samples or max_seqs  # sampled positions per step (more with speculative decoding)
        sizes = {"input_ids": max_tokens, "prev_idx": max_tokens, "positions": max_tokens, "slots": max_tokens,
                 "seq_lens": max_seqs, "cu_seqlens_q": max_seqs + 1, "rows": max_seqs,
                 "sample_idx": self.max_samples}
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
        if step.num_tokens > self.max_tokens or len(step.seq_lens) > self.max_seqs \
                or len(step.sample_idx) > self.max_samples:
            raise ValueError(f"a step of {step.num_tokens} tokens / {len(step.seq_lens)} sequences / "
                             f"{len(step.sample_idx)} sampled positions exceeds the buffers ({self.max_tokens} / "
                             f"{self.max_seqs} / {self.max_samples})")
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


class AttentionBackend(ABC):
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
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's K/V into the pages, then attend through the page table.

        window > 0: the layer's sliding window (a query at position p sees keys p - window < j <= p;
        every page is kept, the kernels skip those wholly outside it); softcap > 0: attention logit
        soft-capping (Gemma 2); sinks (float32 [num_heads]): gpt-oss's per-head sink logits, which join
        each softmax's denominator. All are per-layer constants (nothing to sync: CUDA-graph safe)."""
        ws = {"window": window, "softcap": softcap} if window or softcap else {}
        if sinks is not None:
            ws["sinks"] = sinks
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
    # window / softcap / sinks: see forward)
    @abstractmethod
    def store_kv(self, k, v, kv, slots) -> None:
        """Write this step's K/V (and their scales, for a quantized pool) into `slots`; a slot
        of -1 is a padding row and is skipped."""

    @abstractmethod
    def decode(self, q, kv, meta: AttnMetadata, a: int, b: int, scale: float, window: int = 0,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for decode sequences [a, b) (one query each) through the page table; the
        keys include the one just stored. Returns [b - a, num_heads, head_dim]."""

    @abstractmethod
    def extend(self, q, kv, meta: AttnMetadata, a: int, b: int, scale: float, window: int = 0,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention for extend sequences [a, b) (a chunk of queries each, after their
        cached prefix) through the page table. Returns q's shape."""

    @staticmethod
    def _no_cache_attention(q, k, v, meta, scale, window: int = 0, softcap: float = 0.0, sinks=None):
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for s, e in zip(starts[:-1], starts[1:]):
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e], scale, softcap=softcap, window=window, sinks=sinks)
        return out
