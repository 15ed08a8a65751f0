"""When each simulated request's grammar is ready: the simulator's side of compiling grammars off the step
loop (EngineCore.compile_grammars; real mode: engine/stepper.py and worker/grammar.py).

A structured request waits (WAITING_FOR_FSM) from its admission until its grammar's outcome, applied before
a replica schedules, as the real stepper applies its polls:
- replaying a recorded run (`--cost-model recorded:RUN`): the outcome the run wrote to grammars.parquet,
  before the step it preceded there (by step index: the replayed timeline may sit a few microseconds off the
  recorded clock; a grammar due before the first step waits for its recorded time), so the same decisions
  follow;
- otherwise GRAMMAR_COMPILE_S after its admission, or a rejection at `structured_outputs_timeout` when that
  is shorter.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable

from testbed.engine.core import EngineCore
from testbed.engine.stepper import grammar_timeout_reason
from testbed.sim.cost_model import GRAMMAR_COMPILE_S

Event = tuple[float, str | None, int | None]  # (time, None or the failure's reason, recorded step index or None)


class SimGrammars:
    """Pending grammar outcomes of every replica, in heaps of (time, order, request id, Event)."""

    def __init__(self, engines: list[EngineCore], recorded: dict[str, tuple] | None = None,
                 steps_taken: Callable[[], int] | None = None, compile_s: float = GRAMMAR_COMPILE_S) -> None:
        """`recorded`: request id -> (time, error, step index) of a recorded run; `steps_taken`: the steps the
        replayed timeline has scheduled so far (the recorded cost model's counter)."""
        self.engines = engines
        self.recorded = recorded or {}
        self.steps_taken = steps_taken or (lambda: 0)
        self.compile_s = compile_s
        self.pending: list[list[tuple[float, int, str, Event]]] = [[] for _ in engines]
        self._order = itertools.count()
        for e in engines:
            e.compile_grammars = True

    def submit(self, replica: int, now: float) -> list[float]:
        """Take the replica's newly queued grammars; the times their outcomes are due (to wake it then)."""
        eng = self.engines[replica]
        timeout = eng.config.structured_outputs_timeout
        due = []
        for req in eng.take_new_grammars():
            event: Event | None = self.recorded.get(req.request_id)
            if event is None:
                event = ((now + self.compile_s, None, None) if self.compile_s <= timeout
                         else (now + timeout, grammar_timeout_reason(timeout), None))
            t = max(event[0], now)
            heapq.heappush(self.pending[replica], (t, next(self._order), req.request_id, event))
            due.append(t)
        return due

    def _due(self, event: Event, t: float, now: float) -> bool:
        step = event[2]
        if step is None or step == 0:
            return t <= now
        return self.steps_taken() >= step

    def apply(self, replica: int, now: float) -> None:
        """Mark ready (or reject) the replica's requests whose grammar outcome is due."""
        pending, eng = self.pending[replica], self.engines[replica]
        while pending and self._due(pending[0][3], pending[0][0], now):
            _, _, rid, (_, error, _) = heapq.heappop(pending)
            if error is None:
                eng.mark_grammar_ready(rid, now)
            else:
                eng.fail_grammar(rid, error, now)

    def next_due(self, replica: int) -> float:
        """When the replica's next grammar outcome is due (inf: none pending)."""
        pending = self.pending[replica]
        return pending[0][0] if pending else math.inf

    def steps_until_due(self, replica: int) -> int | None:
        """Steps the replica may take before a recorded outcome is due (None: no recorded one pending)."""
        pending = self.pending[replica]
        if not pending or not pending[0][3][2]:
            return None
        return max(0, pending[0][3][2] - self.steps_taken())
