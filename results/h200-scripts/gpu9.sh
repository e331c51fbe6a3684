#!/bin/bash
# Session 47, device run 1: gpu-check (full) at this stop's start (661d6cd; the first GPU run since session 37), then
# the native engine's prompt scoring on CUDA (score_check.py), session 37's throughput A/B with the OLD arm first
# (tp_ab.py) and the GEMV launch-overlap variants (gemv_pdl.py), each under what is left of a 470 s bound.
set -u
T0=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader; lscpu | grep -E "Model name"
timeout -s TERM 200 python3 -m localrun.bench gpu-check --out $OUT > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "│|items not" $OUT/gpu-check.log | grep -v "│ *│ *│" | head -16
timeout 100 python3 results/h200-scripts/score_check.py 2>&1 | grep -v -i "warn"
echo "score_check after $(( $(date +%s) - T0 )) s"
TP_AB_ORDER=old,new,old,new TP_AB_LIMIT_S=$(( $(left) - 150 )) timeout $(( $(left) - 110 )) python3 results/h200-scripts/tp_ab.py 2>&1 | grep -v -i "warn\|warm-up"
echo "tp_ab after $(( $(date +%s) - T0 )) s"
GEMV_PDL_LIMIT_S=$(( $(left) - 25 )) timeout $(left) python3 results/h200-scripts/gemv_pdl.py 2>&1 | grep -v -i "warn"
echo "done after $(( $(date +%s) - T0 )) s"
