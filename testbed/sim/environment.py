"""The simulator's SimPy environment: SimPy's, plus events at an absolute time.

A SimPy timeout lands on `now + delay`, and with round-to-nearest-even not every float is `now + d` for
some float d. A replica that fast-forwards a stretch of steps (engine/fast_forward.py) must resume at
exactly the time stepping would have reached, so it asks for that time itself: `timeout_at(t)` queues
an event at t with the priority and sequence number a timeout created now would get (SimPy orders
events by (time, priority, creation order)).
"""
from __future__ import annotations

from heapq import heappush

import simpy
from simpy.core import NORMAL


class SimEnvironment(simpy.Environment):
    def timeout_at(self, t: float) -> simpy.Event:
        """An event processed at simulated time `t` (>= now), as a timeout scheduled now would be."""
        if not t >= self._now:
            raise ValueError(f"timeout_at({t!r}) is before the current time {self._now!r}")
        event = simpy.Event(self)
        event._ok, event._value = True, None  # what Event.succeed sets, without its scheduling at `now`
        heappush(self._queue, (t, NORMAL, next(self._eid), event))
        return event


def landing(start: float, duration: float) -> float:
    """Where a step of `duration` that starts at `start` ends in simulated time: where a replica that is at
    `start` lands when it waits `yield env.timeout(start + duration - env.now)` (not always start + duration)."""
    end = start + duration
    return start + (end - start)
