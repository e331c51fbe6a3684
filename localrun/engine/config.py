"""Model shape (ModelConfig) and engine knobs (EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelConfig:
    """A Llama-family decoder: Llama 2/3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm), Mistral,
    SmolLM2, Phi-3 / Phi-4 (longrope, partial rotary, sliding window); Gemma 2 / 3 (arch "gemma2" /
    "gemma3": models/gemma.py); and the mixtures of experts Qwen3-MoE and Mixtral (models/moe.py)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    arch: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # sliding-window attention (Mistral, Qwen2 with use_sliding_window, Gemma 2/3): a query at position p
    # sees keys p - sliding_window < j <= p on the layers layer_types marks "sliding_attention"
    # (layer_types None: every layer, when sliding_window is set); 0 / None: global attention
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" | "full_attention"
    attn_logit_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0: off
    final_logit_softcap: float = 0.0  # Gemma 2: logits -> cap * tanh(logits / cap); 0: off
    query_pre_attn_scalar: float = 0.0  # Gemma: attention scale query_pre_attn_scalar ** -0.5 (0: head_dim)
    rope_local_theta: float = 0.0  # Gemma 3: the RoPE base of sliding layers (no scaling there); 0: rope_theta
    qk_norm: bool = False  # per-head RMSNorm (weight [head_dim]) on q and k before RoPE (Qwen3)
    rotary_dim: int = 0  # dims of each head RoPE rotates (0: head_dim; Phi-4-mini: 3/4 of it, the rest pass)
    # mixture of experts (Qwen3-MoE, Mixtral, gpt-oss; routing and experts: kernels/moe_reference.py).
    # num_experts 0: every layer has a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token runs (top-k)
    moe_intermediate_size: int = 0  # one expert's intermediate size (0: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum 1 (Qwen3-MoE's flag; Mixtral: True)
    moe_scoring: str = "softmax_topk"  # "softmax_topk" | "topk_softmax" (gpt-oss)
    moe_activation: str = "silu"  # "silu" | "swiglu_oai" (gpt-oss's clamped SwiGLU)
    mlp_only_layers: list[int] = field(default_factory=list)  # Qwen3-MoE: layers that keep a dense MLP
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is MoE when (i + 1) % step == 0
    attention_sinks: bool = False  # gpt-oss: a learned per-head sink logit in each softmax

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 0):
            raise ValueError(f"sliding_window must be a whole number >= 0 (0 or None: global attention), "
                             f"got {self.sliding_window!r}")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if len(self.layer_types) != self.num_layers or bad:
                raise ValueError(f"layer_types must list {self.num_layers} entries, each 'sliding_attention' or "
                                 f"'full_attention'; got {len(self.layer_types)} entries"
                                 + (f" with {', '.join(map(repr, bad))}" if bad else ""))

    def layer_window(self, layer: int) -> int:
        """The sliding window of a layer (0: global attention)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return 0
        return int(self.sliding_window)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts (Qwen3-MoE's mlp_only_layers / decoder_sparse_step)."""
        if not self.is_moe or layer in self.mlp_only_layers:
            return False
        step = max(1, self.decoder_sparse_step)
        return (layer + 1) % step == 0

    @property
    def is_gemma(self) -> bool:
        return self.arch in ("gemma2", "gemma3")

    @property
    def num_params(self) -> int:
        """Every weight, all experts of a mixture-of-experts model included (what memory holds)."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """The weights one token runs through: of a mixture of experts, its top-k experts and the router."""
        return self._params(self.num_experts_per_tok)

    @property
    def expert_params(self) -> int:
        """The experts' weights alone (kept in the model dtype whatever weight_dtype: layers/moe.py)."""
        return self.num_params - self._params(0) if self.is_moe else 0

    def _params(self, experts: int) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        base = attn + 2 * h + (2 * d if self.qk_norm else 0)  # norms: 2 per layer, Qwen3's q/k norms
        if self.is_gemma:  # pre/post-feedforward norms; Gemma 3's q/k norms
            base += 2 * h + (2 * d if self.arch == "gemma3" else 0)
        moe = sum(self.layer_is_moe(n) for n in range(self.num_layers))
        expert = 3 * h * (self.moe_intermediate_size or i)
        layers = self.num_layers * base + (self.num_layers - moe) * 3 * h * i + moe * (experts * expert
                                                                                       + self.num_experts * h)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + emb + h

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers, in a KV cache of this dtype (with its scales
        when quantized: one float32 per token per KV head for K and for V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        scales = KV_SCALE_DTYPE.itemsize if dtype in QUANTIZED_KV_DTYPES else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * elem + scales)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict (old `rope_scaling` or new `rope_parameters`)."""
        from localrun.archs import is_native, unsupported_message

        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "llama")
        if model_type in GEMMA_MODEL_TYPES:
            return _gemma_from_hf(cls, cfg)
        if not is_native(model_type):
            raise ValueError(unsupported_message(model_type, "model_type" + (f" of {'/'.join(archs)}" if archs else "")))
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        eos = cfg.get("eos_token_id")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
        if scaling:
            scaling = _longrope_scaling(dict(scaling), cfg) if (scaling.get("rope_type") or scaling.get("type")) in (
                "longrope", "su") or (model_type == "phi3" and scaling.get("rope_type") == "yarn") else dict(scaling)
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            arch=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rotary_dim=int(head_dim * partial),
            **_hf_sliding_window(cfg, model_type),
            **_hf_moe(cfg, model_type),
        )


def _hf_moe(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config.json (transformers 5 writes Qwen3-MoE's
    num_experts as num_local_experts, older configs num_experts); {} for a dense model."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} with hidden_act {cfg.get('hidden_act')!r} is not supported (the native "
                         "engine's experts are SiLU-gated); use the llama.cpp backend for it")
    if model_type == "mixtral":  # intermediate_size is each expert's; every layer is sparse; top-k renormalised
        return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": int(cfg["intermediate_size"])}
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1)}


def _longrope_scaling(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A Phi-3 "longrope" rope scaling ("su" and Phi-3's "yarn" are read as longrope, as
    transformers does), completed as transformers 5 completes it: original_max_position_embeddings
    from the config's top level first (Phi-3's default 4096), and factor, when absent,
    max_position_embeddings / original_max_position_embeddings (it sets the attention factor
    sqrt(1 + ln(factor) / ln(original)); see kernels.reference.longrope_inv_freq)."""
    scaling["rope_type"] = "longrope"
    scaling.pop("type", None)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    orig = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or (
        4096 if cfg.get("model_type") == "phi3" else max_pos)
    scaling["original_max_position_embeddings"] = int(orig)
    if scaling.get("factor") is None:
        scaling["factor"] = max_pos / int(orig)
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"longrope rope scaling needs a {key} list in config.json")
    return scaling


