"""Pure-torch reference implementations of every op in localrun.kernels.

They are the CPU path of the native engine (and its CUDA path without Triton) and the
oracle the Triton kernels are tested against: exact math (fp32 accumulation) first, then
the cheap CPU techniques the engine needs (index_select page gathers, decode in groups of
similar length, SDPA for prefill). Optional keyword hints (host-side lengths) spare device
syncs; localrun.kernels drops them when it runs a Triton kernel instead.

Shared conventions (see docs: engine API, "KV cache layout"):
  * k_cache / v_cache: [num_pages, page_size, num_kv_heads, head_dim] per layer;
    a token's slot = page_id * page_size + offset; a negative slot means "padding, skip".
  * page_table: int32 [batch, max_pages_per_seq] (unused entries may hold any value);
    seq_lens: int32 [batch], the full KV length of each sequence.
  * Query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA).
  * Quantized KV (int8 or float8_e4m3fn caches): every cache has a float32 scale tensor
    k_scale / v_scale of shape [num_pages, page_size, num_kv_heads], one scale per token
    per KV head: value = stored * scale, scale = max|x| over head_dim / QMAX (127 for int8,
    448 for fp8 e4m3). Written once with the token (store_kv), never updated, so a page
    shared by the prefix cache never changes. Unquantized caches pass no scales.
"""

from __future__ import annotations

import math

import torch


KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # quantized KV dtypes and their largest value
KV_SCALE_DTYPE = torch.float32
KV_MIN_AMAX = 1e-8  # an all-zero head vector gets this amax (its scale stays finite and nonzero)


