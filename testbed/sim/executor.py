"""SimExecutor: the sim-mode Executor. A cost model stands in for the GPU.

It returns one token for every request that caught up with its tokens this step (exactly what a
real model runner samples) and the step's modelled duration. Output lengths come from the trace
through `max_tokens` + `ignore_eos`, so requests finish exactly as the trace says.
"""
from __future__ import annotations

from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.sim.cost_model import CostModel

SIM_TOKEN_ID = 0


class SimExecutor:
    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(self.sampled(so), self.cost_model.step_time(so))

    @staticmethod
    def sampled(so: SchedulerOutput) -> list[int]:
        """The step's tokens: one for each request that caught up with its tokens, -1 for the others."""
        return [SIM_TOKEN_ID if r.num_computed_tokens >= r.num_tokens else -1 for r in so.requests]
