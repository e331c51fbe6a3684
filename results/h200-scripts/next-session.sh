#!/bin/bash
# Prepared in session 37 for the next GPU session; run in session 47 as gpu9.sh (with score_check.py added). From the repository root on the device machine:
#   bash results/h200-scripts/next-session.sh      (about 7-8 minutes; timeout_s 600)
# 1. gpu-check (full) on the current code (one-row GEMV, sampler kernel at <= 8 rows);
# 2. throughput, old behaviour against new on one engine, the OLD arm first this time (session 37 ran new first:
#    -6.3% on the first pair, -1.0% on the second; results/gpu-check-nvidia-h100.txt);
# 3. gemv_pdl.py: can the one-row GEMV hide its fixed ~3.5 us a launch (programmatic dependent launch, a prefetched
#    weight tile)? micro-benchmark and batch-1 ITL per variant.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader; lscpu | grep -E "Model name"
timeout -s TERM 200 python3 -m localrun.bench gpu-check --out $OUT > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "│|items not" $OUT/gpu-check.log | grep -v "│ *│ *│" | head -14
TP_AB_ORDER=old,new,old,new,old,new TP_AB_LIMIT_S=170 timeout 230 python3 results/h200-scripts/tp_ab.py 2>&1 | grep -v -i "warn\|warm-up"
timeout 170 python3 results/h200-scripts/gemv_pdl.py 2>&1 | grep -v -i "warn"
echo "done after $(( $(date +%s) - T0 )) s"
