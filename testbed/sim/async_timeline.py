"""A recorded `--async-scheduling` run's timeline, replayed call for call: decision parity for async runs.

With async scheduling the real loop (engine/stepper.py) schedules step k+1 while step k runs on the device and
updates step k after that. A run's steps.parquet records when each step was scheduled (`scheduled`), when it
began on the device (`start`: the update of the step before it, if that came later) and how long it took from
then to its update (`duration`). A replay schedules every step at its recorded `scheduled` time, with the arrivals
the real loop had taken in by then, and updates it at start + duration, so the core sees the calls the real one
saw, in the same order, with the same arrivals between them. Where the real loop updated the step in flight
before it scheduled the next one, its schedule there found nothing to run: the replay calls schedule there with
nothing newly admitted, and a batch formed there is a divergence, as is a recorded step the replay cannot form.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator, Sequence

if TYPE_CHECKING:  # the cost models import this module; only the replicas' loops run on simpy
    import simpy

SCHEDULED_SINCE = "3b145d3"  # the first commit whose async runs record `scheduled`


class AsyncTimeline:
    """One replica's recorded async timeline. Invariant: steps are scheduled and updated in recorded order, each
    once; `next_schedule` decides where the replica's next schedule call goes, `formed` checks each batch."""

    def __init__(self, scheduled: Sequence[float], starts: Sequence[float], durations: Sequence[float]) -> None:
        if not len(scheduled) == len(starts) == len(durations):
            raise ValueError("a recorded async timeline needs one schedule time, start and duration per step")
        self.scheduled = list(scheduled)
        self.updates = [s + d for s, d in zip(starts, durations)]  # when the real loop updated each step
        self.num_scheduled = 0  # steps the replay has scheduled
        self.num_updated = 0    # steps the replay has updated
        self.batch_due = False  # whether the real loop formed a batch at the schedule call being made

    def next_schedule(self, busy: bool, now: float) -> float | None:
        """When the replica calls schedule next (`busy`: a step is in flight): the next step's recorded time where the
        real loop scheduled it then (nothing in flight, or before the step in flight was updated); `now` where the
        real loop's schedule found nothing and it updated the step in flight; None once every step ran and none is
        in flight."""
        n = self.num_scheduled
        self.batch_due = n < len(self.scheduled) and (not busy or self.scheduled[n] <= self.updates[n - 1])
        if self.batch_due:
            return max(now, self.scheduled[n])
        return now if busy else None

    def formed(self, where: str) -> int:
        """The replay formed a batch; its index (RuntimeError where the real loop formed none: `where` names the
        replica and time for the message)."""
        n = self.num_scheduled
        if not self.batch_due:
            raise RuntimeError(f"the simulation diverged from the recorded async run: {where} it formed a batch where "
                               f"the real loop's schedule found nothing (after its step {n - 1}) (different trace, "
                               "flags or cache size?)")
        self.num_scheduled += 1
        self.batch_due = False
        return n

    def update_time(self) -> float:
        """When the step in flight (the oldest not updated) was updated in the real run."""
        return self.updates[self.num_updated]


class OnTimeline:
    """The ReplicaLoop hooks (sim/replica.py) a replica on a recorded async timeline shares, whichever driver runs it
    (one engine, or DP replicas): it waits for each recorded schedule time, and lands each update on the recorded
    one. Mixed in before the driver's loop class; `self.timeline` is the replica's AsyncTimeline."""

    timeline: AsyncTimeline

    def next_call(self, busy: bool) -> Generator[simpy.Event, object, float | None]:
        """Wait until the replica's next schedule call (AsyncTimeline.next_schedule); its time, or None."""
        t = self.timeline.next_schedule(busy, self.env.now)
        if t is not None and t > self.env.now:
            yield self.env.timeout_at(t)
        return t

    def nothing_formed(self) -> str:
        n = self.timeline.num_scheduled
        return (f"the real loop of replica {self.r} formed step {n} at {self.timeline.scheduled[n]:.6f} s; the "
                f"simulated one has nothing to schedule then ({len(self.eng.requests)} requests live)")

    def wait_end(self, start: float, duration: float) -> simpy.Event:
        return self.env.timeout_at(max(self.env.now, self.timeline.update_time()))

    def updated(self, so, finished: list, busy: bool) -> None:
        self.timeline.num_updated += 1
        super().updated(so, finished, busy)


def replayable(run) -> bool:
    """Whether a recorded replay can follow `run` (a read run directory): a sync run, or an async one whose steps
    record when each was scheduled."""
    return not run.manifest.get("config", {}).get("async_scheduling") or "scheduled" in run.step_column_names()


def missing_scheduled(path) -> ValueError:
    """The error for an async run recorded before steps.parquet held each step's schedule time."""
    return ValueError(f"{path}: this --async-scheduling run was recorded before steps.parquet held when each step was "
                      f"scheduled (the `scheduled` column, from {SCHEDULED_SINCE}), which a recorded replay of an async "
                      "run needs; record it again with this version, or simulate it with a profile")
