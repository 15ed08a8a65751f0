"""Offline LLM throughput on the same random requests `testbed bench serve --dataset random` sends.

  python benchmarks/serve/offline.py NUM_PROMPTS INPUT_LEN OUTPUT_LEN [--async-scheduling] [--enforce-eager]
                                     [--emulate GPU]
(the API-overhead ratio's denominator; pass the same engine flags as the server under test). `--emulate GPU`: no
model runs, each step takes the GPU preset's profiled time (the executor of `testbed serve --emulate --gpu GPU`), so
the ratio has a CPU-only proxy (benchmarks/serve/emulated_burst.py).
"""
import math
import sys
import time

from testbed.entrypoints.llm import LLM
from testbed.engine.params import SamplingParams
from testbed.bench.datasets import random_dataset
n, inp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
flags = sys.argv[4:]
emulate = None
if "--emulate" in flags:
    i = flags.index("--emulate")
    if i + 1 >= len(flags):
        sys.exit("offline.py: --emulate takes a GPU preset, e.g. --emulate H100-SXM")
    emulate = flags[i + 1]
    del flags[i:i + 2]
unknown = [a for a in flags if a not in ("--async-scheduling", "--enforce-eager")]
if unknown:
    sys.exit(f"offline.py: unknown engine flags {unknown}; it takes --async-scheduling, --enforce-eager and "
             "--emulate GPU")
eager = "--enforce-eager" in flags
engine_args = dict(max_model_len=4096, async_scheduling="--async-scheduling" in flags)
executor = None
if emulate is not None:
    from testbed.entrypoints.llm_args import engine_config
    from testbed.sim.emulator import EmulatedExecutor
    executor = EmulatedExecutor("Llama-3.2-1B", engine_config(dict(engine_args)), gpu=emulate)
llm = LLM("Llama-3.2-1B", load_format="dummy", enforce_eager=eager, executor=executor, **engine_args)
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
          f"eager={eager}{'' if emulate is None else ' emulated ' + emulate}: {dt:.2f} s, "
          f"{tok} output tokens, {tok/dt:.1f} tok/s, {n/dt:.2f} req/s")
