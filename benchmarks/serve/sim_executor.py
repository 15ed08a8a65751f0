"""An engine-core executor that runs the simulator instead of a GPU, to measure the API server alone.

  PYTHONPATH=. testbed serve Llama-3.2-1B --load-format dummy \
      --executor-factory benchmarks.serve.sim_executor:create

The engine core steps the sim-mode SimExecutor (it samples token 0 wherever a model would sample).
SIM_STEP_S sets how long each step takes: unset or 0 means no wait, so served throughput is bounded
by the engine loop, the API server and the client. `roofline:GPU` (e.g. roofline:H200) means each step
sleeps the roofline model's time for the named model on that GPU.
`python benchmarks/serve/sim_executor.py N IN OUT` runs the same executor in-process on the random
requests `testbed bench serve --dataset random` sends, without the server: the overhead ratio's
denominator.
"""
from __future__ import annotations

import os
import time

from testbed.engine.config import EngineConfig
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.presets import get_model_spec
from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.executor import SimExecutor
from testbed.sim.hardware import get_gpu_spec

NUM_GPU_BLOCKS = 1 << 16


class ZeroCost:
    def step_time(self, so: SchedulerOutput) -> float:
        return 0.0


class SleepingSimExecutor:
    """SimExecutor with the executor interface the engine process needs; sleeps each modelled step."""

    def __init__(self, model: str, config: EngineConfig, step: str) -> None:
        spec = get_model_spec(model)
        if step.startswith("roofline:"):
            cost = RooflineCostModel(spec, get_gpu_spec(step.split(":", 1)[1]))
        elif step.strip() in ("", "0"):
            cost = ZeroCost()
        else:
            raise ValueError(f"SIM_STEP_S={step!r}: use 0 (steps take no time) or roofline:GPU (e.g. roofline:H200)")
        self.sim = SimExecutor(cost)
        self.num_gpu_blocks = NUM_GPU_BLOCKS
        self.max_model_len = config.max_model_len or spec.max_position_embeddings
        self.eos_token_id = None
        self.vocab_size = spec.vocab_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.sim.execute(so)
        if out.duration:
            time.sleep(out.duration)
        return out

    def shutdown(self) -> None:
        pass


def create(model: str | None, config: EngineConfig, **_) -> SleepingSimExecutor:
    return SleepingSimExecutor(model or "Llama-3.2-1B", config, os.environ.get("SIM_STEP_S", "0"))


def offline(n: int, input_len: int, output_len: int, model: str = "Llama-3.2-1B") -> float:
    """Output tokens/s of the engine loop alone over this executor (every request at once)."""
    import math
    from testbed.engine.core import EngineCore
    from testbed.engine.request import Request, SamplingParams
    from testbed.server.bench_datasets import random_dataset
    from testbed.worker.stepper import EngineStepper
    config = EngineConfig(max_model_len=4096)
    ex = create(model, config)
    core = EngineCore(config, ex.num_gpu_blocks, ex.max_model_len)
    stepper = EngineStepper(core, ex, time.time)
    reqs = random_dataset(n, input_len, output_len, 0.0, vocab_size=ex.vocab_size, max_model_len=4096,
                          request_rate=math.inf, burstiness=1.0, seed=0)
    t = time.perf_counter()
    for i, r in enumerate(reqs):
        core.add_request(Request(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                 time.time()), time.time())
    tokens = 0
    while stepper.has_work():
        tokens += sum(len(o.new_token_ids) for o in stepper.step()[1])
    dt = time.perf_counter() - t
    print(f"OFFLINE-SIM n={n} in={input_len} out={output_len} step={os.environ.get('SIM_STEP_S', '0')}: "
          f"{dt:.2f} s, {tokens} output tokens, {tokens / dt:.1f} tok/s")
    return tokens / dt


if __name__ == "__main__":
    import sys
    offline(*map(int, sys.argv[1:4]))
