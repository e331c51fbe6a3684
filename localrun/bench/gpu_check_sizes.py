"""gpu-check's sizes (full, quick, tiny), targets and budgets, and the helpers its items share.

See localrun/bench/gpu_check.py for the run and docs/benchmarks.md for the method the targets come from.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

# The engine's goals (H100 80GB, Llama-3.1-8B shape, bf16), the published figures they beat
# (docs/benchmarks.md) and the machine's ceilings.
TARGETS = {"total_tok_s_min": 20000.0, "itl_ms_p50_max": 5.5, "ttft_512_ms_p50_max": 25.0,
           "prefix_speedup_min": 5.0, "cold_start_s_max": 10.0,
           # the moe item (Qwen3-30B-A3B shape): no SGLang/vLLM figure for this model, GPU and workload was
           # found (results/moe-published-qwen3-30b-a3b.md), so these are set from what was: the ITL below vLLM's
           # batch-1 TPOT on an A100 (9.6 ms) scaled by the H100's bandwidth (~5.8 ms), 2.8x the weight-read floor;
           # the throughput provisional, half the 8B goal (2.7x fewer active FLOPs, but grouped GEMMs over 128
           # experts), until vLLM or SGLang is run on the same box
           "moe_total_tok_s_min": 10000.0, "moe_itl_ms_p50_max": 5.0}
PUBLISHED = {"throughput": "SGLang 16,215, LMDeploy 16,132, vLLM 12,553 tok/s (8B, H100, ShareGPT 1,000)",
             "itl": "SGLang 4.99 ms median at batch 1 (H100); ~5 ms is the memory-bandwidth floor",
             "ttft_512": "SGLang 18 ms median at about one request at a time (H100)",
             "prefix": "SGLang: up to 5x on few-shot, 6.4x on structured workloads",
             "coldstart": "vLLM ~62 s, SGLang ~58 s, Ollama ~30 s",
             "moe": "no SGLang/vLLM ShareGPT figure for Qwen3-30B-A3B on one H100 found; vLLM on one H100 (bf16, "
                    "random 2048 in/1024 out, 10 concurrent, untuned MoE tiles: vllm-project/vllm#23151): 2,227 "
                    "total tok/s, TPOT 13.2 ms median; vLLM at batch 1 on an A100: TPOT 9.6 ms "
                    "(tenstorrent/tt-inference-server#340); results/moe-published-qwen3-30b-a3b.md"}
CEILINGS = {"total_tok_s": 50000.0, "itl_ms_floor": 5.0,
            # Qwen3-30B-A3B: 3.0 B active weights (top-8 experts, attention, router, lm_head) in bf16 per token,
            # read at an H100 SXM's 3.35 TB/s
            "moe_itl_ms_floor": 1.8}
ITEMS = ("kernel_parity", "greedy_parity", "graph_capture", "throughput", "ttft_512", "itl", "prefix", "moe",
         "coldstart")
# items that share one child process (and one engine) while none fails or overruns
GROUPS = (("kernel_parity",), ("greedy_parity",), ("graph_capture", "throughput", "ttft_512", "itl"), ("prefix",),
          ("moe",), ("coldstart",))
ENGINE_ITEMS = ("throughput", "ttft_512", "itl")  # they use the engine graph_capture builds
KERNEL_TOL = {"bfloat16": 1e-2, "float32": 1e-5}  # max |triton - ref| / max |ref| (the fp32 reference as oracle)


@dataclass
class Sizes:
    name: str
    shape: str
    num_prompts: int
    max_prompt: int | None  # truncate prompts (tiny runs only)
    max_output: int | None
    warmup: int
    itl_prompt: int
    itl_output: int
    ttft_prompt: int
    ttft_requests: int
    system_len: int
    questions: int
    question_len: int
    prefix_output: int
    parity_prompts: tuple[int, ...]
    parity_tokens: int
    cold_runs: int
    kernel_shapes: str  # "full" | "quick" | "tiny": see kernel_cases
    budgets: dict[str, float]  # seconds per item (an upper bound)
    total_budget: float  # seconds for the whole run


# Qwen3-30B-A3B's config.json (the fields the engine reads): the moe item's model, with random bf16 weights
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# --tiny: the same family at toy widths (its vocabulary covers the bundled prompts' SmolLM2 ids)
QWEN3_MOE_TINY = {**QWEN3_30B_A3B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 49152, "max_position_embeddings": 4096}
MOE_MEMORY_FRACTION = 0.9  # at least: its bf16 weights alone are 57 GiB of an 80 GiB H100


def moe_model_config(sizes: "Sizes"):
    """The moe item's ModelConfig: Qwen3-30B-A3B, or its toy copy under --tiny."""
    from localrun.engine.config import ModelConfig

    return ModelConfig.from_hf_config(QWEN3_MOE_TINY if sizes.name == "tiny" else QWEN3_30B_A3B)


