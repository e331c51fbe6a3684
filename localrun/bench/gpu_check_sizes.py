"""gpu-check's sizes (full, quick, tiny), targets and budgets, and the helpers its items share.

See localrun/bench/gpu_check.py for the run and docs/benchmarks.md for the method the targets come from.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

# The engine's goals (H100 80GB, Llama-3.1-8B shape, bf16), the published figures they beat
# (docs/benchmarks.md) and the machine's ceilings.
TARGETS = {"total_tok_s_min": 20000.0, "itl_ms_p50_max": 5.5, "ttft_512_ms_p50_max": 25.0,
           "prefix_speedup_min": 5.0, "cold_start_s_max": 10.0}
PUBLISHED = {"throughput": "SGLang 16,215, LMDeploy 16,132, vLLM 12,553 tok/s (8B, H100, ShareGPT 1,000)",
             "itl": "SGLang 4.99 ms median at batch 1 (H100); ~5 ms is the memory-bandwidth floor",
             "ttft_512": "SGLang 18 ms median at about one request at a time (H100)",
             "prefix": "SGLang: up to 5x on few-shot, 6.4x on structured workloads",
             "coldstart": "vLLM ~62 s, SGLang ~58 s, Ollama ~30 s"}
CEILINGS = {"total_tok_s": 50000.0, "itl_ms_floor": 5.0}
ITEMS = ("kernel_parity", "greedy_parity", "graph_capture", "throughput", "ttft_512", "itl", "prefix", "coldstart")
# items that share one child process (and one engine) while none fails or overruns
GROUPS = (("kernel_parity",), ("greedy_parity",), ("graph_capture", "throughput", "ttft_512", "itl"), ("prefix",),
          ("coldstart",))
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


# Measured on one H200 (full, 2026-11-26; results/gpu-check-nvidia-h200.txt): the run 104-151 s; kernel parity
# 19 s, greedy parity 23 s, graph capture 13 s (with the engine build), throughput 28 s, prefix 18 s, cold start
# 46 s. The budgets below were estimated before that, for an H100: a child's imports take ~3-6 s, an
# 8B engine build (random weights on the GPU, profile, KV pool, decode graph capture) ~15-30 s with a
# cold Triton cache. Full: kernel parity ~40 s (~20 cases, each compiled), greedy parity ~35 s (the 8B
# model in transformers and the engine), the engine items ~70 s (1,000 prompts, ~357k tokens: ~20 s at
# 16k tok/s, ~2 min at 3k), prefix ~35 s (three engines), cold start ~55 s (three processes, one with an
# empty Triton cache): ~4 minutes, bounded at 8. Quick: ~30 + 25 + 40 + 30 + 30 s (one cold start): about
# 2.5 minutes, bounded at 3. Each budget is an item's upper bound, not its expected time.
FULL = Sizes("full", "llama-3.1-8b", 1000, None, None, 20, 512, 256, 512, 10, 1024, 64, 32, 32, (7, 64, 300, 512),
             16, 3, "full",
             {"kernel_parity": 90, "greedy_parity": 90, "graph_capture": 60, "throughput": 180, "ttft_512": 30,
              "itl": 30, "prefix": 75, "coldstart": 120}, 480.0)
QUICK = Sizes("quick", "llama-3.1-8b", 200, None, None, 10, 512, 64, 512, 5, 1024, 16, 32, 32, (7, 512), 8, 1,
              "quick",
              {"kernel_parity": 45, "greedy_parity": 45, "graph_capture": 45, "throughput": 45, "ttft_512": 10,
               "itl": 10, "prefix": 45, "coldstart": 45}, 180.0)
TINY = Sizes("tiny", "tiny", 8, 48, 6, 2, 32, 12, 32, 3, 64, 4, 8, 4, (5, 17, 40), 6, 2, "tiny",
             {"kernel_parity": 40, "greedy_parity": 60, "graph_capture": 30, "throughput": 30, "ttft_512": 20,
              "itl": 20, "prefix": 40, "coldstart": 90}, 300.0)
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
