#!/bin/bash
# device run 3: gpu-check (full) on the final code, then TTFT, trials A/B, kernel bench
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
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
for n in 1 8; do timeout 60 python3 .dev/trials_ab.py $n 2>&1 | grep -v Warn | tail -2; done
echo "after trials A/B: $(( $(date +%s) - T0 )) s"
timeout 70 python3 .dev/ttft.py > $OUT/ttft.log 2>&1; echo "ttft rc=$? after $(( $(date +%s) - T0 )) s"
left=$(( 400 - ($(date +%s) - T0) ))
[ $left -gt 40 ] && timeout $left python3 -m localrun.kernels.bench_kernels --json $OUT/kernels.json > $OUT/kernels.log 2>&1; echo "kernels rc=$? after $(( $(date +%s) - T0 )) s"
grep -E "decode|ceiling" $OUT/kernels.log | head -12
grep -v "^ERROR\|^USDT\|^STAGE" $OUT/ttft.log | tail -36