# Measured on one H200 (full, 2026-11-26; results/gpu-check-nvidia-h200.txt): the run 104-151 s; kernel parity
# 19 s, greedy parity 23 s, graph capture 13 s (with the engine build), throughput 28 s, prefix 18 s, cold start
# 46 s. The budgets below were estimated before that, for an H100: a child's imports take ~3-6 s, an
# 8B engine build (random weights on the GPU, profile, KV pool, decode graph capture) ~15-30 s with a
# cold Triton cache. Full: kernel parity ~40 s (~20 cases, each compiled), greedy parity ~35 s (the 8B
# model in transformers and the engine), the engine items ~70 s (1,000 prompts, ~357k tokens: ~20 s at
# 16k tok/s, ~2 min at 3k), prefix ~35 s (three engines), cold start ~55 s (three processes, one with an
# empty Triton cache): ~4 minutes, bounded at 8. Quick: ~30 + 25 + 40 + 30 + 30 s (one cold start): about
# 2.5 minutes, bounded at 3. Each budget is an item's upper bound, not its expected time.
# The moe item (not measured yet): its engine build (57 GiB of random weights drawn on the GPU, kernel trials,
# graph capture) ~40-60 s, then the ShareGPT pass and the ITL stream. The whole run stays bounded at 9 minutes
# (the measured 104-151 s plus the moe item's 240 s fit), so it fits one 10-minute command on a lent GPU.
FULL = Sizes("full", "llama-3.1-8b", 1000, None, None, 20, 512, 256, 512, 10, 1024, 64, 32, 32, (7, 64, 300, 512),
             16, 3, "full",
             {"kernel_parity": 120, "greedy_parity": 90, "graph_capture": 60, "throughput": 180, "ttft_512": 30,
              "itl": 30, "prefix": 75, "moe": 240, "coldstart": 120}, 540.0)
QUICK = Sizes("quick", "llama-3.1-8b", 200, None, None, 10, 512, 64, 512, 5, 1024, 16, 32, 32, (7, 512), 8, 1,
              "quick",
              {"kernel_parity": 60, "greedy_parity": 45, "graph_capture": 45, "throughput": 45, "ttft_512": 10,
               "itl": 10, "prefix": 45, "moe": 120, "coldstart": 45}, 300.0)
TINY = Sizes("tiny", "tiny", 8, 48, 6, 2, 32, 12, 32, 3, 64, 4, 8, 4, (5, 17, 40), 6, 2, "tiny",
             {"kernel_parity": 60, "greedy_parity": 60, "graph_capture": 30, "throughput": 30, "ttft_512": 20,
              "itl": 20, "prefix": 40, "moe": 60, "coldstart": 90}, 360.0)
MODES = {"full": FULL, "quick": QUICK, "tiny": TINY}


def torch_module():
    import torch

    return torch


def release() -> None:
    torch = torch_module()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def engine_config(device: str, sizes: Sizes, fraction: float, **kw):
    from localrun.engine import EngineConfig

    dtype = "bfloat16" if device == "cuda" else "float32"
    base = {"device": device, "dtype": dtype, "gpu_memory_fraction": fraction}
    if device != "cuda":  # CPU: a small pool, and the padded graph path exercised eagerly
        base.update(kv_cache_tokens=4096, cuda_graphs=True, overlap=True, max_model_len=2048)
    return EngineConfig(**{**base, **kw})


def rand_prompt(rng, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 4)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
