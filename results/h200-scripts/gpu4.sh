#!/bin/bash
# session 35 device run 1: gpu-check (full) first, then the same-machine decode attention A/B
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
timeout -s TERM 300 python3 -m localrun.bench gpu-check --out $OUT --logs $OUT/logs > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"
(cd $OUT && tar czf child-logs.tgz logs && rm -rf logs)
python3 - <<'PY'
import json,os
r=json.load(open(os.environ["OUT"]+"/gpu-check-nvidia-h200.json"))
for k,v in r["items"].items():
    print(k, v.get("status"), v.get("value"), (v.get("error") or v.get("reason") or "")[:300])
c=r["items"].get("coldstart",{})
for run in c.get("runs",[]): print(" cold", {k:(round(x,2) if isinstance(x,float) else x) for k,x in run.items()})
p=r["items"].get("prefix",{})
for k in ("cache_on","cache_off"):
    if k in p: print(" prefix",k,{x:round(p[k][x],3) for x in ("elapsed_s","total_tok_s","ttft_ms_p50","hit_rate")})
print(" ttft", [round(x,1) for x in r["items"].get("ttft_512",{}).get("ttft_ms_all",[])])
print(" tp timings", r["items"].get("throughput",{}).get("engine_timings"))
PY
timeout 150 python3 .dev/decode_ab.py 2>&1 | grep -v Warn | tail -12
echo "decode A/B done after $(( $(date +%s) - T0 )) s"
