"""One trial of `localrun bench ab`: build the native engine and measure one workload, in a fresh process.

localrun/bench/ab.py runs this file's source as `python -c SOURCE SPEC_JSON` in an empty directory, with the
side's environment. With spec["root"] set (a source tree or a git revision checked out), localrun is imported
from that tree. It imports only the standard library, torch, and localrun.engine's public API (EngineConfig,
LLMEngine, SamplingParams, generate, add_request, start, shutdown, clear_prefix_cache), so the tree under test
may be an older revision that has no `bench ab`. Its last line on stdout is "AB-TRIAL " and a JSON object:
the measured value (the median of the trial's samples), its unit, which way is better, and the samples.

Measures (random prompts of --prompt-len tokens, temperature 1.0, ignore_eos; a fresh prompt for every
request, so no prefix-cache hit):
- itl: inter-token latency of one streamed request at a time (--output-len tokens), ms, each gap a sample;
- ttft: time to the first streamed token, one request at a time, ms;
- decode: a decode step of --batch sequences, ms: (generate of --output-len tokens - generate of 1) / (len - 1);
- throughput: one generate() of --batch prompts (or the first --batch of a prompt file), total tok/s.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time

MARK = "AB-TRIAL "
UNITS = {"itl": ("ms", "lower"), "ttft": ("ms", "lower"), "decode": ("ms", "lower"), "throughput": ("tok/s", "higher")}
# per device: prompt tokens, output tokens, batch, requests / passes of the measure in one trial
DEFAULTS = {"cuda": {"prompt_len": 512, "output_len": 256, "batch": 64, "repeats": {"itl": 2, "ttft": 10,
                                                                                      "decode": 2, "throughput": 1}},
            "cpu": {"prompt_len": 32, "output_len": 16, "batch": 4, "repeats": {"itl": 2, "ttft": 5, "decode": 2,
                                                                                "throughput": 1}}}


def use_tree(root: str) -> None:
    """Import localrun from the source tree `root`; its kernels/ as localrun.kernels when the tree does not
    link it there (an installed package maps it so)."""
    import importlib.util

    sys.path.insert(0, root)
    import localrun

    if not os.path.abspath(localrun.__file__).startswith(os.path.join(os.path.abspath(root), "")):
        raise SystemExit(f"localrun was imported from {localrun.__file__}, not from {root}")
    kernels = os.path.join(root, "kernels", "__init__.py")
    if os.path.isfile(kernels) and not os.path.exists(os.path.join(root, "localrun", "kernels")):
        spec = importlib.util.spec_from_file_location("localrun.kernels", kernels,
                                                      submodule_search_locations=[os.path.dirname(kernels)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["localrun.kernels"] = mod
        spec.loader.exec_module(mod)
        localrun.kernels = mod


def build_engine(spec: dict):
    from localrun.engine import EngineConfig, LLMEngine

    if spec["device"] == "cuda":
        base = {"device": "cuda", "dtype": "bfloat16", "gpu_memory_fraction": 0.8}
    else:
        base = {"device": spec["device"], "dtype": "float32", "kv_cache_tokens": 4096, "max_model_len": 2048}
    return LLMEngine.from_random(spec["shape"], EngineConfig(**{**base, **spec["engine"]}))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class Prompts:
    """Fresh random prompts (never the same first tokens twice, so the prefix cache never hits)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lo, self.vocab = min(1000, vocab // 4), vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.vocab) for _ in range(n)]


def stream(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, list[float]]]:
    """Each prompt streamed alone in turn: (start, [arrival time of each token delta])."""
    from localrun.engine import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(p):
        t, times = time.perf_counter(), []
        async for d in engine.add_request(p, params):
            if d.token_ids:
                times.append(time.perf_counter())
        return t, times

    async def go():
        engine.start()
        try:
            return [await one(p) for p in prompts]
        finally:
            engine.shutdown()

    return asyncio.run(go())


