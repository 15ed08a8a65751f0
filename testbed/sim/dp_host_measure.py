"""A data-parallel replica's host work per step beyond a single engine's, measured on this host (`testbed profile
--dp-replica-host`): the profile's `dp_replica_host` section, which the simulator charges every DP replica step.

Both loops run one emulated executor (sim/emulator.py: a step sleeps the time the model's profile predicts for it,
so the host is as free during a step as beside a GPU): the single engine as `testbed replay` runs it, in process
(EngineStepper over the core), and DATA_PARALLEL_SIZE real replica processes behind the DP coordinator (the stack of
`LLM(data_parallel_size=N)`), each publishing its outputs, polling its inputs and reporting its stats in its own
engine loop. For each batch size b, b requests per replica (PROMPT_TOKENS in, OUTPUT_TOKENS out, all at once)
decode together; a step's gap runs from its update's start to the next schedule (its records: start + duration to
the next start). The median gaps of the decode steps at exactly b rows, DP replica less single engine, are fitted
as step_s + row_s x b (non-negative least squares). The host is the one the profile is made on: its cores decide
how fast the replica's loop publishes its outputs and reports.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request
from testbed.engine.stepper import EngineStepper

DATA_PARALLEL_SIZE = 2
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 48
BATCHES = (1, 8, 32, 64)
MIN_STEPS = 10  # decode steps at a batch size for its median to count


def _requests(tag: str, n: int, vocab: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(len(tag) * 7919 + n)
    return [(f"{tag}-{i}", rng.integers(1000, min(vocab, 30000), PROMPT_TOKENS).tolist()) for i in range(n)]


def _median_gaps(steps: list[tuple], batches: list[int]) -> dict[int, float]:
    """Per batch size: the median gap after the decode-only steps of exactly that many rows (STEP_COLUMNS rows of
    one replica or several: replica, start, duration, num_reqs, num_prefill_tokens, ...) that the same replica's
    next step followed within a millisecond."""
    by_replica: dict[int, list[tuple]] = {}
    for row in steps:
        by_replica.setdefault(row[0], []).append(row)
    gaps: dict[int, list[float]] = {b: [] for b in batches}
    for rows in by_replica.values():
        rows.sort(key=lambda r: r[1])
        for a, nxt in zip(rows, rows[1:]):
            gap = nxt[1] - (a[1] + a[2])
            if a[3] in gaps and a[4] == 0 and 0.0 <= gap < 1e-3:
                gaps[a[3]].append(gap)
    return {b: statistics.median(g) for b, g in gaps.items() if len(g) >= MIN_STEPS}


def single_engine_steps(model: str, config: EngineConfig, gpu: str, cost_model: str, batches: list[int]) -> list:
    """The step records of one engine in process, `batches` waves of requests one after another."""
    from testbed.sim.emulator import EmulatedExecutor
    executor = EmulatedExecutor(model, config, gpu, cost_model)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    steps: list = []
    for b in batches:
        core = EngineCore(config, executor.num_gpu_blocks, executor.max_model_len)
        stepper = EngineStepper(core, executor, time.time)
        for rid, prompt in _requests(f"single-{b}", b, executor.vocab_size):
            core.add_request(Request(rid, np.asarray(prompt, dtype=np.int32), params, time.time()), time.time())
        while stepper.has_work():  # the loop LLM.step runs for `testbed replay`
            stepper.step()
        steps.extend(core.records.steps)
    return steps


def replica_steps(model: str, config: EngineConfig, gpu: str, cost_model: str, batches: list[int]) -> list:
    """The step records of DATA_PARALLEL_SIZE replica processes, b requests per replica for each b in turn."""
    import dataclasses

    from testbed.entrypoints.dp_llm import DPEngine
    dp_config = dataclasses.replace(config, data_parallel_size=DATA_PARALLEL_SIZE, dp_policy="round_robin")
    engine = DPEngine(model, dp_config, executor_factory="testbed.sim.emulator:create",
                      executor_args={"gpu": gpu, "cost_model": cost_model})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        vocab = engine.ready.vocab_size
        for b in batches:
            for rid, prompt in _requests(f"dp-{b}", b * DATA_PARALLEL_SIZE, vocab):
                engine.add_request(rid, prompt, params, engine.now())
            deadline = time.monotonic() + 120.0
            while engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dp replica host: the replicas did not finish {b} requests each in 120 s")
                engine.step(timeout=1.0)
    finally:
        engine.shutdown()
    return list(engine.records().steps)


def measure_dp_replica_host(model: str, config: EngineConfig, gpu: str = "H100-SXM", cost_model: str = "auto",
                            batches: list[int] | None = None) -> dict:
    """The `dp_replica_host` section (see the module docstring) for the emulated `model` preset on `gpu`."""
    from testbed.sim.profiled import fit_nonnegative
    batches = list(batches or BATCHES)
    config = EngineConfig(**{**config.to_dict(), "data_parallel_size": 1, "enable_prefix_caching": False,
                             "max_num_seqs": max(config.max_num_seqs, max(batches)), "async_scheduling": False,
                             "pipeline_parallel_size": 1})
    t0 = time.perf_counter()
    single = _median_gaps(single_engine_steps(model, config, gpu, cost_model, batches), batches)
    dp = _median_gaps(replica_steps(model, config, gpu, cost_model, batches), batches)
    both = [b for b in batches if b in single and b in dp]
    if not both:
        raise RuntimeError("dp replica host: no batch size ran enough back-to-back decode steps in both loops")
    extra = [dp[b] - single[b] for b in both]
    step_s, row_s = fit_nonnegative([[1.0, float(b)] for b in both], extra) if len(both) > 1 else (max(extra[0], 0), 0)
    return {"step_s": float(step_s), "row_s": float(row_s), "method": "measured", "emulated": f"{model} on {gpu}",
            "data_parallel_size": DATA_PARALLEL_SIZE, "batch": both, "single_gap_s": [single[b] for b in both],
            "replica_gap_s": [dp[b] for b in both], "wall_s": time.perf_counter() - t0}


def profile_section(profile: dict, path: str, config: EngineConfig) -> dict:
    """The dp_replica_host section for the profile stored at `path` (its model preset emulated with it, on its GPU
    preset; a CPU profile's steps on the H100's); ValueError when its model is no preset the emulator knows."""
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec
    try:
        model = get_model_spec(profile["model"]["name"]).name
    except ValueError:
        raise ValueError(f"--dp-replica-host: {path} is a profile of {profile['model']['name']!r}, no model preset; "
                         "the replicas' loops are measured with a preset's emulated steps (its profile's timing): "
                         "profile a preset (--model PRESET --load-format dummy)") from None
    try:
        gpu = get_gpu_spec(profile["gpu"]).name
    except ValueError:
        gpu = "H100-SXM"
    config = EngineConfig(**{**config.to_dict(), "tensor_parallel_size": int(profile["tensor_parallel_size"]),
                             "block_size": int(profile["engine"]["block_size"])})
    return measure_dp_replica_host(model, config, gpu, path)
