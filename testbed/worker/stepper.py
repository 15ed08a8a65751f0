"""The real-mode step loop around one EngineCore: schedule -> execute -> update, optionally overlapped.

With async scheduling (vLLM's `--async-scheduling`) one step stays in flight: step N+1 is scheduled,
prepared and launched on the device before step N's sampled tokens are read back and applied, so
the host work of scheduling, input building and output handling hides behind the GPU. The core sees
the same calls in a fixed order (schedule N+1, then update N); a decode of N+1 computes on the token
N sampled through a placeholder the model runner fills on the device. Invariant: steps are updated
in the order they were scheduled, each exactly once, and never more than one step is in flight.
"""
from __future__ import annotations

from typing import Callable

from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput


class EngineStepper:
    def __init__(self, core: EngineCore, executor, clock: Callable[[], float], async_scheduling: bool = False) -> None:
        if async_scheduling and not hasattr(executor, "execute_async"):
            raise ValueError("--async-scheduling needs an executor that can launch a step without waiting for it "
                             "(tensor_parallel_size 1); drop the flag or use one GPU")
        self.core = core
        self.executor = executor
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.in_flight: tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]] | None = None

    def has_work(self) -> bool:
        """Requests live in the core or a step still to be read back."""
        return self.in_flight is not None or self.core.has_unfinished_requests()

    def step(self, now: float | None = None) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """One schedule at `now` (default: the clock) and the update of one step at the clock; the
        SchedulerOutput returned is the one scheduled now (empty when nothing was schedulable)."""
        core = self.core
        so = core.schedule(self.clock() if now is None else now)
        if not self.async_scheduling:
            if so.is_empty:
                return so, []
            out = self.executor.execute(so)
            return so, core.update(so, out, self.clock())
        launched = None if so.is_empty else (so, self.executor.execute_async(so))
        outputs = self.drain()
        self.in_flight = launched
        return so, outputs

    def drain(self) -> list[RequestOutput]:
        """Read back and apply the step in flight, if any (before an abort-all or shutdown)."""
        if self.in_flight is None:
            return []
        prev, result = self.in_flight
        self.in_flight = None
        return self.core.update(prev, result(), self.clock())
