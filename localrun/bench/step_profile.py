"""`localrun bench profile`: the native engine's step timed in its phases, over a batch's prefill and decode steps.

    localrun bench profile --random-weights --shape llama-3.1-8b [--batch 64] [--prompt-len 512] [--steps 64]
                           [--overlap] [--device cuda] ...

A step (LLMEngine.step) is: schedule (the scheduler picks the batch: schedule_batch), launch (inputs prepared,
the forward and the sampling queued on the device: launch_batch), wait (the device finishing the step) and
handle (the sampled tokens handed to their requests: handle_step); "other" is the rest of the step (the
inbox, the lock). The engine is built as ProfiledEngine, a subclass that overrides those public methods to
time them around the engine's own code: nothing is patched, and the step does the same work. Steps are
counted as prefill (the batch holds prompt tokens) or decode (every row one token).

The engine runs serially (overlap off) unless --overlap: only then is a step's wait its own; with overlap
the wait for step N happens inside the handling of step N in step N+1, and is counted in handle. On a CPU
the forward runs inside launch and wait is about zero. One untimed warm-up generate (the same sizes, two
tokens) comes first; then --batch prompts of --prompt-len random tokens generate --steps tokens each
(temperature 1.0, ignore_eos) with every step timed. --kernels N: one more run of the same under
torch.profiler, and its N ops with the most device time (on a CPU, host time).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

PHASES = ("schedule", "launch", "wait", "handle", "other")


class StepTimes:
    """Seconds per phase of each step, and each step's kind, batch rows and tokens."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None

    def begin(self) -> None:
        self.current = {"kind": None, "rows": 0, "tokens": 0, **{p: 0.0 for p in PHASES}}

    def add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] += seconds

    def end(self, seconds: float) -> None:
        cur, self.current = self.current, None
        if cur is None or cur["kind"] is None and cur["handle"] == 0.0:
            return  # nothing was scheduled or handled: an idle step
        cur["other"] = max(0.0, seconds - sum(cur[p] for p in PHASES if p != "other"))
        cur["total"] = seconds
        cur["kind"] = cur["kind"] or "drain"  # (overlap: the last step only handles the one before)
        self.steps.append(cur)


def profiled_engine_class():
    """LLMEngine with its step's public parts timed into `engine.profile` (a StepTimes; None: not timed)."""
    import torch

    from localrun.engine import LLMEngine

    class ProfiledEngine(LLMEngine):
        profile: StepTimes | None = None

        def step(self) -> None:
            prof = self.profile
            if prof is None:
                return super().step()
            t = time.perf_counter()
            prof.begin()
            try:
                super().step()
            finally:
                prof.end(time.perf_counter() - t)

        def schedule_batch(self):
            t = time.perf_counter()
            batch = super().schedule_batch()
            prof = self.profile
            if prof is not None:
                prof.add("schedule", time.perf_counter() - t)
                if batch is not None and prof.current is not None:
                    prefill = sum(batch.num_tokens[batch.num_decodes:]) > 0
                    prof.current.update(kind="prefill" if prefill else "decode", rows=len(batch.seqs),
                                        tokens=batch.total_tokens)
            return batch

        def launch_batch(self, batch):
            t = time.perf_counter()
            handle = super().launch_batch(batch)
            if self.profile is not None:
                self.profile.add("launch", time.perf_counter() - t)
            return handle

        def handle_step(self, handle) -> None:
            prof = self.profile
            if prof is None:
                return super().handle_step(handle)
            if not self.overlap and self.config.is_cuda:
                t = time.perf_counter()
                torch.cuda.synchronize(self.config.device)
                prof.add("wait", time.perf_counter() - t)
            t = time.perf_counter()
            super().handle_step(handle)
            prof.add("handle", time.perf_counter() - t)

    return ProfiledEngine


