"""One simulated replica's step loop: the one every simulator driver runs an EngineCore with.

The loop makes the calls real mode's EngineStepper makes, in its order: apply the grammar outcomes that are
due, schedule, execute, wait for the step's end, update. With async scheduling it keeps one step in flight
as the real stepper does: step N+1 is scheduled when step N starts, starts on the device when N ends, and N
is updated at its end (host work hidden); the core sees the same call order.

What differs between drivers is a handful of hooks, each a method a subclass overrides:
- `ready(busy)`: wait until the replica may schedule (a serving replica sleeps while it holds no request; a
  recorded replay waits for the recorded start of its next step); the time its grammar outcomes are applied
  at, or None to end the loop;
- `fast_forward()`: advance a stretch of steps in one go where that is exact (engine/fast_forward.py);
- `stalled()`: nothing is in flight and nothing was schedulable (or the replica holds no request);
- `step_end(start, duration)` / `wait_end(start, duration)`: when a step ends, and the event that lands there
  (a SimPy timeout lands on `now + delay`, so each driver keeps its own arithmetic, and with it its records);
- `updated(so, finished, busy)`: after each update.
Invariant: a replica never schedules while a step of its own is being updated, and updates its steps in the
order it scheduled them.
"""
from __future__ import annotations

from typing import Generator

import simpy

from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.sim.environment import SimEnvironment
from testbed.sim.executor import SimExecutor
from testbed.sim.grammars import SimGrammars

Step = tuple[SchedulerOutput, ModelRunnerOutput, float, float]  # (batch, output, start, duration)


class ReplicaLoop:
    """Replica `r`'s step loop over `eng`; run it as a SimPy process: `env.process(loop.run())`."""

    def __init__(self, env: SimEnvironment, eng: EngineCore, r: int, executor: SimExecutor, grammars: SimGrammars,
                 overlap: bool = False) -> None:
        self.env, self.eng, self.r = env, eng, r
        self.executor, self.grammars, self.overlap = executor, grammars, overlap

    def ready(self, busy: bool) -> Generator[simpy.Event, object, float | None]:
        """Wait until the replica may schedule (`busy`: a step is in flight); the time to apply grammar outcomes
        at, or None: the replica is done."""
        return self.env.now
        yield  # a generator

    def fast_forward(self) -> Generator[simpy.Event, object, bool]:
        """Advance a stretch of steps in one go where that is exact; True if it did (the loop starts over)."""
        return False
        yield  # a generator

    def stalled(self) -> Generator[simpy.Event, object, None]:
        """No step is in flight and nothing was schedulable, or the replica holds no request."""
        raise RuntimeError(f"replica {self.r}: nothing schedulable with {len(self.eng.requests)} requests live "
                           "(scheduler bug: every admitted request must fit the cache)")
        yield  # a generator

    def step_end(self, start: float, duration: float) -> float:
        """When a step that starts at `start` and takes `duration` ends."""
        return start + duration

    def wait_end(self, start: float, duration: float) -> simpy.Event:
        """The event at the end of a step that started at `start` (now, or when the step before it ended)."""
        return self.env.timeout(self.step_end(start, duration) - self.env.now)

    def updated(self, so: SchedulerOutput, finished: list, busy: bool) -> None:
        """After the update of `so` (`finished`: the requests it finished; `busy`: another step is in flight)."""

    def run(self) -> Generator[simpy.Event, object, None]:
        env, eng, r, grammars, overlap = self.env, self.eng, self.r, self.grammars, self.overlap
        in_flight: Step | None = None  # the launched step
        while True:
            t = yield from self.ready(in_flight is not None)
            if t is None:
                return
            grammars.apply(r, t)
            if not eng.requests and in_flight is None:
                yield from self.stalled()  # its last request's grammar failed
                continue
            if in_flight is None and (yield from self.fast_forward()):
                continue  # the stretch may go on
            so = eng.schedule(env.now)
            if so.is_empty and in_flight is None:
                yield from self.stalled()
                continue
            launched: Step | None = None
            if not so.is_empty:
                out = self.executor.execute(so)
                start = self.step_end(in_flight[2], in_flight[3]) if in_flight is not None else env.now
                launched = (so, out, start, out.duration)
            if not overlap:
                in_flight, launched = launched, None
            if in_flight is not None:
                step_so, step_out, start, duration = in_flight
                yield self.wait_end(start, duration)
                self.updated(step_so, eng.update(step_so, step_out, env.now), launched is not None)
            in_flight = launched