def generate_s(engine, prompts: list[list[int]], max_tokens: int, device: str) -> float:
    from localrun.engine import SamplingParams

    engine.clear_prefix_cache()
    sync(device)
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
    sync(device)
    return time.perf_counter() - t


def file_prompts(path: str, n: int, vocab: int) -> list[tuple[list[int], int]]:
    """The first n (prompt ids, output length) of a `bench sample` prompt file (.jsonl or .jsonl.gz)."""
    import gzip

    out = []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "prompt_token_ids" in rec:
                out.append((rec["prompt_token_ids"], rec["output_len"]))
            if len(out) == n:
                break
    top = max(max(p) for p, _ in out)
    if top >= vocab:
        raise SystemExit(f"{path} holds token id {top}; the model's vocabulary has {vocab}: use a shape of its "
                         "tokenizer's vocabulary, or random prompts")
    return out


def measure(engine, spec: dict) -> list[float]:
    """The trial's samples (after one untimed warm-up of the same workload, smaller)."""
    m, dev, n = spec["measure"], spec["device"], spec["repeats"]
    P, T, B = spec["prompt_len"], spec["output_len"], spec["batch"]
    fresh = Prompts(engine.model_config.vocab_size, spec["seed"])
    if m == "itl":
        stream(engine, [fresh(P)], 4)
        runs = stream(engine, [fresh(P) for _ in range(n)], T)
        return [(b - a) * 1000 for _, times in runs for a, b in zip(times, times[1:])]
    if m == "ttft":
        stream(engine, [fresh(P)], 1)
        return [(times[0] - t) * 1000 for t, times in stream(engine, [fresh(P) for _ in range(n)], 1)]
    if m == "decode":
        if T < 2:
            raise SystemExit("--measure decode needs --output-len of 2 or more")
        generate_s(engine, [fresh(P) for _ in range(B)], 2, dev)
        out = []
        for _ in range(n):
            one = generate_s(engine, [fresh(P) for _ in range(B)], 1, dev)
            full = generate_s(engine, [fresh(P) for _ in range(B)], T, dev)
            out.append((full - one) / (T - 1) * 1000)
        return out
    from localrun.engine import SamplingParams

    if spec.get("prompts_file"):
        reqs = file_prompts(spec["prompts_file"], B, engine.model_config.vocab_size)
    else:
        reqs = [(fresh(P), T) for _ in range(B)]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=t, ignore_eos=True) for _, t in reqs]
    tokens = sum(len(p) + t for p, t in reqs)
    engine.generate([p for p, _ in reqs[:2]], params[:2])  # warm-up
    out = []
    for _ in range(n):
        engine.clear_prefix_cache()
        sync(dev)
        t0 = time.perf_counter()
        engine.generate([p for p, _ in reqs], params)
        sync(dev)
        out.append(tokens / (time.perf_counter() - t0))
    return out


def main(spec: dict) -> dict:
    if spec.get("root"):
        use_tree(spec["root"])
    import torch

    import localrun

    dev = spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    d = DEFAULTS["cuda" if dev == "cuda" else "cpu"]
    spec = {**spec, "device": dev, "shape": spec.get("shape") or ("llama-3.1-8b" if dev == "cuda" else "tiny")}
    for k in ("prompt_len", "output_len", "batch"):
        spec[k] = spec.get(k) or d[k]
    spec["repeats"] = spec.get("repeats") or d["repeats"][spec["measure"]]
    t = time.perf_counter()
    engine = build_engine(spec)
    build_s = time.perf_counter() - t
    samples = measure(engine, spec)
    unit, better = UNITS[spec["measure"]]
    return {"value": statistics.median(samples), "unit": unit, "better": better, "samples": samples,
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "build_s": build_s,
            "localrun": os.path.dirname(os.path.abspath(localrun.__file__)),
            **{k: spec[k] for k in ("measure", "shape", "prompt_len", "output_len", "batch", "repeats", "engine")}}


if __name__ == "__main__":
    print(MARK + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
