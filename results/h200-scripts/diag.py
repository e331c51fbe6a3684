"""Where the throughput workload's time goes (8B random, H200): host time per step vs waiting for the device,
a kernel profile of 40 steps in the mixed phase, and max_num_seqs / step-budget variants."""
import json, os, sys, time
import torch
from localrun.engine import EngineConfig, LLMEngine
from localrun.engine.runner import StepHandle
from localrun.bench.gpu_check import FULL, TINY, workload, _engine_config
DEV = os.environ.get("DEV", "cuda")
SZ = FULL if DEV == "cuda" else TINY
SHAPE = "llama-3.1-8b" if DEV == "cuda" else "tiny"
from localrun.bench.throughput import run_engine

OUT = os.environ.get("OUT", "/tmp")
res = {}
_orig_result = StepHandle.result
ST = None

def _result(self):
    t = time.perf_counter(); r = _orig_result(self)
    if ST is not None: ST["wait"] += time.perf_counter() - t
    return r
StepHandle.result = _result

def instrument(engine, prof=None):
    global ST
    st = ST = {"steps": 0, "wait": 0.0, "sched": 0.0, "launch": 0.0, "handle": 0.0, "decodes": 0, "prefill_tok": 0,
               "mixed_steps": 0, "decode_only_steps": 0, "max_decodes": 0}
    sb, lb, hs = engine.schedule_batch, engine.launch_batch, engine.handle_step
    def schedule_batch():
        t = time.perf_counter(); b = sb(); st["sched"] += time.perf_counter() - t
        if b is not None:
            st["steps"] += 1; st["decodes"] += b.num_decodes; p = sum(b.num_tokens[b.num_decodes:])
            st["prefill_tok"] += p; st["max_decodes"] = max(st["max_decodes"], b.num_decodes)
            st["mixed_steps" if p else "decode_only_steps"] += 1
            if prof is not None: prof.step()
        return b
    def launch_batch(b):
        t = time.perf_counter(); h = lb(b); st["launch"] += time.perf_counter() - t; return h
    def handle_step(h):
        t = time.perf_counter(); hs(h); st["handle"] += time.perf_counter() - t
    engine.schedule_batch, engine.launch_batch, engine.handle_step = schedule_batch, launch_batch, handle_step
    return st

def report(name, st, r):
    n = max(st["steps"], 1)
    row = {"total_tok_s": r["total_tok_s"], "elapsed_s": r["elapsed_s"], **{k: st[k] for k in ("steps", "mixed_steps", "decode_only_steps", "max_decodes", "decodes", "prefill_tok")},
           "ms_per_step": 1000 * r["elapsed_s"] / n, "sched_ms": 1000 * st["sched"] / n, "launch_ms": 1000 * st["launch"] / n,
           "handle_minus_wait_ms": 1000 * (st["handle"] - st["wait"]) / n, "wait_ms": 1000 * st["wait"] / n}
    res[name] = row
    print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

prompts = workload(SZ, None, None if DEV == "cuda" else 40)
t = time.perf_counter()
base = LLMEngine.from_random(SHAPE, _engine_config(DEV, SZ, 0.8))
print("build", round(time.perf_counter() - t, 2), base.timings, flush=True)
model, mcfg = base.model, base.model_config

# 1. default config, instrumented (the instrumentation adds a few perf_counter calls per step)
st = instrument(base)
r = run_engine(base, prompts, 20 if DEV == 'cuda' else 2, 1)
report("default 256/8192", st, r)
ST = None

# 2. a kernel profile of 40 steps in the mixed phase (a 300-prompt run)
from localrun.bench.dataset import PromptSet
small = PromptSet(prompts.requests[:300], prompts.meta)
sched = torch.profiler.schedule(wait=60 if DEV == 'cuda' else 2, warmup=5 if DEV == 'cuda' else 1, active=40 if DEV == 'cuda' else 3, repeat=1)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], schedule=sched) as prof:
    st = instrument(base, prof)
    base.clear_prefix_cache()
    t0 = time.perf_counter()
    base.generate([q.prompt_token_ids for q in small.requests], __import__("localrun.bench.throughput", fromlist=["_params"])._params(small.requests))
    print("profiled run", round(time.perf_counter() - t0, 2), "s", st["steps"], "steps", flush=True)
ST = None
ka = prof.key_averages()
evs = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))
tot = sum(getattr(e, "self_device_time_total", 0) for e in ka)
print(f"device kernel time over the 40 profiled steps: {tot/1000:.1f} ms", flush=True)
lines = []
for e in evs[:25]:
    lines.append(f"{getattr(e,'self_device_time_total',0)/1000:9.2f} ms {e.count:6d}x  {e.key[:110]}")
print("\n".join(lines), flush=True)
try:
    prof.export_chrome_trace(f"{OUT}/trace.json")
    os.system(f"gzip -f {OUT}/trace.json")
except Exception as exc:
    print("trace export failed", exc)
res["profile_top"] = lines
res["profile_device_ms"] = tot / 1000
base.shutdown()
del base
torch.cuda.empty_cache()

# 3. variants on the same weights
for seqs, tokens in ((1024, 8192), (256, 16384)):
    eng = LLMEngine(model, mcfg, _engine_config(DEV, SZ, 0.8, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                                cuda_graph_max_bs=256), None)
    st = instrument(eng)
    r = run_engine(eng, prompts, 20 if DEV == 'cuda' else 2, 1)
    report(f"{seqs}/{tokens}", st, r)
    ST = None
    eng.shutdown(); del eng; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/diag.json", "w"), indent=1, default=str)
