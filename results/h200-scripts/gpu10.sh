#!/bin/bash
# Session 47, device run 2: gpu-check (full) with the GEMV as a programmatic dependent launch and the gemv parity
# cases, then the TTFT A/B (ttft_ab.py): bd02ade's code (.old/, session 37's 14.6 ms) against this tree, alternated.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
for r in . .old; do [ -e $r/localrun/kernels ] || ln -s ../kernels $r/localrun/kernels; done
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader; lscpu | grep -E "Model name"
timeout -s TERM 200 python3 -m localrun.bench gpu-check --out $OUT > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "│|items not" $OUT/gpu-check.log | grep -v "│ *│ *│" | head -16
for arm in .old . .old .; do timeout 75 python3 results/h200-scripts/ttft_ab.py $arm 2>&1 | grep -v -i "warn"; done | tee $OUT/ttft-ab.jsonl
echo "done after $(( $(date +%s) - T0 )) s"
