#!/bin/bash
# session 35 device run 3: fused sampler diagnosis, split rule A/B
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH=$PWD
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
lscpu | grep -E "Model name"
timeout 290 python3 .dev/diag6.py 2>&1 | grep -v "Warn\|warn(" | tail -40
echo "done after $(( $(date +%s) - T0 )) s"
