"""Session 47, device run 3: batch-1 ITL of the 8B shape with the production GEMV (kernels/matvec.py) launched as a
programmatic dependent launch or plainly, alternated on one engine, graphs recaptured at each switch. It ran against an
intermediate kernels/matvec.py (a PDL constexpr and _pdl(device)) that was not kept."""
import gc, json, os, torch
from localrun.engine import LLMEngine
from localrun.kernels import matvec
from localrun.bench.gpu_check import FULL, _engine_config, itl
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
orig, rows = matvec._pdl, []
for v in ["off", "on"] * 4:
    matvec._pdl = orig if v == "on" else (lambda i: False)
    eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache(); eng.runner.setup_graphs(True)
    d = itl(eng, FULL)
    rows.append({"pdl": v, "itl_p50": round(d["itl_ms_p50"], 3), "itl_mean": round(d["itl_ms_mean"], 3)})
    print(json.dumps(rows[-1]), flush=True)
json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, open(f"{os.environ.get('OUT', '/tmp')}/pdl-ab.json", "w"), indent=1)
