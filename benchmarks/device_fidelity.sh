#!/usr/bin/env bash
# Simulator fidelity on one GPU, one model per call: profile it, then replay the fidelity cases on the same
# loaded model. Everything lands under $OUT (the profile, a tarball of the run directories, the log).
#   [LIMIT=N] [REPS=N] [ROUNDS=N] [QUICK=1] bash benchmarks/device_fidelity.sh MODEL [CASES|all|none] [BUDGET_S] [PROFILE|noprofile]
# QUICK=1 (or QUICK=PROFILE.json) also rescales the shipped profile of MODEL (or that one) to this machine first (`testbed profile --quick`), for the
# cross-machine table (fidelity.py cross: shipped, quick-rescaled and calibrated profiles on the same runs).
# The simulator side runs anywhere afterwards: python benchmarks/fidelity.py sim RUNS --profile PROFILE
set -o pipefail
model=${1:?model preset, e.g. Llama-3.2-1B}
cases=${2:-all}
budget=${3:-500}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/device-out}
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1] if 'H100' not in torch.cuda.get_device_name() else 'H100-SXM')")
profile=${4:-$OUT/${model}_${gpu}_tp1.json}
args=(--model "$model" --out "/tmp/runs_${model}_${gpu}" --tar "$OUT/runs_${model}_${gpu}.tar.gz" --budget-s "$budget"
      --no-progress)
[ "$profile" != noprofile ] && args+=(--profile-out "$profile")
[ "$cases" != all ] && args+=(--cases "$cases")
[ -n "$LIMIT" ] && args+=(--limit "$LIMIT")
[ -n "$REPS" ] && args+=(--reps "$REPS")
[ -n "$ROUNDS" ] && args+=(--rounds "$ROUNDS")  # the loaded cases again, round after round (the real runs' spread)
quick_base=$QUICK; [ "$QUICK" = 1 ] && quick_base=testbed/profiling/profiles/${model}_${gpu}_tp1.json
[ -n "$QUICK" ] && args+=(--quick-base "$quick_base" --quick-out "$OUT/quick_${model}_${gpu}_tp1.json")
python3 benchmarks/fidelity.py real "${args[@]}" 2>&1 | tee "$OUT/log_${model}_${gpu}.txt"
