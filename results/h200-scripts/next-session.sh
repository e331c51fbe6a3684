#!/bin/bash
# Prepared in session 35 for the next GPU session; NOT RUN yet. From the repository root on the device machine:
#   bash results/h200-scripts/next-session.sh      (about 5-6 minutes)
# 1. gpu-check (full) on the current code: the decode split rule and the kernel-trial fix together;
# 2. the one-pass sampler A/B in clean processes: `bench throughput` without / with --fused-sampling, alternated.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader; lscpu | grep -E "Model name"
timeout -s TERM 240 python3 -m localrun.bench gpu-check --out $OUT --logs $OUT/logs > $OUT/gpu-check.log 2>&1
echo "gpu-check rc=$? after $(( $(date +%s) - T0 )) s"; grep -E "│" $OUT/gpu-check.log | head -14
P=localrun/bench/data/sharegpt-smollm2-1000.jsonl.gz
for flag in "" --fused-sampling "" --fused-sampling; do
  [ $(( $(date +%s) - T0 )) -gt 480 ] && break
  timeout 120 python3 -m localrun.bench throughput --random-weights --shape llama-3.1-8b --device cuda --prompts $P \
    --json --no-save $flag > $OUT/tp$flag-$(date +%s).json 2>/dev/null
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('$flag' or 'torch sampler', round(r['engine']['total_tok_s'], 1))" \
    $(ls -t $OUT/tp*.json | head -1)
done
echo "done after $(( $(date +%s) - T0 )) s"
