"""Device run 3 (session 35): why the one-pass sampler lowered throughput (host launch time, device wait,
kernel profile, fused on/off), then the new decode split rule vs the old on the full throughput workload."""
import json, math, os, time
import torch
OUT = os.environ.get("OUT", "/tmp")
from localrun.engine import LLMEngine
from localrun.engine.runner import StepHandle
from localrun.bench.gpu_check import FULL, workload, _engine_config
from localrun.bench.throughput import run_engine, _params
from localrun.bench.dataset import PromptSet
from localrun.kernels import decode_attention as DA
from localrun.kernels._common import num_sms
res = {}
ST = None
_orig = StepHandle.result
def _result(self):
    t = time.perf_counter(); r = _orig(self)
    if ST is not None: ST["wait"] += time.perf_counter() - t
    return r
StepHandle.result = _result
prompts = workload(FULL, None, None)
small = PromptSet(prompts.requests[:300], prompts.meta)
t0 = time.perf_counter()
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
print("build", round(time.perf_counter() - t0, 1), eng.fallbacks, flush=True)
lb = eng.launch_batch
def launch_batch(b):
    t = time.perf_counter(); h = lb(b)
    if ST is not None: ST["launch"] += time.perf_counter() - t; ST["steps"] += 1
    return h
eng.launch_batch = launch_batch
eng.generate([q.prompt_token_ids for q in small.requests[:20]], _params(small.requests[:20]))
def one(fused, ps, tag):
    global ST
    eng.runner.fused_sampling = fused
    ST = {"steps": 0, "launch": 0.0, "wait": 0.0}
    r = run_engine(eng, ps, 0, 1)
    n = max(1, ST["steps"])
    row = {"tag": tag, "fused": fused, "tok_s": round(r["total_tok_s"], 1), "elapsed": round(r["elapsed_s"], 2), "steps": ST["steps"],
           "launch_ms": round(1000 * ST["launch"] / n, 3), "wait_ms": round(1000 * ST["wait"] / n, 3)}
    print(json.dumps(row), flush=True); ST = None
    return row
res["fused_ab_300"] = [one(f, small, "300") for f in (True, False, True, False)]
# kernel profile: 30 steps of each, in the decode phase of a 300-prompt run
for fused in (True, False):
    eng.runner.fused_sampling = fused
    eng.clear_prefix_cache()
    sched = torch.profiler.schedule(wait=150, warmup=5, active=30, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], schedule=sched) as prof:
        ST = {"steps": 0, "launch": 0.0, "wait": 0.0}
        orig = eng.launch_batch
        def lb2(b, _o=orig):
            prof.step(); return _o(b)
        eng.launch_batch = lb2
        eng.generate([q.prompt_token_ids for q in small.requests], _params(small.requests))
        eng.launch_batch = orig; ST = None
    ka = prof.key_averages()
    evs = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))
    tot = sum(getattr(e, "self_device_time_total", 0) for e in ka)
    top = [(e.key[:60], round(e.self_device_time_total / 1000, 2), e.count) for e in evs[:14]]
    cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:8]
    res[f"profile_fused_{fused}"] = {"device_ms_30_steps": round(tot / 1000, 2), "top": top,
                                      "cpu_top": [(e.key[:60], round(e.self_cpu_time_total / 1000, 2), e.count) for e in cpu]}
    print("profile fused", fused, json.dumps(res[f"profile_fused_{fused}"]), flush=True)
# the split rule: new (6 per SM, rounded) vs old (2 per SM, ceil), fused off, full workload, graphs recaptured
new_rule = DA.default_num_kv_splits
def old_rule(batch, num_kv_heads, t):
    return max(1, min(DA.MAX_KV_SPLITS, math.ceil(2 * num_sms(t) / max(1, batch * num_kv_heads))))
eng.runner.fused_sampling = False
rows = []
for tag, rule in (("new", new_rule), ("old", old_rule), ("new", new_rule), ("old", old_rule)):
    if time.perf_counter() - t0 > 170: break
    DA.default_num_kv_splits = rule
    eng.runner.graphs = None; eng.runner.setup_graphs(True)
    rows.append(one(False, prompts, "splits-" + tag))
res["splits_ab_1000"] = rows
json.dump(res, open(f"{OUT}/diag6.json", "w"), indent=1)
