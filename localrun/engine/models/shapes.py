"""Exact shapes of well-known models, for random-weight benchmarks (`from_random`)."""

from __future__ import annotations

from localrun.engine.config import ModelConfig

_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def _every(n: int, period: int) -> list[str]:
    """Gemma's layer pattern: period - 1 sliding-window layers, then one global layer."""
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _shapes() -> dict[str, ModelConfig]:
    return {
        # a toy Llama for smoke tests (`bench gpu-check --tiny`); its vocabulary covers the bundled prompts
        "tiny": ModelConfig(64, 2, 4, 2, 128, 49152, rope_theta=10000.0, max_position_embeddings=4096),
        "smollm2-135m": ModelConfig(576, 30, 9, 3, 1536, 49152, rope_theta=100000.0, max_position_embeddings=8192,
                                    tie_word_embeddings=True),
        "smollm2-360m": ModelConfig(960, 32, 15, 5, 2560, 49152, rope_theta=100000.0, max_position_embeddings=8192,
                                    tie_word_embeddings=True),
        "llama-2-7b": ModelConfig(4096, 32, 32, 32, 11008, 32000, max_position_embeddings=4096),
        "llama-3.2-1b": ModelConfig(2048, 16, 32, 8, 8192, 128256, head_dim=64, rope_theta=500000.0,
                                    rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
                                    max_position_embeddings=131072, tie_word_embeddings=True),
        "llama-3.2-3b": ModelConfig(3072, 28, 24, 8, 8192, 128256, head_dim=128, rope_theta=500000.0,
                                    rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
                                    max_position_embeddings=131072, tie_word_embeddings=True),
        "llama-3.1-8b": ModelConfig(4096, 32, 32, 8, 14336, 128256, rope_theta=500000.0,
                                    rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}, max_position_embeddings=131072),
        "mistral-7b": ModelConfig(4096, 32, 32, 8, 14336, 32768, rope_theta=1000000.0,
                                  max_position_embeddings=32768, arch="mistral"),
        "qwen2.5-0.5b": ModelConfig(896, 24, 14, 2, 4864, 151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                    max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
                                    arch="qwen2"),
        "gemma-2-2b": ModelConfig(2304, 26, 8, 4, 9216, 256000, head_dim=256, rms_norm_eps=1e-6,
                                  max_position_embeddings=8192, tie_word_embeddings=True, arch="gemma2",
                                  sliding_window=4096, layer_types=_every(26, 2), attn_logit_softcap=50.0,
                                  final_logit_softcap=30.0, query_pre_attn_scalar=256),
        "gemma-3-1b": ModelConfig(1152, 26, 4, 1, 6912, 262144, head_dim=256, rms_norm_eps=1e-6,
                                  rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                                  arch="gemma3", sliding_window=512, layer_types=_every(26, 6),
                                  query_pre_attn_scalar=256, rope_local_theta=10000.0),
        "qwen2.5-7b": ModelConfig(3584, 28, 28, 4, 18944, 152064, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                  max_position_embeddings=32768, attention_bias=True, arch="qwen2"),
        "qwen3-0.6b": ModelConfig(1024, 28, 16, 8, 3072, 151936, head_dim=128, rms_norm_eps=1e-6,
                                  rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                                  arch="qwen3", qk_norm=True),
        # Phi-3-mini-4k (its 2047-token sliding window) and Phi-4-mini (partial rotary); the 128k models'
        # longrope factor lists are left out (they change the numbers, not the cost)
        "phi-3-mini": ModelConfig(3072, 32, 32, 32, 8192, 32064, max_position_embeddings=4096, arch="phi3",
                                  sliding_window=2047),
        "phi-4-mini": ModelConfig(3072, 32, 24, 8, 8192, 200064, head_dim=128, rotary_dim=96,
                                  max_position_embeddings=131072, tie_word_embeddings=True, arch="phi3"),
        # mixtures of experts (models/moe_llama.py): a toy one (4 experts, top 2, a dense middle layer) and
        # Qwen3-30B-A3B (128 experts, top 8) and Mixtral-8x7B (8 experts, top 2)
        "tiny-moe": ModelConfig(64, 3, 4, 2, 128, 49152, head_dim=16, arch="qwen3_moe", qk_norm=True, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
        "qwen3-30b-a3b": ModelConfig(2048, 48, 32, 4, 6144, 151936, head_dim=128, rms_norm_eps=1e-6,
                                     rope_theta=1000000.0, max_position_embeddings=40960, arch="qwen3_moe",
                                     qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        "mixtral-8x7b": ModelConfig(4096, 32, 32, 8, 14336, 32000, rope_theta=1000000.0,
                                    max_position_embeddings=32768, arch="mixtral", num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=14336),
    }


SHAPES: dict[str, ModelConfig] = _shapes()


def get_shape(name: str) -> ModelConfig:
    """A fresh copy of a named shape (so callers may edit it)."""
    try:
        return _shapes()[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None
