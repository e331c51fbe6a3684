"""gpu-check's measurements: greedy parity against transformers, latency, prefix reuse, throughput, cold start."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from localrun.bench.gpu_check_sizes import CEILINGS, Sizes, engine_config, rand_prompt, release, torch_module

# -- 2. parity ---------------------------------------------------------------------------------
def default_parity_model() -> Path | None:
    import importlib.util

    from localrun.library.catalog import bundled_gguf

    p = bundled_gguf()
    if p is None or not p.is_file() or importlib.util.find_spec("gguf") is None:
        return None
    return p


def hf_model(source, mcfg, dtype, device: str):
    """A transformers model: from a GGUF / safetensors path, or random-init of mcfg's shape."""
    torch = torch_module()
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

    torch = torch_module()
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
        hf = hf_model(source, mcfg, dtype, device)
        name = source.name
    else:
        mcfg = get_shape(shape)
        hf = hf_model(source, mcfg, dtype, device)
        state = hf.state_dict()
        engine = LLMEngine.from_hf_state(mcfg, state.__getitem__, set(state), cfg)
        name = f"random-init {shape}"
    rng = random.Random(0)
    prompts = [rand_prompt(rng, n, mcfg.vocab_size) for n in sizes.parity_prompts]
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
    release()
    return res


# -- 4. latency --------------------------------------------------------------------------------
async def stream_request(engine, prompt: list[int], params) -> tuple[float, list[float], int]:
    t = time.perf_counter()
    stream = engine.add_request(prompt, params)
    times, n = [], 0
    async for d in stream:
        if d.token_ids:
            times.append(time.perf_counter())
            n += len(d.token_ids)
    return t, times, n


def stream_session(engine, coro_fn):
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
            t, times, _ = await stream_request(engine, rand_prompt(rng, sizes.ttft_prompt, vocab),
                                        SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
            out.append((times[0] - t) * 1000)
        return out

    engine.clear_prefix_cache()
    ms = stream_session(engine, go)
    return {"ttft_prompt_tokens": sizes.ttft_prompt, "requests": len(ms), "ttft_ms_p50": statistics.median(ms),
            "ttft_ms_all": ms}


def itl(engine, sizes: Sizes) -> dict[str, Any]:
    import random

    from localrun.engine import SamplingParams

    rng = random.Random(8)
    vocab = engine.model_config.vocab_size
    engine.clear_prefix_cache()
    t, times, n = stream_session(engine, lambda: stream_request(engine, rand_prompt(rng, sizes.itl_prompt, vocab),
                                                                SamplingParams(temperature=1.0,
                                                                               max_tokens=sizes.itl_output,
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
        engine = LLMEngine(model, mcfg, engine_config(device, sizes, fraction, enable_prefix_cache=on), None)
        warm_up(engine, mcfg.vocab_size)  # (as `bench prefix`): the first steps' one-time costs count in neither run
        prompts = build_shared(mcfg.vocab_size, sizes.system_len, sizes.questions, sizes.question_len)
        runs["cache_on" if on else "cache_off"] = run_shared(engine, prompts, sizes.prefix_output)
        engine.shutdown()
        del engine
        release()
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
    mcfg = engine.model_config  # (a mixture of experts: the weights a token runs through, its top-k experts)
    res.update(model_flops_fraction(res["total_tok_s"], getattr(mcfg, "active_params", mcfg.num_params), device_label))
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
