"""Device run 3 (session 37, H100): full ShareGPT throughput of this stop's code (one-row linears on the
gemv kernel, one-pass sampler at <= 8 rows) against the previous behaviour (cuBLAS, torch sampler),
alternated on one engine, graphs recaptured at each switch. Writes $OUT/tp-ab.json."""
import gc, json, os, time
import torch
OUT = os.environ.get("OUT", "/tmp")
from localrun.engine import LLMEngine, runner
from localrun.engine.layers.ops import Ops
from localrun.bench.gpu_check import FULL, _engine_config, workload
from localrun.bench.throughput import run_engine
T0 = time.time()
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
prompts = workload(FULL, None, None)
print("fallbacks", eng.fallbacks, "fused_rows", eng.runner.fused_rows, flush=True)
res = {"device": torch.cuda.get_device_name(0), "rows": []}
def arm(new):
    refs = set(eng.model.ops.refs)
    (refs.discard if new else refs.add)("gemv")
    eng.model.ops = Ops(reference=False, refs=frozenset(refs))
    eng.runner.fused_rows = runner.FUSED_SAMPLING_ROWS if new else 0
    eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache()
    eng.runner.setup_graphs(True)
ORDER = [a == "new" for a in os.environ.get("TP_AB_ORDER", "new,old,new,old").split(",")]
for i, new in enumerate(ORDER):
    if time.time() - T0 > float(os.environ.get("TP_AB_LIMIT_S", "150")):
        break
    arm(new)
    r = run_engine(eng, prompts, 20 if i < 2 else 0, 1)
    row = {"new": new, "total_tok_s": round(r["total_tok_s"], 1), "elapsed_s": round(r["elapsed_s"], 2)}
    res["rows"].append(row); print(json.dumps(row), flush=True)
    json.dump(res, open(f"{OUT}/tp-ab.json", "w"), indent=1)
