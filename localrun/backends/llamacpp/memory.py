"""The memory a llama.cpp load takes, from the GGUF header, and the KV cache type it gets.

``estimate_memory`` counts the weights (and a LoRA adapter's), the KV cache of ``num_ctx`` cells for every
slot in the cache type of ``LOCALRUN_KV_CACHE_TYPE`` (or a Modelfile's PARAMETER kv_cache_type), and the
compute buffers; an embedding model or a reranker counts its one pooling context instead.
"""

from __future__ import annotations

from pathlib import Path

from localrun.backends.base import LoadSpec, MemoryEstimate
from localrun.backends.llamacpp.batch import prompt_logprobs_rows
from localrun.backends.llamacpp.pooled import backend_pooling, is_causal, pooled_ubatch, pooled_window
from localrun.errors import InvalidRequest


def spec_gguf_info(spec: LoadSpec):
    """The GGUF header of the spec's weights: the daemon's parsed one when it came along, else read here (None
    without the library's reader)."""
    info = spec.extra.get("gguf_info")
    if info is not None:
        return info
    try:
        from localrun.library import read_gguf_info

        return read_gguf_info(spec.weights)
    except ImportError:
        return None


# LOCALRUN_KV_CACHE_TYPE's names (config.KV_CACHE_TYPES) as llama.cpp's cache types; fp8 has no
# llama.cpp type, q8_0 is its 8-bit one
_KV_TYPE_NAMES = {"auto": "f16", "fp16": "f16", "bf16": "bf16", "fp32": "f32", "int8": "q8_0", "fp8": "q8_0",
                  "q4_0": "q4_0"}
# llama.cpp cache type -> (ggml_type, bytes per element); q8_0 and q4_0 are blocks of 32 elements
# (34 and 18 bytes), so a quantized cache needs head sizes that 32 divides
KV_TYPES = {"f16": (1, 2.0), "bf16": (30, 2.0), "f32": (0, 4.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
KV_BLOCK = 32
QUANTIZED_KV = ("q8_0", "q4_0")


def kv_cache_type(spec: LoadSpec) -> str:
    """llama.cpp's KV cache type for a load: PARAMETER kv_cache_type, else LOCALRUN_KV_CACHE_TYPE."""
    from localrun.config import parse_kv_cache_type, settings

    raw = spec.extra.get("kv_cache_type")
    try:
        name = parse_kv_cache_type(str(raw)) if raw is not None else settings().kv_cache_type
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return _KV_TYPE_NAMES[name]


def _head_sizes(info) -> tuple[int, int]:
    """(K, V) head sizes from the GGUF header: attention.key_length / value_length, else width / heads."""
    hidden = int(getattr(info, "embedding_length", 0) or 0)
    heads = int(getattr(info, "head_count", 0) or 0)
    meta = getattr(info, "metadata", None) or {}
    arch = getattr(info, "architecture", "")
    default = hidden // heads if heads else 0

    def size(key: str) -> int:
        v = meta.get(f"{arch}.attention.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default

    return size("key_length"), size("value_length")


def kv_type_for_model(kv_type: str, info) -> tuple[str, str]:
    """The cache type a load gets, and why when that is not the one asked for: a quantized cache is
    made of 32-element blocks, so a model whose head size 32 does not divide keeps f16 (llama.cpp
    would refuse the context)."""
    if kv_type not in QUANTIZED_KV:
        return kv_type, ""
    k, v = _head_sizes(info)
    odd = [x for x in (k, v) if x and x % KV_BLOCK]
    if odd:
        return "f16", (f"KV cache f16, not {kv_type}: the model's head size {odd[0]} is not a multiple of "
                       f"{KV_BLOCK}, {kv_type}'s block")
    return kv_type, ""


def estimate_memory(spec: LoadSpec) -> MemoryEstimate:
    """Weights + the KV cache (LOCALRUN_KV_CACHE_TYPE) for num_ctx x slots + compute buffers, from the GGUF header."""
    info = spec_gguf_info(spec)
    weights = int(getattr(info, "tensor_bytes", 0) or 0) or Path(spec.weights).stat().st_size
    if spec.extra.get("adapter"):  # a LoRA adapter's tensors sit beside the model's
        weights += Path(spec.extra["adapter"]).stat().st_size
    layers = int(getattr(info, "block_count", 0) or 0)
    hidden = int(getattr(info, "embedding_length", 0) or 0)
    heads = int(getattr(info, "head_count", 0) or 0)
    kv_heads = int(getattr(info, "head_count_kv", 0) or 0) or heads
    vocab = int(getattr(info, "vocab_size", 0) or 0)
    k_dim, v_dim = _head_sizes(info)
    kv_type, _ = kv_type_for_model(kv_cache_type(spec), info)
    per_element = KV_TYPES[kv_type][1]
    slots = max(1, spec.num_parallel)
    if spec.embedding:  # one pooling context of its window (pooled.py), no decoding streams
        return _pooled_estimate(info, weights, layers, hidden, kv_heads, k_dim + v_dim, pooled_window(spec, info))
    # K and V per layer per token per KV head
    kv = int(layers * spec.num_ctx * kv_heads * (k_dim + v_dim) * per_element * slots)
    if not kv:  # unknown header: assume a 4096-wide, 32-layer model
        kv = int(2 * 32 * spec.num_ctx * 4096 * per_element * slots // 4)
    # compute buffer (~ batch x hidden activations + logits) per slot, plus a fixed margin, plus the
    # output rows a scored prompt (echo + logprobs) fills in one step
    overhead = (64 * 2**20 + slots * (512 * max(hidden, 1) * 4 * 8 + vocab * 4 * 2)
                + prompt_logprobs_rows(vocab) * vocab * 4)
    return MemoryEstimate(weights_bytes=weights, kv_bytes=kv, overhead_bytes=overhead,
                          kv_type=kv_type if kv_type != "f16" else "")


def _pooled_estimate(info, weights: int, layers: int, hidden: int, kv_heads: int, kv_dims: int,
                     window: int) -> MemoryEstimate:
    """An embedding model's or a reranker's memory: weights, a KV cache of one window when the model is causal
    (an encoder keeps none: llama.cpp makes it no memory), and the compute buffer of one pass (an encoder's is the
    whole window): activations, and the attention scores of every head should flash attention be unavailable."""
    causal = is_causal(info)
    heads = int(getattr(info, "head_count", 0) or 0) or 1
    kv = layers * window * kv_heads * kv_dims * 2 if causal else 0
    ubatch = pooled_ubatch(window, backend_pooling(info), causal)
    overhead = 32 * 2**20 + ubatch * max(hidden, 1) * 4 * 8 + ubatch * window * heads * 4
    return MemoryEstimate(weights_bytes=weights, kv_bytes=int(kv), overhead_bytes=int(overhead))
