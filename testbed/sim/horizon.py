"""When a request can next reach each replica of the simulated cluster: how far a replica may fast-forward.

A fast-forwarded stretch (engine/fast_forward.py) must stop before the first step that starts once a new
request could be in the replica's queue. The arrival process's times are known in advance, float for
float: it resumes at `now + (arrival + hop - now)` whenever that delay is positive (the coordinator takes
a request one hop after its arrival), routes the request then, and the request is admitted one hop after
that (at once when there is no hop). So the horizon needs no look at the event queue:

- any routing policy: the next routing, or the next admission of a request already routed (a replica
  cannot know where the coordinator will send a request before it is routed);
- round_robin, which reads no stats: arrival i reaches replica i % dp (every simulated replica stays up),
  so each replica's horizon is its own next admission.

The other policies' stretches go on lazily instead (engine/fast_forward.py's `advance`): bounded by the requests
already routed to the replica (`routed_here`), and cut when the next one is.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Sequence


class AdmissionHorizon:
    def __init__(self, arrivals: Sequence[float], hop: float, num_replicas: int, round_robin: bool) -> None:
        self.route_times: list[float] = []
        now = 0.0  # the arrival process starts at time 0
        for a in arrivals:
            delay = a + hop - now
            if delay > 0:
                now = now + delay
            self.route_times.append(now)
        self.admit_times = [t + hop for t in self.route_times] if hop else self.route_times
        self.num_replicas, self.round_robin = num_replicas, round_robin
        self.routed = self.admitted = 0
        self.admitted_to = [0] * num_replicas  # requests admitted to each replica so far
        self.pending: list[deque[float]] = [deque() for _ in range(num_replicas)]  # admission times of those routed

    def route(self, replica: int) -> None:
        """The next arrival was routed to `replica`; AssertionError if round_robin sent it elsewhere."""
        if self.round_robin and replica != self.routed % self.num_replicas:
            raise AssertionError(f"round_robin routed request {self.routed} to replica {replica}, not "
                                 f"{self.routed % self.num_replicas}")
        self.pending[replica].append(self.admit_times[self.routed])
        self.routed += 1

    def admit(self, replica: int) -> None:
        """A routed request reached `replica` (admitted or rejected there)."""
        self.admitted += 1
        self.admitted_to[replica] += 1
        self.pending[replica].popleft()

    def next_routing(self) -> float:
        """When the next request is routed (inf: none left)."""
        return self.route_times[self.routed] if self.routed < len(self.route_times) else math.inf

    def routed_here(self, replica: int) -> float:
        """When the next request already routed to `replica` reaches it (inf: none on its way)."""
        pending = self.pending[replica]
        return pending[0] if pending else math.inf

    def until(self, replica: int) -> float:
        """No request reaches `replica` before this time."""
        n = len(self.admit_times)
        if self.round_robin:
            i = replica + self.num_replicas * self.admitted_to[replica]
            return self.admit_times[i] if i < n else math.inf
        nxt = self.route_times[self.routed] if self.routed < n else math.inf
        return min(nxt, self.admit_times[self.admitted]) if self.admitted < self.routed else nxt