def add_parser(sub, add_model, add_common, positive_int) -> None:
    p = sub.add_parser("profile", help="the native engine's step timed in phases (schedule, launch, wait, handle)")
    add_model(p)
    p.add_argument("--batch", type=positive_int, default=8, help="prompts at once (default 8)")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="tokens a prompt (default 128)")
    p.add_argument("--steps", type=positive_int, default=32, help="tokens each prompt generates (default 32)")
    p.add_argument("--overlap", action="store_true", help="overlap scheduling on (its wait is counted in handle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="then one more run under torch.profiler: its N ops with the most device time (CPU: host time)")
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--gpu-memory-fraction", type=float, default=None)
    g.add_argument("--kv-cache-tokens", type=positive_int, default=None)
    g.add_argument("--max-num-seqs", type=positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    g.add_argument("--no-cuda-graphs", action="store_true")
    add_common(p)


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step: how many, and per phase the mean, p50, p95 and total ms and its share of step time."""
    from localrun.bench.results import percentile

    out = {}
    for kind in ("prefill", "decode", "drain"):
        rows = [s for s in steps if s["kind"] == kind]
        if not rows:
            continue
        total = sum(s["total"] for s in rows)
        phases = {}
        for p in (*PHASES, "total"):
            ms = [1000 * s[p] for s in rows]
            phases[p] = {"mean_ms": statistics.fmean(ms), "p50_ms": statistics.median(ms),
                         "p95_ms": percentile(ms, 95), "total_ms": sum(ms),
                         "share": sum(s[p] for s in rows) / total if total else None}
        out[kind] = {"steps": len(rows), "rows_mean": statistics.fmean(s["rows"] for s in rows),
                     "tokens_mean": statistics.fmean(s["tokens"] for s in rows), "phases": phases}
    return out


def top_ops(engine, run, n: int) -> list[dict[str, Any]]:
    """`run()` under torch.profiler: its n ops with the most self time on the device (on a CPU: the host)."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.config.is_cuda
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:n]
    return [{"op": e.key, "calls": e.count, "self_ms": getattr(e, key, 0) / 1000,
             "where": "device" if cuda else "host"} for e in events]


def run_profile(src, batch: int, prompt_len: int, steps: int, engine_args: dict[str, Any], seed: int = 0,
                console=None, kernels: int = 0) -> dict[str, Any]:
    from localrun.bench.throughput import engine_config, load_engine, shutdown_engine
    from localrun.engine import SamplingParams

    cfg = engine_config(engine_args)
    t = time.perf_counter()
    engine = load_engine(src, cfg, profiled_engine_class())
    load_s = time.perf_counter() - t
    try:
        rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        lo = min(1000, vocab // 4)

        def prompts() -> list[list[int]]:
            return [[rng.randrange(lo, vocab) for _ in range(prompt_len)] for _ in range(batch)]

        if console is not None:
            console.print(f"profile: {src.name or src.kind}, warm-up")
        engine.generate(prompts(), SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True))
        engine.clear_prefix_cache()
        engine.profile = StepTimes()
        t = time.perf_counter()
        engine.generate(prompts(), SamplingParams(temperature=1.0, max_tokens=steps, ignore_eos=True))
        wall = time.perf_counter() - t
        recorded, engine.profile = engine.profile.steps, None
        ops = []
        if kernels > 0:  # a separate run: the profiler's own cost stays out of the phases above
            engine.clear_prefix_cache()
            params = SamplingParams(temperature=1.0, max_tokens=steps, ignore_eos=True)
            ops = top_ops(engine, lambda: engine.generate(prompts(), params), kernels)
        return {"mode": "profile", "model": src.name or src.kind, "device": str(engine.config.device),
                "batch": batch, "prompt_len": prompt_len, "steps_per_request": steps,
                "overlap": bool(engine.overlap), "load_s": load_s, "wall_s": wall, "steps": len(recorded),
                "step_ms_sum": 1000 * sum(s["total"] for s in recorded), "kinds": summarize(recorded), "top_ops": ops,
                "engine_config": {k: getattr(engine.config, k) for k in vars(engine.config)}}
    finally:
        shutdown_engine(engine)


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    return {"device": a.device, "dtype": a.dtype, "gpu_memory_fraction": a.gpu_memory_fraction,
            "kv_cache_tokens": a.kv_cache_tokens, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens, "max_model_len": a.max_model_len,
            "cuda_graphs": False if a.no_cuda_graphs else None, "overlap": bool(a.overlap)}


def print_rows(res: dict[str, Any], con) -> None:
    from localrun.bench.results import print_table

    table = []
    for kind, k in res["kinds"].items():
        for p in (*PHASES, "total"):
            v = k["phases"][p]
            share = "" if v["share"] is None else f"{v['share']:.1%}"
            table.append([f"{kind} ({k['steps']} steps, {k['rows_mean']:.1f} rows)" if p == PHASES[0] else "",
                          p, v["mean_ms"], v["p50_ms"], v["p95_ms"], v["total_ms"], share])
    print_table(f"profile: {res['model']} on {res['device']}, batch {res['batch']} x {res['prompt_len']} tokens, "
                f"{res['steps_per_request']} out each, overlap {'on' if res['overlap'] else 'off'}",
                ["steps", "phase", "mean ms", "p50 ms", "p95 ms", "total ms", "share"], table, con)
    con.print(f"{res['steps']} steps, {res['step_ms_sum']:.1f} ms in steps of {1000 * res['wall_s']:.1f} ms wall")
    if res["top_ops"]:
        print_table(f"ops with the most {res['top_ops'][0]['where']} time (one more run, under torch.profiler)",
                    ["op", "calls", "self ms"], [[o["op"][:80], o["calls"], o["self_ms"]] for o in res["top_ops"]],
                    con)
