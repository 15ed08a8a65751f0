#!/usr/bin/env bash
# Every GPU number in RESULTS.md from one command on a GPU machine (one H200 or H100):
#   bash benchmarks/device_all.sh [kernels] [e2e] [e2e-quick] [serve]      (default: all three, full)
# Writes JSON and logs under $OUT (default /tmp/device-out). The server packages can travel as wheels in
# .cache/serve-whl (see benchmarks/serve/run.sh).
set -o pipefail
export OUT=${OUT:-/tmp/device-out} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
mkdir -p $OUT
parts=${*:-kernels e2e serve}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
for part in $parts; do
  case $part in
    kernels) python3 benchmarks/kernels.py --sweep ${SWEEP:-none} --out $OUT/kernels.json 2>&1 | grep -v "sweep skip" | tee $OUT/kernels.log | tail -30 ;;
    e2e) python3 benchmarks/e2e.py --out $OUT/e2e.json 2>&1 | grep -E "^(ours|mbu|hf_|\{\"prompts)" ;;
    e2e-quick) python3 benchmarks/e2e.py --skip-hf --out $OUT/e2e.json 2>&1 | grep -E "^(ours|mbu|\{\"prompts)" ;;
    serve) ENGINE_FLAGS=${ENGINE_FLAGS---async-scheduling} bash benchmarks/serve/run.sh 2>&1 | grep -v "^+" | tee $OUT/serve_bench.log | grep -E "OFFLINE|throughput|TTFT|TPOT|exit" ;;
  esac
done
