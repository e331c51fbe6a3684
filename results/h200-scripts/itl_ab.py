"""Device run 2 (session 37, H100): batch-1 ITL on the committed code, the one-row linears on the gemv
kernel (default) against cuBLAS (Ops refs 'gemv'), and the one-pass sampler at one row on / off;
alternated on one engine, graphs recaptured at each switch. Writes $OUT/itl-ab.json."""
import gc, json, os, time
import torch
OUT = os.environ.get("OUT", "/tmp")
from localrun.engine import LLMEngine
from localrun.engine.layers.ops import Ops
from localrun.bench.gpu_check import FULL, _engine_config, itl, ttft
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
print("fallbacks", eng.fallbacks, flush=True)
res = {"device": torch.cuda.get_device_name(0), "rows": []}
def gemv(on):
    refs = set(eng.model.ops.refs)
    (refs.discard if on else refs.add)("gemv")
    eng.model.ops = Ops(reference=False, refs=frozenset(refs))
    eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache()
    eng.runner.setup_graphs(True)
for g, fused in ((True, False), (False, False), (True, True), (True, False), (False, False), (True, True)):
    gemv(g)
    eng.runner.fused_sampling = fused
    d = itl(eng, FULL)
    t = ttft(eng, FULL)
    row = {"gemv": g, "fused_sampling": fused, "itl_p50": round(d["itl_ms_p50"], 3), "itl_mean": round(d["itl_ms_mean"], 3),
           "itl_p95": round(d["itl_ms_p95"], 3), "ttft_512_p50": round(t["ttft_ms_p50"], 2)}
    res["rows"].append(row); print(json.dumps(row), flush=True)
    json.dump(res, open(f"{OUT}/itl-ab.json", "w"), indent=1)
