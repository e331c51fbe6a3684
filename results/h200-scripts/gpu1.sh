#!/bin/bash
# device run 1: gpu-check (full) first, then the kernel micro-bench if time is left
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
[ -e localrun/kernels ] || ln -s ../kernels localrun/kernels
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version --format=csv
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__,torch.cuda.get_device_name())"
nproc; free -g | head -2
timeout -s TERM 510 python3 -m localrun.bench gpu-check --out $OUT --logs $OUT/logs 2>&1 | tee $OUT/gpu-check.log
echo "gpu-check rc=${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
(cd $OUT && tar czf child-logs.tgz logs && rm -rf logs)
left=$(( ${BUDGET:-560} - ($(date +%s) - T0) ))
if [ $left -gt 45 ]; then
  timeout $((left - 5)) python3 -m localrun.kernels.bench_kernels --json $OUT/kernels.json > $OUT/kernels.log 2>&1
  echo "bench_kernels rc=$? after $(( $(date +%s) - T0 )) s"; tail -40 $OUT/kernels.log
fi
cat $OUT/gpu-check.log | tail -60
