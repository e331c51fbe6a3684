#!/bin/bash
# Session 37, device run 3 (H100): gpu-check (full) on the code with the one-row gemv kernel, then the ITL A/B.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout -s TERM 200 python3 -m localrun.bench gpu-check --out $OUT > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "│|items not" $OUT/gpu-check.log | grep -v "│ *│ *│" | head -30
timeout 110 python3 results/h200-scripts/itl_ab.py 2>&1 | grep -v -i warn
echo "done after $(( $(date +%s) - T0 )) s"