def _hf_sliding_window(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """sliding_window / layer_types for a Llama-family config.json: Mistral's sliding_window (every
    layer), Qwen2's use_sliding_window (layers from max_window_layers on, as transformers does);
    an explicit layer_types list wins."""
    window = cfg.get("sliding_window") or None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen2/3 configs carry a sliding_window that is off unless use_sliding_window
    if model_type == "llama" or not window:
        return {}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None and model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = cfg.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"sliding_window": int(window), "layer_types": list(types) if types else None}


GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")


def _gemma_from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
    """Gemma 2 / Gemma 3 (text; the multimodal "gemma3" config's text_config) from config.json."""
    model_type = cfg["model_type"]
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: the language model's config
        text = dict(cfg.get("text_config") or {})
        if not text.get("hidden_size"):
            raise ValueError("this gemma3 config.json has no text_config with the language model's shape; "
                             "use the llama.cpp backend for it")
        text.setdefault("model_type", "gemma3_text")
        for k in ("eos_token_id", "bos_token_id"):  # the whole model's ids (what generation stops on) win
            if cfg.get(k) is not None:
                text[k] = cfg[k]
        cfg = text
        model_type = "gemma3_text"
    arch = "gemma2" if model_type == "gemma2" else "gemma3"
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{model_type} with hidden_activation {cfg.get('hidden_activation')!r} is not supported "
                         "(the native engine's Gemma MLP is GELU-tanh); use the llama.cpp backend for it")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported by the "
                         "native engine")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # what transformers derives: Gemma 2 alternates, Gemma 3 has 5 local : 1 global
        pattern = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern", 6) or 1)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    # RoPE: transformers 5 writes rope_parameters per layer type; older configs rope_theta,
    # rope_scaling (global layers) and rope_local_base_freq (sliding layers)
    rp = cfg.get("rope_parameters") or {}
    full = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
    local = rp.get("sliding_attention", {}) if isinstance(rp, dict) else {}
    theta = float(full.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{model_type}: RoPE scaling on sliding layers ({local.get('rope_type')}) is not supported")
    local_theta = 0.0
    if arch == "gemma3":
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
    eos = cfg.get("eos_token_id")
    head_dim = cfg.get("head_dim") or 256
    return cls(
        hidden_size=cfg["hidden_size"],
        num_layers=n,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        arch=arch,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
        sliding_window=cfg.get("sliding_window") or None,
        layer_types=list(types),
        attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        rope_local_theta=local_theta,
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {name!r}") from None


# KV cache dtypes: the model's (auto), another float type, or quantized with per-token-per-head
# scales (see localrun.kernels.reference). Ollama's names (f16, q8_0) are accepted too.
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
KV_SCALE_DTYPE = torch.float32
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8")
_KV_DTYPES = {**_DTYPES, "f16": torch.float16, "f32": torch.float32, "fp8": torch.float8_e4m3fn,
              "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8,
              "q8_0": torch.int8}


def parse_kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for an EngineConfig.kv_cache_dtype setting."""
    if isinstance(name, torch.dtype):
        if name in _KV_DTYPES.values():
            return name
        name = str(name)
    key = str(name).strip().lower()
    if key == "auto":
        return model_dtype
    if key in _KV_DTYPES:
        return _KV_DTYPES[key]
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8 "
                     f"and int8 store the KV cache quantized, with per-token scales), got {name!r}")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The short name of a KV cache dtype: bf16, fp16, fp32, fp8 or int8."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8",
            torch.int8: "int8"}.get(dtype, str(dtype).removeprefix("torch."))


# Defaults sized for the device: a GPU step should read the weights once for hundreds of
# sequences (a decode step of an 8B model costs ~16 GB of weight reads whatever the batch).
SPECULATIVE_MODES = ("off", "ngram", "draft")  # EngineConfig.speculative (speculative.py)

CUDA_MAX_NUM_SEQS, CUDA_MAX_BATCHED_TOKENS = 256, 8192
CPU_MAX_NUM_SEQS, CPU_MAX_BATCHED_TOKENS = 64, 2048


@dataclass
class EngineConfig:
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # default: cuda if available
    page_size: int = 16
    kv_memory_bytes: int | None = None  # KV pool budget (default on CUDA: from free memory after a profiling pass)
    kv_cache_tokens: int | None = None  # or: size the pool for this many tokens (when kv_memory_bytes is None)
    gpu_memory_fraction: float = 0.8  # CUDA: weights + activations + KV pool <= this fraction of total memory
    max_num_seqs: int | None = None  # sequences in a batch (default: 256 on CUDA, 64 on CPU)
    max_num_batched_tokens: int | None = None  # per-step token budget: decodes, then prefill chunks (8192 / 2048)
    max_model_len: int = 4096
    enable_prefix_cache: bool = True
    host_cache_bytes: int | None = None  # host-memory tier of the prefix cache (evicted pages spill there):
    #                                      None: 10% of available RAM, at most 16 GiB and 4x the KV pool; 0: off
    use_triton: bool | None = None  # None: on CUDA when localrun.kernels imports
    cuda_graphs: bool | None = None  # decode from captured CUDA graphs (None: on CUDA with Triton). True on
    #                                  CPU runs the same padded static-buffer decode eagerly (a test of that path)
    cuda_graph_max_bs: int | None = None  # largest captured decode batch (default: max_num_seqs)
    overlap: bool | None = None  # prepare step N+1 while step N runs (None: on CUDA)
    fused_sampling: bool = False  # with the Triton kernels: plain temperature draws in one kernel (kernels/
    #                               sampling.py) at every batch size. Off: at batches of up to
    #                               runner.FUSED_SAMPLING_ROWS rows only (at full batches it lost 4-10% of
    #                               throughput: results/gpu-check-nvidia-h100.txt, -h200.txt)
    kv_cache_dtype: str = "auto"  # KV pages: auto (the model's dtype), bf16 / fp16 / fp32, or fp8 / int8
    #                               (quantized with per-token-per-head scales: about half of bf16's bytes)
    weight_dtype: str = "auto"  # auto: weights in `dtype`; int8 | fp8: weight-only quantized matrices (layers/quant.py)
    tensor_parallel: int = 1  # ranks (processes; GPUs on CUDA) the weights and KV heads are split over (parallel/)
    speculative: str = "off"  # off | ngram (prompt lookup) | draft (a small draft model): speculative.py
    num_speculative_tokens: int = 4  # drafted tokens verified per sequence per step
    ngram_min: int = 1  # prompt lookup: match the last n tokens, n from ngram_max down to ngram_min
    ngram_max: int = 3
    draft_model: str | tuple | None = None  # speculative="draft": a GGUF file, a safetensors directory,
    #                                        random:SHAPE[:SEED], or a recipe tuple (LLMEngine.from_recipe)

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = self.device.startswith("cuda")
        if self.dtype is None:
            self.dtype = "bfloat16" if cuda else "float32"
        parse_kv_cache_dtype(self.kv_cache_dtype, parse_dtype(self.dtype))
        from localrun.engine.layers.quant import check_supported, parse_weight_dtype

        self.weight_dtype = parse_weight_dtype(self.weight_dtype)
        check_supported(self.weight_dtype, self.device)
        if self.max_num_seqs is None:
            self.max_num_seqs = CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = CUDA_MAX_BATCHED_TOKENS if cuda else CPU_MAX_BATCHED_TOKENS
        if self.overlap is None:
            self.overlap = cuda
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_model_len must be positive")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.host_cache_bytes is not None and (isinstance(self.host_cache_bytes, bool)
                                                  or not isinstance(self.host_cache_bytes, int)
                                                  or self.host_cache_bytes < 0):
            raise ValueError(f"host_cache_bytes must be a whole number of bytes >= 0 (0: no host tier), "
                             f"got {self.host_cache_bytes!r}")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a whole number >= 1, got {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.weight_dtype != "auto":
            raise ValueError(f"weight_dtype {self.weight_dtype} with tensor_parallel {self.tensor_parallel} is not "
                             "supported yet (quantized weights are not sharded); use one of the two")
        self._check_speculative()
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs must be positive")

    def _check_speculative(self) -> None:
        from localrun.config import MAX_SPECULATIVE_TOKENS

        mode = str(self.speculative or "off").strip().lower()
        if mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be off, ngram or draft, got {self.speculative!r}")
        self.speculative = mode
        if mode == "off":
            return
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be a whole number in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= 64, got {self.ngram_min}..{self.ngram_max}")
        if self.tensor_parallel > 1:
            raise ValueError("speculative decoding with tensor_parallel > 1 is not supported yet; turn one off")
        if mode == "draft" and not self.draft_model:
            raise ValueError("speculative='draft' needs draft_model (a GGUF file, a safetensors directory or "
                             "random:SHAPE[:SEED]); or use speculative='ngram', which needs no second model")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)  # type: ignore[arg-type]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return parse_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def is_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    def graph_batch_sizes(self) -> list[int]:
        """Padded decode batch sizes to capture: 1, 2, 4, 8, 16, 32, then every 32 up to the max."""
        top = min(self.cuda_graph_max_bs or self.max_num_seqs, self.max_num_seqs, self.max_num_batched_tokens)
        sizes = [s for s in (1, 2, 4, 8, 16) if s < top] + list(range(32, top, 32))
        return sorted(set(sizes + [top]))
