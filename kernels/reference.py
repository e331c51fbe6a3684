"""Pure-torch reference implementations of every op in localrun.kernels.

They are the CPU path of the native engine and the oracle the Triton kernels are tested
against, so they favour clarity and exact math (fp32 accumulation) over speed, while
staying vectorised enough for the CPU engine.

Shared conventions (see docs: engine API, "KV cache layout"):
  * k_cache / v_cache: [num_pages, page_size, num_kv_heads, head_dim] per layer;
    a token's slot = page_id * page_size + offset; a negative slot means "padding, skip".
  * page_table: int32 [batch, max_pages_per_seq] (unused entries may hold any value);
    seq_lens: int32 [batch], the full KV length of each sequence.
  * Query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA).
"""

from __future__ import annotations

import math

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping [T] (in place; slots < 0 skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, page_table: torch.Tensor, seq_len_bound: int, b: torch.Tensor | None = None):
    """Gather positions [0, seq_len_bound) of each sequence: [B, L, Hkv, D] (invalid slots read slot 0)."""
    page_size = cache.shape[1]
    pos = torch.arange(seq_len_bound, device=cache.device)
    table = page_table if b is None else page_table[b:b + 1]
    pages = table[:, pos // page_size].long()  # [B, L]
    slots = pages * page_size + pos % page_size
    slots = slots.clamp(0, cache.shape[0] * page_size - 1)  # padding entries may be anything
    return cache.reshape(-1, *cache.shape[2:])[slots]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, M, Hq, D], k/v [N, L, Hkv, D], allowed [N, M, L] (bool) -> [N, M, Hq, D] in fp32.

    Rows with no allowed key give zeros.
    """
    n, m, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qf = q.float().view(n, m, hkv, g, d)
    scores = torch.einsum("nmkgd,nlkd->nkgml", qf, k.float()) * scale  # [N, Hkv, G, M, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("nkgml,nlkd->nmkgd", probs, v.float())
    return out.reshape(n, m, hq, d)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               num_kv_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence attending to all seq_lens[b] cached tokens: q [B, Hq, D] -> [B, Hq, D].

    num_kv_splits (a Triton tuning knob) is accepted for signature parity and unused.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    allowed = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].long()  # [B, L]
    # Slots past a sequence's end may hold anything (even NaN in a fresh pool): zero them.
    k = _gather_kv(k_cache, page_table, max_len).masked_fill(~allowed[:, :, None, None], 0.0)
    v = _gather_kv(v_cache, page_table, max_len).masked_fill(~allowed[:, :, None, None], 0.0)
    out = _attend(q[:, None], k, v, allowed[:, None, :], scale)
    return out[:, 0].to(q.dtype)


_QUERY_CHUNK = 256


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_q_len: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix + themselves: q [T, Hq, D] -> [T, Hq, D].

    The new tokens' K/V are already in the cache. Query i of sequence b (rows
    cu_seqlens_q[b]..cu_seqlens_q[b+1]) sits at position seq_lens[b] - q_len_b + i and sees
    cache positions <= its own. max_q_len is accepted for signature parity and unused.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, kv_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = _gather_kv(k_cache, page_table, kv_len, b)
        v = _gather_kv(v_cache, page_table, kv_len, b)
        key_pos = torch.arange(kv_len, device=q.device)
        for cs in range(s, e, _QUERY_CHUNK):  # bounds the [Hq, chunk, kv_len] score matrix
            ce = min(cs + _QUERY_CHUNK, e)
            q_pos = torch.arange(kv_len - (e - cs), kv_len - (e - ce), device=q.device)
            allowed = key_pos[None, :] <= q_pos[:, None]
            out[cs:ce] = _attend(q[None, cs:ce], k, v, allowed[None], scale)[0].to(q.dtype)
    return out


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (or x when residual is None); out = RMSNorm(new_residual) * weight.

    The sum is rounded to x's dtype (as HF Llama does), the norm is computed in fp32.
    """
    new_residual = x if residual is None else x + residual
    h = new_residual.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), new_residual


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (fp64 on CPU), with optional HF-style rope scaling.

    Supported scaling types: None / "default", "linear" and "llama3" (Llama 3.1+).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}: localrun supports default, linear and llama3")


def rope_cos_sin_cache(head_dim: int, max_pos: int, base: float, scaling: dict | None = None,
                       device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                       rotary_dim: int | None = None) -> torch.Tensor:
    """The [max_pos, rotary_dim] table apply_rope reads: cos in the first half, sin in the second.

    rotary_dim defaults to head_dim (partial rotary: only the first rotary_dim dims rotate).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), rope_inv_freq(rotary_dim, base, scaling))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xf = x.float()
    x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2: rot], xf[..., rot:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX (half-split) rotary embedding of q [T, Hq, D] and k [T, Hkv, D] at positions [T].

    Returns new tensors; the inputs are not modified.
    """
    cs = cos_sin_cache[positions.long()].float()  # [T, rot]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] ([T, I]), computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
