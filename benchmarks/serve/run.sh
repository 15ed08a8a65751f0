#!/usr/bin/env bash
# `testbed bench serve` against `testbed serve` on one GPU (Llama-3.2-1B shape, dummy weights), plus the offline
# LLM throughput on the same requests (API-server overhead = serve tok/s / offline tok/s). Writes under $OUT.
# On a GPU machine without a package index, the server packages can travel as wheels in .cache/serve-whl.
# ENGINE_FLAGS (e.g. --async-scheduling) go to both the offline leg and the server; AZURE_RATES="" skips the
# Azure-trace runs (default 4 8 16 req/s).
set -x
if [ -d .cache/serve-whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .cache/serve-whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import pyarrow" 2>/dev/null || { [ -d .cache/extra-whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/extra-whl/*.whl; }
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/serve-bench}
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 benchmarks/serve/offline.py 500 512 128 $ENGINE_FLAGS 2>&1 | grep -v Warn | tail -4
python3 -m testbed.cli serve --load-format dummy --model Llama-3.2-1B --max-model-len 4096 $ENGINE_FLAGS --port 8000 --log-steps /tmp/steps > $OUT/serve.log 2>&1 &
server=$!
for i in $(seq 200); do
  sleep 2; curl -s -o /dev/null -w "%{http_code}" localhost:8000/health | grep -q 200 && break
  kill -0 $server 2>/dev/null || { echo "the server exited before it answered /health:"; tail -20 $OUT/serve.log; exit 1; }
done
# the same workload twice, as the offline leg does: the first pass warms the server (kernel compilation), the second counts
python3 -m testbed.cli bench serve --url http://127.0.0.1:8000 --dataset random --num-prompts 500 --random-input-len 512 --random-output-len 128 --seed 1 -o /tmp/run0 --disable-tqdm | grep -E "Output token" | sed 's/^/warm-up: /'
python3 -m testbed.cli bench serve --url http://127.0.0.1:8000 --dataset random --num-prompts 500 --random-input-len 512 --random-output-len 128 --server-log-steps /tmp/steps -o /tmp/run1 --disable-tqdm
for r in ${AZURE_RATES-4 8 16}; do python3 -m testbed.cli bench serve --url http://127.0.0.1:8000 traces/azure_conv_10min.jsonl --request-rate $r --num-prompts 200 --server-log-steps /tmp/steps -o /tmp/az$r --disable-tqdm; done
curl -s localhost:8000/metrics | grep -E "^vllm:(num_requests|kv_cache|request_success|num_preemptions)"
kill -TERM %1; wait %1; echo "serve exit code $?"
tail -5 $OUT/serve.log
tar czf $OUT/runs.tgz -C /tmp run1 $(for r in ${AZURE_RATES-4 8 16}; do echo az$r; done)
