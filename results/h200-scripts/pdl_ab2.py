"""Session 47, device run 4: batch-1 ITL of the 8B shape, three one-row GEMVs alternated on one engine (graphs
recaptured at each switch): 3d = kernels/matvec.py's M-row kernel, plain launch (what ran before this session);
row = the one-row kernel (a [BLOCK_N, BLOCK_K] accumulator, x a vector), plain; row+pdl = it as a programmatic
dependent launch. It ran against an intermediate kernels/matvec.py (a ROW_KERNEL switch, _pdl(device)); the
one-row kernel was kept, without PDL."""
import gc, json, os, torch
from localrun.engine import LLMEngine
from localrun.kernels import matvec
from localrun.bench.gpu_check import FULL, _engine_config, itl
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
orig, rows = matvec._pdl, []
xs, ws, bs = (torch.randn(*sh, device="cuda", dtype=torch.bfloat16) for sh in ((1, 4096), (6144, 4096), (6144,)))
ref = torch.nn.functional.linear(xs.float() * 2, ws.float(), bs.float())
print("row+pdl max rel err", ((matvec.gemv(xs * 2, ws, bs).float() - ref).abs().max() / ref.abs().max()).item(), flush=True)
for v in ["3d", "row", "row+pdl"] * 3:
    matvec._pdl = orig if v == "row+pdl" else (lambda i: False)
    matvec.ROW_KERNEL = v != "3d"
    eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache(); eng.runner.setup_graphs(True)
    d = itl(eng, FULL)
    rows.append({"gemv": v, "itl_p50": round(d["itl_ms_p50"], 3), "itl_mean": round(d["itl_ms_mean"], 3)})
    print(json.dumps(rows[-1]), flush=True)
json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, open(f"{os.environ.get('OUT', '/tmp')}/pdl-ab2.json", "w"), indent=1)
