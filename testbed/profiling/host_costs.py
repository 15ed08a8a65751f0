"""The EngineCore's own host work per step on this machine: part of a profile, since a serving step's cycle
includes the scheduler and the update as well as the executor.

Decode steps are timed in one of three ways, named in the result's `method`:
  cycle     a real decode batch stepped by the EngineStepper on the executor, as `testbed replay` and the
            server step it: each step's cycle (one schedule's start to the next one's) less the model runner's
            own wall time of the step (its StepTiming), which the profile's step tables price. That is the
            scheduler, the update, the executor's call around the runner and the stepper's own work: what a
            cycle spends outside the runner (what profiles made from 074730c on record);
  in_loop   schedule and update of a real decode batch on the executor, each step run between them, untimed;
  isolated  schedule + update back to back without a model (what profiles made before in_loop recorded).
In a real loop schedule + update took 1.35-2.17x its isolated time (benchmarks/engine_host.py: a tiny model on a
CPU, batches 16-128); in loaded replays on an H100 a cycle spent 0.23-0.79 ms outside the runner at 32-127 rows
(benchmarks/in_loop.py), two to four times what schedule + update took in a loop on such a host."""
from __future__ import annotations

import statistics
import time

import numpy as np

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request
from testbed.engine.stepper import EngineStepper


def engine_host_costs(config: EngineConfig, max_model_len: int, batches: list[int], admit_tokens: list[int],
                      executor=None, decode_steps: int = 30, method: str | None = None) -> dict:
    """Seconds of the EngineCore's own work per step on this host: a decode batch's (`method` as the module
    docstring says; default: cycle on `executor` when given, else isolated), the median of `decode_steps` steps,
    and a step admitting one prompt (with and without prefix caching, isolated)."""
    method = method or ("isolated" if executor is None else "cycle")
    if method not in ("cycle", "in_loop", "isolated") or (executor is None) != (method == "isolated"):
        raise ValueError(f"engine host sweep: method {method!r} with{'out' if executor is None else ''} an executor: "
                         "cycle and in_loop time steps on an executor, isolated without one")
    def timed_steps(core: EngineCore, n: int, execute=None) -> float:
        """Median seconds of schedule + update over n steps; `execute` runs each step between them, untimed
        (None: no model, every row samples token 7, that output's making timed with the update)."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            so = core.schedule(0.0)
            if execute is None:
                out, away = ModelRunnerOutput([7 if r.num_computed_tokens >= r.num_tokens else -1
                                               for r in so.requests]), 0.0
            else:
                t1 = time.perf_counter()
                out = execute(so)
                away = time.perf_counter() - t1
            core.update(so, out, 0.0)
            times.append(time.perf_counter() - t0 - away)
        return statistics.median(times)

    def cycle_steps(core: EngineCore, n: int) -> float:
        """Median seconds over n steps of a cycle outside the model runner: each step's start to the next one's,
        less the runner's own wall time of the step (the stepper's output timing)."""
        runner = executor.runner
        timing, runner.record_timing = runner.record_timing, True
        try:
            stepper = EngineStepper(core, executor, time.perf_counter)
            times, prev = [], None
            for _ in range(n + 1):
                t0 = time.perf_counter()
                if prev is not None:
                    times.append(t0 - prev)
                stepper.step()
                stepper.has_work()  # as a serving loop asks before its next step
                out = stepper.last_output
                if out is None or out.timing is None:
                    raise RuntimeError("engine host sweep: the executor gave no step timing (record_timing)")
                prev = t0 + out.timing.wall_s
        finally:
            runner.record_timing = timing
        return statistics.median(times)

    rng = np.random.default_rng(0)
    # each decode request outlives the steps timed (the prefill, two warm-up decodes, then decode_steps + 1)
    tokens = max(64, decode_steps + 8)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    bs = config.block_size

    def admitted(core: EngineCore, req: Request) -> Request:
        if core.add_request(req, 0.0) is not None:
            raise RuntimeError(f"engine host sweep: request {req.request_id} was rejected ({req.stop_reason})")
        return req

    decode = []
    execute = None if executor is None else executor.execute
    high = 30000 if executor is None else executor.vocab_size  # a model reads the tokens: stay in its vocabulary
    low = min(1000, high // 10)
    for b in batches:
        blocks = b * -(-(16 + tokens) // bs) + 8
        if executor is not None and blocks > executor.num_gpu_blocks:
            raise ValueError(f"engine host sweep: a decode batch of {b} needs {blocks} KV blocks, the executor has "
                             f"{executor.num_gpu_blocks}; profile with fewer --max-num-seqs or more KV cache")
        core = EngineCore(EngineConfig(**{**config.to_dict(), "max_num_seqs": max(b, config.max_num_seqs),
                                          "max_num_batched_tokens": max(config.max_num_batched_tokens, 16 * b)}),
                          num_gpu_blocks=blocks, max_model_len=max_model_len)
        for i in range(b):
            admitted(core, Request(f"host-{b}-{i}", rng.integers(low, high, 16, dtype=np.int32), params, 0.0))
        timed_steps(core, 1 if execute is None else 3, execute)  # the prefills (in a loop, two decodes more)
        decode.append(cycle_steps(core, decode_steps) if method == "cycle" else timed_steps(core, decode_steps, execute))
    admit = {}
    for caching in (False, True):
        cfg = EngineConfig(**{**config.to_dict(), "enable_prefix_caching": caching})
        times = []
        for n in admit_tokens:
            samples = []
            for k in range(5):
                core = EngineCore(cfg, num_gpu_blocks=-(-(n + tokens) // bs) + 8,
                                  max_model_len=max(max_model_len, n + tokens + 1))
                admitted(core, Request(f"a{k}", rng.integers(1000, 30000, n, dtype=np.int32), params, 0.0))
                samples.append(timed_steps(core, 1))
            times.append(statistics.median(samples))
        admit["prefix_caching" if caching else "plain"] = times
    return {"decode_batch": batches, "decode_step_s": decode, "method": method,
            "admit_tokens": admit_tokens, "admit_step_s": admit}
