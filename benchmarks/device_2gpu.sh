#!/usr/bin/env bash
# Every two-GPU number in RESULTS.md from one command on a host with 2 GPUs (2 H100s or 2 H200s):
#   bash benchmarks/device_2gpu.sh PART [PART ...]
# PARTs, each bounded in time (PART_TIMEOUT_S, default 600) and independent of the others:
#   pp           benchmarks/pp.py: PP=2 against TP=2 against DP=2 (parity, P2P fit, decode step, throughput, serving)
#   tp           benchmarks/tp.py: TP=1 against TP=2 with CUDA graphs, async scheduling, and TP=2 with the all-reduce
#                apart from the norm, two rounds alternating (TP_CASES, TP_ROUNDS to change;
#                TP_FLAGS=--breakdown adds each case's kernels of a decode step at batch 64)
#   tp-fidelity  benchmarks/fidelity.py real -tp 2: the TP=2 profile (what ships) and the Azure cases' real runs
#   dp           benchmarks/dp.py: DP=1 on one GPU against DP=2 on two (DP_LAYOUTS="1x1 2x1 4x1" adds DP=4 on a
#                4-GPU host), past DP=1's saturation, with a new profile (DP_COST_MODEL=auto: the shipped one;
#                DP_ENGINE_ARGS="--max-model-len 4096 --async-scheduling": async scheduling)
#   dp-host      `testbed profile --dp-replica-host` of the shipped Llama-3.2-1B and Llama-3.1-8B H100 profiles on
#                this host's cores (the replicas' loops against the single engine's, emulated steps, no GPU)
#   dp-policies  benchmarks/dp.py: DP=2 under every other --dp-policy at one rate (needs dp's profile)
#   mooncake     benchmarks/dp.py: DP=2 with prefix caching on the Mooncake slice, prefix_affinity vs least_loaded
#   lora         benchmarks/lora.py: the Triton LoRA kernels on the GPU (eager and in a graph), throughput with 1, 4,
#                16 adapters against the base, the base in an engine without LoRA, graph vs eager tokens with adapters
#   swap         benchmarks/swap.py --moves: the worker's KV block moves (swap out, in, copy on write) on one GPU
# Everything lands under $OUT (default /tmp/device-out): JSON, logs and run directories.
set -o pipefail
export OUT=${OUT:-/tmp/device-out} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('H100-SXM' if 'H100' in n else n.split()[-1])")
MODEL=${MODEL:-Llama-3.1-8B}
DP_MODEL=${DP_MODEL:-Llama-3.2-1B}
bound() { local t=${PART_TIMEOUT_S:-600}; timeout -k 10 "$t" "$@"; local rc=$?; [ $rc = 124 ] && echo "[device_2gpu] timed out after $t s: $*"; return $rc; }
for part in "$@"; do
  t0=$(date +%s)
  echo "[device_2gpu] $part: start"
  case $part in
    pp) bound python3 benchmarks/pp.py --model $MODEL --num-requests ${PP_REQUESTS:-128} --rate ${PP_RATE:-6} \
          --limit ${PP_LIMIT:-150} ${PP_FLAGS} --out $OUT/pp 2>&1 | grep -v Warning | tee $OUT/pp.log ;;
    tp) bound python3 benchmarks/tp.py --model $MODEL --cases ${TP_CASES:-1ga,2ga,2gau} --rounds ${TP_ROUNDS:-2} --skip-allreduce ${TP_FLAGS} \
          --out $OUT/tp.json 2>&1 | tee $OUT/tp.log | grep -E '^\{"case|decode|throughput|agreement' ;;
    tp-fidelity) bound python3 benchmarks/fidelity.py real --model $MODEL -tp 2 --out /tmp/fid_tp2 \
          --tar $OUT/runs_${MODEL}_${gpu}_tp2.tar.gz --profile-out $OUT/${MODEL}_${gpu}_tp2.json --no-progress \
          --cases ${FID_CASES:-azure-burst,azure-80} --limit ${FID_LIMIT:-1000} --reps ${FID_REPS:-5} --budget-s ${FID_BUDGET_S:-400} 2>&1 | tee $OUT/tp_fidelity.log ;;
    dp) bound python3 benchmarks/dp.py --layouts ${DP_LAYOUTS:-1x1 2x1} --model $DP_MODEL --rates ${DP_RATES:-40 80 160 400} \
          --num-prompts ${DP_PROMPTS:-1500} --cost-model ${DP_COST_MODEL:-profile} --budget-s ${DP_BUDGET_S:-420} \
          --engine-args "${DP_ENGINE_ARGS:---max-model-len 4096}" --out $OUT/dp 2>&1 | tee $OUT/dp.log | tail -40 ;;
    dp-host) for m in Llama-3.2-1B Llama-3.1-8B; do
          bound python3 -m testbed.cli profile --dp-replica-host --cost-model testbed/profiling/profiles/${m}_H100-SXM_tp1.json \
            --max-model-len 4096 -o $OUT/${m}_dp_replica_host.json 2>&1 | tee -a $OUT/dp_host.log | tail -2; done ;;
    dp-policies) for pol in round_robin kv_aware; do
          bound python3 benchmarks/dp.py --layouts 2x1 --model $DP_MODEL --policy $pol --rates ${DP_POLICY_RATE:-160} \
            --num-prompts ${DP_PROMPTS:-1500} --cost-model $OUT/dp/profile.json --out $OUT/dp-$pol 2>&1 \
            | tee $OUT/dp-$pol.log | tail -12; done ;;
    mooncake) for pol in prefix_affinity least_loaded; do
          bound python3 benchmarks/dp.py --layouts 2x1 --model $DP_MODEL --policy $pol --trace traces/mooncake_synthetic_tail500.jsonl \
            --rates ${MOONCAKE_RATE:-4} --num-prompts ${MOONCAKE_PROMPTS:-150} --warmup 4 \
            --engine-args "--max-model-len 32768 --enable-prefix-caching" --out $OUT/mooncake-$pol 2>&1 \
            | tee $OUT/mooncake-$pol.log | tail -12; done ;;
    lora) bound python3 benchmarks/lora.py kernels --out $OUT/lora_kernels.json 2>&1 | tee $OUT/lora_kernels.log | tail -15
          bound python3 benchmarks/lora.py throughput --model $MODEL --out $OUT/lora_throughput.json 2>&1 \
            | tee $OUT/lora_throughput.log | tail -8
          bound python3 benchmarks/lora.py throughput --model $MODEL --lora-off --out $OUT/lora_throughput_off.json 2>&1 \
            | tee $OUT/lora_throughput_off.log | tail -3
          bound python3 benchmarks/lora.py agree --out $OUT/lora_agree.json 2>&1 | tee $OUT/lora_agree.log | tail -1 ;;
    swap) bound python3 benchmarks/swap.py --moves $MODEL 2>&1 | tee $OUT/swap_moves.log | tail -8 ;;
    *) echo "[device_2gpu] unknown part $part"; exit 2 ;;
  esac
  # run directories sit too deep to come back from the machine one by one: one tarball a part
  for d in $OUT/*/; do d=${d%/}; [ -d $d/runs ] && tar czf $d.runs.tgz -C $d runs; done
  echo "[device_2gpu] $part: done in $(( $(date +%s) - t0 )) s"
done