def quantize_kv_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in dtype, float32 scales [...]): one scale per vector.

    int8 rounds half away from zero (what the Triton store does: y +- 0.5, truncated);
    fp8 rounds to nearest even (torch's and the GPU's cast).
    """
    qmax = KV_QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(KV_MIN_AMAX) / qmax
    y = (xf / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc()
    return y.to(dtype), scale


def dequantize_kv_ref(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [..., D] (int8 / fp8) and scales [...] -> float32 [..., D]."""
    return values.float() * scale[..., None]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte view for copies (index_copy_ has no float8 kernel on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping [T] (in place; slots < 0 skipped).

    Quantized caches (int8 / fp8) need k_scale / v_scale [num_pages, page_size, Hkv]: each
    token's head vectors are quantized with their own scale, written alongside.
    """
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):  # padding tokens write nothing
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype in KV_QMAX:
            if sc is None:
                raise ValueError(f"a {cache.dtype} KV cache needs its scale tensor")
            x, s = quantize_kv_ref(x, cache.dtype)
            sc.view(-1, num_kv_heads).index_copy_(0, slots, s)
        _bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, _bytes(x.to(cache.dtype)))


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor, length: int,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """Positions [0, length) through page_table [..., P]: a new tensor [..., length, Hkv, D].

    Unused table entries may hold anything: they are clamped to a real page (what they read
    is masked by the caller). torch.index_select is ~10x faster than cache[pages] on CPU.
    With scale (a quantized cache's [num_pages, page_size, Hkv]) the result is dequantized (fp32).
    """
    page_size = cache.shape[1]
    pages = page_table[..., : (length + page_size - 1) // page_size].long().clamp(0, cache.shape[0] - 1)
    idx = pages.reshape(-1)
    g = torch.index_select(cache, 0, idx).view(*pages.shape[:-1], -1, *cache.shape[2:])[..., :length, :, :]
    if scale is None:
        return g
    s = torch.index_select(scale, 0, idx).view(*pages.shape[:-1], -1, cache.shape[2])[..., :length, :]
    return dequantize_kv_ref(g, s)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               num_kv_splits: int | None = None, *, lens: list[int] | None = None,
                               group: int = 8, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, window: int = 0,
                               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence attending to all seq_lens[b] cached tokens: q [B, Hq, D] -> [B, Hq, D].

    lens (seq_lens as a host list; spares a device sync) runs the batch in groups of `group`
    sequences of similar length, each gathered padded only to its own longest: less padding,
    less memory traffic. Without it the whole batch is padded to the longest sequence.
    num_kv_splits (a Triton tuning knob) is accepted for signature parity and unused.
    k_scale / v_scale: a quantized cache's scales (see the module docstring).
    window > 0 (sliding-window attention): the query (at position seq_len - 1) sees only the last
    `window` keys; softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2);
    sinks (float32 [Hq], gpt-oss): each head's learned logit joins the softmax's denominator (see with_sinks).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    sc = (k_scale, v_scale, window, softcap, sinks)  # what every group shares
    if lens is None or len(lens) <= group:
        return _decode_padded(q, k_cache, v_cache, page_table, seq_lens, scale,
                              seq_lens.tolist() if lens is None else lens, sc)
    order = sorted(range(len(lens)), key=lens.__getitem__)
    out = torch.empty_like(q)
    for g in range(0, len(order), group):
        idx = order[g:g + group]
        ix = torch.tensor(idx, device=q.device)
        out[ix] = _decode_padded(q[ix], k_cache, v_cache, page_table[ix], seq_lens[ix], scale, [lens[i] for i in idx],
                                 sc)
    return out


def _decode_padded(q, k_cache, v_cache, page_table, seq_lens, scale, lens: list[int], opts) -> torch.Tensor:
    """paged_decode_attention_ref over K/V gathered padded to max(lens), in fp32.
    opts: (k_scale, v_scale, window, softcap, sinks)."""
    k_scale, v_scale, window, softcap, sinks = opts
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = max(lens)
    if max_len == 0:
        return torch.zeros_like(q)
    k = _gather_pages(k_cache, page_table, max_len, k_scale).float().transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_pages(v_cache, page_table, max_len, v_scale).float().transpose(1, 2)
    if batch > 1:  # the matmuls would copy these strided views anyway, and more slowly
        k, v = k.contiguous(), v.contiguous()
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = soft_cap(torch.matmul(qg, k.mT) * scale, softcap)  # [B, Hkv, G, L]
    if window > 0:  # sliding window: keys at positions <= seq_len - 1 - window are out of sight
        pos = torch.arange(max_len, device=q.device)[None, :]
        out_of_window = pos < (seq_lens[:, None].to(q.device) - window)  # [B, L]
        scores.masked_fill_(out_of_window[:, None, None, :], float("-inf"))
    if min(lens) < max_len:  # padding: mask its scores, zero its values (a slot past a sequence's
        for b, n in enumerate(lens):  # end may hold anything, NaN in a fresh pool, and 0 * NaN is NaN)
            if n < max_len:
                v[b, :, n:] = 0.0
        past_end = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None].to(q.device)  # [B, L]
        scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_kv_heads, -1)[None, :, :, None])
    if min(lens) == 0:
        probs.nan_to_num_(0.0)  # a row with no key (seq_len 0) gives zeros
    return torch.matmul(probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; with sinks (broadcastable to scores[..., :1]: one logit per head,
    gpt-oss's attention sinks) the sink joins the denominator and is dropped from the result:
    p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink)). Rows then sum to less than 1; a row with every
    key masked gives zeros (the sink takes all the weight), not NaN."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): cap * tanh(scores / cap); cap <= 0 leaves scores as they are."""
    return scores if not cap or cap <= 0 else torch.tanh(scores / cap) * cap


def window_mask(q_pos: torch.Tensor, kv_len: int, window: int = 0) -> torch.Tensor:
    """[M, kv_len] bool, True where query position q_pos[m] sees key position j: j <= q_pos[m]
    and, with a sliding window W > 0, j > q_pos[m] - W (the last W positions, itself included;
    transformers' sliding_window_overlay for Mistral, Gemma 2 and Gemma 3)."""
    j = torch.arange(kv_len, device=q_pos.device)[None, :]
    mask = j <= q_pos[:, None]
    if window > 0:
        mask &= j > q_pos[:, None] - window
    return mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None, softcap: float = 0.0, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, Hq, D] over k/v [L, Hkv, D] (GQA) -> [M, Hq, D] in q's dtype, computed in fp32.

    Without mask, plain causal attention (M == L; with window > 0 a sliding-window causal mask);
    else mask [M, L] (True: attend). softcap > 0: scores are soft-capped before the softmax; sinks
    (float32 [Hq]): per-head sink logits in the softmax's denominator (softmax_with_sinks).
    """
    if mask is None and window > 0:
        mask = window_mask(torch.arange(q.shape[0], device=q.device), k.shape[0], window)
    if (softcap and softcap > 0) or sinks is not None:  # SDPA can neither cap nor sink: the plain computation
        qf, kf, vf = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
        rep = qf.shape[0] // kf.shape[0]
        kf, vf = kf.repeat_interleave(rep, 0), vf.repeat_interleave(rep, 0)
        scores = soft_cap(torch.matmul(qf, kf.mT) * scale, softcap)  # [Hq, M, L]
        if mask is None:
            mask = window_mask(torch.arange(q.shape[0], device=q.device), k.shape[0])
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
        return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_q_len: int | None = None, *, lens: list[int] | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix + themselves: q [T, Hq, D] -> [T, Hq, D].

    The new tokens' K/V are already in the cache. Query i of sequence b (rows
    cu_seqlens_q[b]..cu_seqlens_q[b+1]) sits at position seq_lens[b] - q_len_b + i and sees
    cache positions <= its own. lens (seq_lens as a host list) spares a device sync.
    max_q_len is accepted for signature parity and unused. k_scale / v_scale: a quantized
    cache's scales (see the module docstring). window > 0: sliding window (a query at position p
    sees keys at positions p - window < j <= p); softcap > 0: soft-capped scores (see soft_cap);
    sinks (float32 [Hq]): gpt-oss's per-head sink logits (softmax_with_sinks).
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist() if lens is None else lens
    for b, kv_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = _gather_pages(k_cache, page_table[b], kv_len, k_scale)  # [L, Hkv, D]
        v = _gather_pages(v_cache, page_table[b], kv_len, v_scale)
        mask = None  # a whole sequence (no cached prefix): SDPA's own causal mask
        if e - s != kv_len or window > 0:
            mask = window_mask(torch.arange(kv_len - (e - s), kv_len, device=q.device), kv_len, window)
        out[s:e] = causal_attention(q[s:e], k, v, scale, mask, softcap, sinks=sinks)
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


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim (x [..., D], weight [D]): Qwen3's per-head q/k norm.
    Computed in fp32, rounded to x's dtype once."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (fp64 on CPU), with optional HF-style rope scaling.

    Supported scaling types: None / "default", "linear", "llama3" (Llama 3.1+) and
    "freq_factors" ({"factors": [rotary_dim // 2 divisors]}: llama.cpp's form of llama3
    scaling, a GGUF file's rope_freqs tensor).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64).reshape(-1)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors: {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
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
    if kind == "yarn":
        return yarn_inv_freq(rotary_dim, base, scaling)[0]
    if kind == "longrope":
        raise ValueError("longrope frequencies depend on the cache length: build the table with rope_cos_sin_cache "
                         "(or longrope_inv_freq)")
    raise ValueError(f"unsupported rope scaling type {kind!r}: localrun supports default, linear, llama3, "
                     "yarn, longrope and freq_factors")


def yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek, Qwen's long-context configs): (inverse frequencies [rotary_dim // 2],
    attention factor), as transformers' _compute_yarn_parameters: frequencies below the correction
    range [low, high] (from beta_fast / beta_slow rotations over original_max_position_embeddings;
    rounded out to whole dims unless truncate is False) are interpolated (divided by factor), those
    above kept, a linear ramp between; the attention factor (default 0.1 ln(factor) + 1, or the
    mscale / mscale_all_dim ratio) multiplies cos and sin."""
    if scaling.get("factor") is None or not scaling.get("original_max_position_embeddings"):
        raise ValueError("yarn rope scaling needs factor and original_max_position_embeddings")
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def longrope_inv_freq(rotary_dim: int, base: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: (inverse frequencies [rotary_dim // 2], attention factor) for a cache of
    max_pos positions.

    scaling: {"short_factor": [...], "long_factor": [...], "original_max_position_embeddings": n,
    "factor": s, optional "attention_factor"} (ModelConfig.from_hf_config completes it). The long
    factors serve the whole table when max_pos > n, else the short ones: one choice per engine
    (as vLLM and llama.cpp choose by context size), where transformers switches per forward
    pass on the sequence length; both agree for every sequence whose length is on the same
    side of n as max_pos. The attention factor (default sqrt(1 + ln(s) / ln(n)), 1 when s <= 1)
    multiplies cos and sin, so q.k scales by its square, as in transformers.
    """
    orig = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor"] if max_pos > orig else scaling["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float64).reshape(-1)
    if ext.numel() != rotary_dim // 2:
        raise ValueError(f"longrope: {ext.numel()} factors for {rotary_dim // 2} frequencies (rotary_dim {rotary_dim})")
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = float(scaling.get("factor") or 1.0)
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq, float(attention)


def rope_cos_sin_cache(head_dim: int, max_pos: int, base: float, scaling: dict | None = None,
                       device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                       rotary_dim: int | None = None) -> torch.Tensor:
    """The [max_pos, rotary_dim] table apply_rope reads: cos in the first half, sin in the second.

    rotary_dim defaults to head_dim (partial rotary: only the first rotary_dim dims rotate).
    A "longrope" scaling picks its factors by max_pos and scales the table (longrope_inv_freq); a
    "yarn" one scales it by its attention factor (yarn_inv_freq).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    if kind == "longrope":
        inv_freq, mscale = longrope_inv_freq(rotary_dim, base, scaling, max_pos)
    elif kind == "yarn":
        inv_freq, mscale = yarn_inv_freq(rotary_dim, base, scaling)
    else:
        inv_freq, mscale = rope_inv_freq(rotary_dim, base, scaling), 1.0
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale).to(device=device, dtype=dtype)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half: 2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:  # partial rotary: the rest passes through
        parts.append(xf[..., 2 * half:])
    return torch.cat(parts, dim=-1).to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX (half-split) rotary embedding of q [T, Hq, D] and k [T, Hkv, D] at positions [T].

    Returns new tensors; the inputs are not modified.
    """
    cs = cos_sin_cache[positions.long()].float()  # [T, rot]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:] ([T, I]), computed in fp32 (GeGLU: Gemma's MLP,
    transformers' "gelu_pytorch_tanh")."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N]: the linear layer, as torch (cuBLAS on a GPU) does it."""
    return torch.nn.functional.linear(x, w, bias)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] ([T, I]), computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def sample_temperature_ref(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [n, V], temperature [n] (0: greedy row) -> token ids int64 [n], drawn from
    softmax(logits / T) by the exponential race (argmax p_i / E_i, E_i ~ Exp(1)) with a torch
    generator seeded by `seed`. The same distribution as the Triton kernel (sampling.py), not the
    same draws: its random stream is Philox's."""
    x = logits.float()
    g = torch.Generator(device=x.device).manual_seed(int(seed))
    noise = torch.empty_like(x).exponential_(generator=g)
    t = temperature.float()[:, None]
    drawn = (x / torch.where(t > 0, t, 1.0) - noise.log()).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, x.argmax(dim=-1))
