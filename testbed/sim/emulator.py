"""Emulation: an executor that runs no model. Each step takes the cost model's predicted time (a profile,
the roofline, or none) and samples synthetic tokens, so the real API server and engine core serve at
real-GPU timing on a machine without one (`testbed serve --emulate`).

Timing: a step ends at (its schedule time + predicted step time); the executor sleeps whatever of that the
engine's own host work has not already used. Under async scheduling a step starts on the "device" when the
previous one ends, as on a GPU; with pipeline parallelism a batch crosses the emulated stages of sim/pipeline.py
(the engine keeps up to P in flight), ending when it leaves the last. Tokens: each request echoes its prompt, one token per step (never EOS), so
text prompts give readable output and requests end at max_tokens or a stop condition. Embeddings (pooling
requests) are synthetic too, of the model's hidden size: the prompt's token ids counted modulo it (MEAN), or
the last one's position set (LAST), normalised as asked; equal prompts get equal vectors.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from testbed.engine.config import EngineConfig
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.specs.presets import get_model_spec
from testbed.sim.cost_model import kv_block_bytes, num_gpu_blocks
from testbed.sim.executor import add_beam_logprobs
from testbed.sim.factory import check_cost_model_name, load_cost_model
from testbed.specs.hardware import get_gpu_spec

COST_MODELS = "'auto', 'roofline', 'zero' (no wait: the engine and API server alone) or a profile JSON"
LATE_WINDOW = 200  # steps a falling-behind check looks at


def check_emulation(model: str, gpu: str, cost_model: str) -> None:
    """ValueError, in the flags' words, for what EmulatedExecutor cannot emulate: an unknown model preset or GPU, a
    cost model that does not exist or replays a run. `testbed serve` checks before it starts the engine process."""
    get_model_spec(model)
    get_gpu_spec(gpu)
    if cost_model.startswith("recorded:"):
        raise ValueError(f"--cost-model {cost_model}: emulation predicts each step; use {COST_MODELS}")
    if cost_model != "zero":
        check_cost_model_name(cost_model)


class EmulatedExecutor:
    def __init__(self, model: str, config: EngineConfig, gpu: str = "H100-SXM", cost_model: str = "auto",
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        check_emulation(model, gpu, cost_model)
        spec = get_model_spec(model)
        gpu_spec = get_gpu_spec(gpu)
        if cost_model == "zero":
            self.cost, self.cost_model = None, "zero"
        else:
            # priced as one engine: a DP replica's own loop does its extra host work for real (no dp_replica_host)
            self.cost, self.cost_model = load_cost_model(cost_model, spec, gpu_spec,
                                                         dataclasses.replace(config, data_parallel_size=1))
        self.model_path = spec.name
        self.hf_config = spec.hf_config()
        self.max_model_len = config.max_model_len or spec.max_position_embeddings
        self.num_gpu_blocks = config.num_gpu_blocks or num_gpu_blocks(spec, gpu_spec, config.block_size,
                                                                      config.gpu_memory_utilization,
                                                                      config.tensor_parallel_size,
                                                                      pipeline_parallel_size=config.pipeline_parallel_size)
        self.num_cpu_blocks = config.cpu_blocks(kv_block_bytes(spec, config.block_size, config.tensor_parallel_size))
        self.eos_token_id = None
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.clock, self.sleep = clock, sleep
        self._sync = not config.async_scheduling and config.pipeline_parallel_size == 1
        self._device_free = 0.0  # when the emulated device finishes its last launched step
        self._late = self._steps = 0  # steps (this window) that ended after their predicted end
        self._late_s = self._pred_s = 0.0
        self._warned = False

    def _tokens(self, so: SchedulerOutput) -> list[int]:
        out = []
        for r, before, n in zip(so.requests, so.num_computed_before, so.num_new_tokens):
            if before + n < r.num_tokens:
                out.append(-1)  # mid-prompt chunk: samples nothing
            else:
                out.append(int(r.prompt_token_ids[r.num_output_tokens % r.num_prompt_tokens]))
        return out

    def _pooled(self, so: SchedulerOutput) -> list | None:
        """The synthetic embedding of each pooling request whose prompt ends in this step (module docstring)."""
        if not so.has_pooling:
            return None
        out: list = [None] * so.num_reqs
        for i, (r, before, n) in enumerate(zip(so.requests, so.num_computed_before, so.num_new_tokens)):
            pp = r.pooling_params
            if pp is None or before + n < r.num_prompt_tokens:
                continue
            vec = [0.0] * self.hidden_size
            for t in (r.prompt_token_ids if pp.pooling_type == "MEAN" else r.prompt_token_ids[-1:]):
                vec[int(t) % self.hidden_size] += 1.0
            norm = sum(v * v for v in vec) ** 0.5 if pp.normalize else float(len(r.prompt_token_ids)
                                                                            if pp.pooling_type == "MEAN" else 1)
            out[i] = [v / norm for v in vec]
        return out

    def _output(self, so: SchedulerOutput, duration: float) -> ModelRunnerOutput:
        """The step's synthetic tokens, embeddings and (beam search) top logprobs."""
        out = ModelRunnerOutput(self._tokens(so), duration, pooler_output=self._pooled(so))
        if so.has_beams:
            add_beam_logprobs(so, out)
        return out

    def _predict(self, so: SchedulerOutput) -> float:
        return self.cost.step_time(so) if self.cost is not None else 0.0

    def _account(self, wait: float, predicted: float) -> None:
        """Warn once when most steps of a window end after their predicted time: the host cannot keep up with
        the cost model, so the served timings are the host's, not the emulated GPU's."""
        self._steps += 1
        self._pred_s += predicted
        if wait < -max(1e-3, 0.2 * predicted):
            self._late += 1
            self._late_s -= wait
        if self._steps < LATE_WINDOW:
            return
        if self._late > LATE_WINDOW // 2 and not self._warned:
            from testbed import warn
            warn(f"emulation falls behind its cost model: {self._late} of {self._steps} steps ended late, by "
                 f"{1e3 * self._late_s / self._late:.1f} ms on average against {1e3 * self._pred_s / self._steps:.1f} ms "
                 "predicted; the host is too busy to emulate this GPU, so latencies are the host's")
            self._warned = True
        self._late = self._steps = 0
        self._late_s = self._pred_s = 0.0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        start = so.step_state[0] if so.step_state else self.clock()
        d = self._predict(so)
        wait = start + d - self.clock()
        self._account(wait, d)
        if wait > 0:
            self.sleep(wait)
        return self._output(so, d)

    def execute_async(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Launch: the step starts when the emulated device is free; the returned function waits for its end. A
        synchronous engine (one step at a time) launches a step only to work beside it before waiting: its step is
        priced as `execute` prices it, from its schedule."""
        if self._sync:
            return lambda: self.execute(so)
        d = self._predict(so)
        if hasattr(self.cost, "launch"):  # pipeline stages: the batch queues behind earlier ones stage by stage
            end = self.cost.launch(so, self.clock())
        else:
            end = max(self._device_free, self.clock()) + d
            self._device_free = end
        out = self._output(so, d)

        def result() -> ModelRunnerOutput:
            wait = end - self.clock()
            if wait > 0:
                self.sleep(wait)
            return out

        return result

    def shutdown(self) -> None:
        pass


def create(model: str | None, config: EngineConfig, gpu: str = "H100-SXM", cost_model: str = "auto",
           **_) -> EmulatedExecutor:
    """Executor factory for the engine-core process (`testbed serve --emulate`); `model` is a preset name
    (the bundled SmolLM2 folder maps to its preset)."""
    return EmulatedExecutor(emulated_model(model), config, gpu, cost_model)


def emulated_model(model: str | None) -> str:
    """The preset `--emulate` times for `testbed serve`'s model (none given: SmolLM2-135M, the bundled model's)."""
    return model or "SmolLM2-135M"
