"""Offline LLM throughput on the same random requests `testbed bench serve --dataset random` sends.

  python benchmarks/serve/offline.py NUM_PROMPTS INPUT_LEN OUTPUT_LEN [--async-scheduling] [--enforce-eager]
(the API-overhead ratio's denominator; pass the same engine flags as the server under test)
"""
import math
import sys
import time

from testbed.entrypoints.llm import LLM
from testbed.engine.params import SamplingParams
from testbed.bench.datasets import random_dataset
n, inp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
unknown = [a for a in sys.argv[4:] if a not in ("--async-scheduling", "--enforce-eager")]
if unknown:
    sys.exit(f"offline.py: unknown engine flags {unknown}; it takes --async-scheduling and --enforce-eager")
eager = "--enforce-eager" in sys.argv
llm = LLM("Llama-3.2-1B", load_format="dummy", max_model_len=4096, async_scheduling="--async-scheduling" in sys.argv,
          enforce_eager=eager)
params = lambda reqs: [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0) for r in reqs]
# the served leg also runs the workload once (another seed) before the measured pass
for attempt, seed in (("warm-up", 1), ("measured", 0)):
    reqs = random_dataset(n, inp, out, 0.0, vocab_size=128256, max_model_len=4096, request_rate=math.inf,
                          burstiness=1.0, seed=seed)
    t = time.perf_counter()
    res = llm.generate([r.prompt for r in reqs], params(reqs))
    dt = time.perf_counter() - t
    tok = sum(len(c.token_ids) for g in res for c in g.outputs)
    print(f"OFFLINE ({attempt}) n={n} in={inp} out={out} async={llm.config.async_scheduling} "
          f"eager={eager}: {dt:.2f} s, "
          f"{tok} output tokens, {tok/dt:.1f} tok/s, {n/dt:.2f} req/s")
