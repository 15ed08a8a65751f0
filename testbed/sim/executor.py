"""SimExecutor: the sim-mode Executor. A cost model stands in for the GPU.

It returns one token for every request that caught up with its tokens this step (exactly what a
real model runner samples) and the step's modelled duration. Output lengths come from the trace
through `max_tokens` + `ignore_eos`, so requests finish exactly as the trace says. A beam-search row
gets synthetic top logprobs (`beam_logprobs`), so the engine forks, keeps and drops beams as it would on
a model, and its blocks are shared and copied on write as they would be; which beams win is the
synthetic distribution's, not a model's.
"""
from __future__ import annotations

import zlib

from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.request import Request
from testbed.sim.cost_model import CostModel

SIM_TOKEN_ID = 0


def beam_logprobs(req: Request, width: int) -> tuple[float, int, list[tuple[int, float]]]:
    """A deterministic next-token distribution's top 2 x width logprobs for a beam (a function of its group,
    its length and its last token, so sibling beams differ and the same run gives the same beams): tokens
    1..2 x width at logprobs falling with rank, shifted per beam by up to 1 nat."""
    group = req.group or req
    last = req.output_token_ids[-1] if req.output_token_ids else -1
    h = zlib.crc32(f"{group.request_id}:{req.num_tokens}:{last}".encode())
    shift = (h % 1000) / 1000.0
    top = [(1 + (h + j) % (2 * width), -shift - 0.5 * (j + 1)) for j in range(2 * width)]
    return top[0][1], 1, top


class SimExecutor:
    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput(self.sampled(so), self.cost_model.step_time(so))
        if so.has_beams:
            add_beam_logprobs(so, out)
        return out

    @staticmethod
    def sampled(so: SchedulerOutput) -> list[int]:
        """The step's tokens: one for each request that caught up with its tokens, -1 for the others."""
        return [SIM_TOKEN_ID if r.num_computed_tokens >= r.num_tokens else -1 for r in so.requests]


def add_beam_logprobs(so: SchedulerOutput, out: ModelRunnerOutput) -> None:
    """Give the step's sampled beam-search rows `beam_logprobs` (and their top token as the one drawn)."""
    sampled = out.sampled_token_ids
    for i, r in enumerate(so.requests):
        bp = (r.group or r).beam_params
        if bp is None or sampled[i] < 0:
            continue
        if out.logprobs is None:
            out.logprobs = [None] * len(sampled)
        out.logprobs[i] = lp = beam_logprobs(r, bp.beam_width)
        sampled[i] = lp[2][0][0]
