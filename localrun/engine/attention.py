"""Attention metadata (one object per step) and the ops the model calls.

KV layout, shared with localrun.kernels: per layer one K and one V tensor of shape
[num_pages, page_size, num_kv_heads, head_dim]; token slot = page_id * page_size + offset.

`Ops` holds torch reference implementations (CPU, and CUDA without Triton). On CUDA with
`use_triton`, `make_ops` swaps in the Triton kernels from localrun.kernels, which take the
same arguments. Triton is never imported on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger("localrun.engine")


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


# ---- torch reference ops ---------------------------------------------------------------------

def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    d = k_cache.shape[-2:]
    k_cache.view(-1, *d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """[..., n_pages] page ids -> [..., length, Hkv, D] tokens of those pages."""
    g = torch.index_select(cache, 0, pages.reshape(-1).long())  # much faster than cache[pages] on CPU
    return g.view(*pages.shape[:-1], -1, *g.shape[-2:])[..., :length, :, :]


def paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, max_len: int | None = None):
    """q [B, Hq, D] attends to the first seq_lens[b] cached tokens of its sequence."""
    B, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    L = int(seq_lens.max()) if max_len is None else max_len
    pages = page_table[:, : (L + page - 1) // page]
    k = _gather(k_cache, pages, L).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = _gather(v_cache, pages, L).transpose(1, 2)  # [B, Hkv, L, D]
    qg = q.view(B, hkv, hq // hkv, d)
    s = torch.matmul(qg, k).float() * scale  # [B, Hkv, G, L]
    mask = torch.arange(L, device=q.device)[None, :] >= seq_lens[:, None].to(q.device)
    s.masked_fill_(mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v).reshape(B, hq, d)


def _sdpa(q, k, v, mask, scale, causal=False):
    """q [Hq, n, D], k/v [Hkv, L, D] with grouped heads."""
    if k.shape[0] != q.shape[0]:
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def extend_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale,
                     q_lens: list[int] | None = None, lens: list[int] | None = None):
    """q [T, Hq, D]: the new tokens of each sequence (already stored in the cache); query i of
    sequence b sits at position seq_lens[b] - q_len_b + i and sees cache positions <= its own."""
    page = k_cache.shape[1]
    lens = seq_lens.tolist() if lens is None else lens
    starts = cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for b, L in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        n = e - s
        pages = page_table[b, : (L + page - 1) // page]
        k = _gather(k_cache, pages, L).transpose(0, 1)
        v = _gather(v_cache, pages, L).transpose(0, 1)
        qb = q[s:e].transpose(0, 1)
        if n == L:
            o = _sdpa(qb, k, v, None, scale, causal=True)
        else:
            qpos = torch.arange(L - n, L, device=q.device)[:, None]
            mask = torch.arange(L, device=q.device)[None, :] <= qpos
            o = _sdpa(qb, k, v, mask, scale)
        out[s:e] = o.transpose(0, 1)
    return out


def fused_add_rmsnorm(x, residual, weight, eps):
    """(rmsnorm(x + residual) * weight, x + residual); the same arithmetic as transformers."""
    if residual is not None:
        x = x + residual
    residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def apply_rope(q, k, positions, cos_sin_cache):
    """NeoX half-split rotation; cos_sin_cache [max_pos, D] = cat(cos, sin) of width D/2 each."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rot(q), rot(k)


def silu_and_mul(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


class Ops:
    """The model's compute primitives; torch by default, Triton kernels when swapped in."""

    def __init__(self) -> None:
        self.store_kv = store_kv
        self.paged_decode_attention = paged_decode_attention
        self.extend_attention = extend_attention
        self.fused_add_rmsnorm = fused_add_rmsnorm
        self.apply_rope = apply_rope
        self.silu_and_mul = silu_and_mul
        self.triton = False

    def attention(self, q, k, v, layer: int, meta: AttnMetadata, scale: float):
        """Store this step's K/V into the pages, then attend through the page table."""
        if meta.k_caches is None:  # no cache (embeddings): plain causal attention per sequence
            return self._no_cache_attention(q, k, v, meta, scale)
        kc, vc = meta.k_caches[layer], meta.v_caches[layer]
        self.store_kv(k, v, kc, vc, meta.slot_mapping)
        nd = meta.num_decodes
        if meta.is_decode_only:
            return self._decode(q, kc, vc, meta.page_table, meta.seq_lens, scale, meta.seq_lens_list)
        if nd == 0:
            return self._extend(q, kc, vc, meta.page_table, meta.cu_seqlens_q, meta.seq_lens, scale, meta, 0)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], kc, vc, meta.page_table[:nd], meta.seq_lens[:nd], scale, meta.seq_lens_list[:nd])
        cu = meta.cu_seqlens_q[nd:] - nd
        out[nd:] = self._extend(q[nd:], kc, vc, meta.page_table[nd:], cu, meta.seq_lens[nd:], scale, meta, nd)
        return out

    def _decode(self, q, kc, vc, pt, seq_lens, scale, lens: list[int], group: int = 8):
        """The torch path gathers K/V padded to the longest sequence; in groups of similar
        length that padding (and the memory traffic) stays small."""
        if self.triton or len(lens) <= group:
            return self.paged_decode_attention(q, kc, vc, pt, seq_lens, scale)
        order = sorted(range(len(lens)), key=lens.__getitem__)
        out = torch.empty_like(q)
        for g in range(0, len(order), group):
            idx = order[g:g + group]
            ix = torch.tensor(idx, device=q.device)
            out[ix] = paged_decode_attention(q[ix], kc, vc, pt[ix], seq_lens[ix], scale, max_len=lens[idx[-1]])
        return out

    def _extend(self, q, kc, vc, pt, cu, lens, scale, meta, nd):
        if self.triton:
            return self.extend_attention(q, kc, vc, pt, cu, lens, scale)
        return extend_attention(q, kc, vc, pt, cu, lens, scale, lens=meta.seq_lens_list[nd:])

    @staticmethod
    def _no_cache_attention(q, k, v, meta, scale):
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        for s, e in zip(starts[:-1], starts[1:]):
            o = _sdpa(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), None, scale, causal=True)
            out[s:e] = o.transpose(0, 1)
        return out


def make_ops(device: str, use_triton: bool | None) -> Ops:
    """Torch ops; on CUDA (use_triton None or True) the Triton kernels where localrun.kernels has them."""
    ops = Ops()
    if not str(device).startswith("cuda") or use_triton is False:
        return ops
    try:
        from localrun import kernels  # imports triton: only ever on CUDA
    except Exception as exc:  # noqa: BLE001 - a missing/broken kernels package falls back to torch
        if use_triton:
            raise RuntimeError(f"use_triton=True but localrun.kernels failed to import: {exc}") from exc
        log.warning("localrun.kernels unavailable (%s); using torch attention", exc)
        return ops
    for name in ("store_kv", "paged_decode_attention", "extend_attention", "fused_add_rmsnorm", "apply_rope", "silu_and_mul"):
        fn = getattr(kernels, name, None)
        if fn is not None:
            setattr(ops, name, fn)
    ops.triton = True
    return ops
