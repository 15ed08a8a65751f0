"""Timing one synthetic step on a real executor: StepTiming medians (sync), the pipelined cycle (async
scheduling), and the device time inside the attention modules (forward hooks, the step run eagerly)."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from testbed.worker.timing import StepTiming

TIMING_FIELDS = tuple(StepTiming.__dataclass_fields__)
CYCLES_PER_S = 1.98e9  # H100/H200 SM boost clock: converts the device sleep to seconds (roughly; it only sizes it)
ASYNC_TIMING = "steady"  # how a profile times async cycles (StepMeasurer.async_cycle), recorded in it
ASYNC_FILL = 3  # async completions not timed while the pipeline fills (StepMeasurer.async_completions)
SLEEP_CYCLES = 2_000_000  # about 1 ms, over the 0.1-0.5 ms the host takes to issue one eager attention module
# (the untimed run before the timed ones takes the kernels' first-call compiles out of the measurement)


class AttentionTimer:
    """Forward hooks on the model's attention modules (rope + KV store + attention) that time them on the
    device; only eager steps run them (a graph replay runs no hooks).

    On CUDA an eager module is host-bound for small steps: its kernels start as the host issues them, so events
    around it would time the host's issue, not the device (a 16-token chunk's attention came out longer than the
    whole graphed forward). So the pre-hook first queues a device sleep longer than the host takes to issue the
    module: the module's kernels are all queued behind it, and the events time them back to back. The sleep is
    fixed (an adaptive one grew without bound on the host's first-call kernel compiles); a timed module whose
    issue outlasted it is counted in `overruns`, which the profile records."""

    def __init__(self, model, device: torch.device) -> None:
        self.layers = model.attention_layers()
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.overruns = 0
        self._issued = 0.0

    def _start(self, *_):
        if self.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
            self._issued = time.perf_counter()
        self._stamp()

    def _end(self, *_):
        self._stamp()
        if self.cuda and time.perf_counter() - self._issued > SLEEP_CYCLES / CYCLES_PER_S:
            self.overruns += 1  # the host outran the sleep: this module's time may hold an issue gap

    def _stamp(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    @contextmanager
    def installed(self) -> Iterator["AttentionTimer"]:
        handles = [h for a in self.layers for h in (a.register_forward_pre_hook(self._start),
                                                    a.register_forward_hook(self._end))]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def take(self) -> float:
        """Seconds inside attention since the last take (the step must have been waited for)."""
        m, self.marks = self.marks, []
        pairs = zip(m[0::2], m[1::2])
        return sum(a.elapsed_time(b) / 1e3 for a, b in pairs) if self.cuda else sum(b - a for a, b in pairs)


def _median_timing(timings: list[StepTiming]) -> dict[str, float]:
    return {f: statistics.median(getattr(t, f) for t in timings) for f in TIMING_FIELDS}


class StepMeasurer:
    """Runs synthetic steps on an executor (anything with `execute`, and `runner` for timing) and times them:
    `warmup` untimed runs, then the median of `reps` timed ones."""

    def __init__(self, executor, reps: int, warmup: int) -> None:
        self.executor = executor
        self.runner = executor.runner
        self.runner.record_timing = True
        self.reps, self.warmup = reps, warmup
        self.attention = AttentionTimer(self.runner.model, self.runner.device)
        self.can_async = hasattr(executor, "execute_async")

    def sync(self, so) -> dict[str, float]:
        """The step's StepTiming medians: `warmup` untimed runs, then `reps` timed ones, the step alone."""
        return self.sync_each([so])[0]

    def sync_each(self, sos: list) -> list[dict[str, float]]:
        """`sync` of several steps measured interleaved: each step's warm-up runs, then `reps` rounds of one run of
        every step in turn; each step's medians. The other way to time steps a serving loop runs back to back
        (benchmarks/quick_anchors.py compares the two)."""
        for so in sos:
            for _ in range(self.warmup):
                self.executor.execute(so)
        runs: list[list] = [[] for _ in sos]
        for _ in range(self.reps):
            for i, so in enumerate(sos):
                runs[i].append(self.executor.execute(so).timing)
        return [_median_timing(t) for t in runs]

    def attention_s(self, so) -> float:
        """Median device time inside the attention modules over `reps` runs of the step forced eager (a graph
        replay runs no hooks; the attention kernels are the same ones the graph replays)."""
        runner = self.runner
        with self.attention.installed():
            times = []
            runner.eager_steps = True
            try:
                self.executor.execute(so)  # untimed: sizes the device sleep (AttentionTimer) before the timed runs
                for _ in range(self.reps):
                    self.attention.take()
                    self.executor.execute(so)
                    times.append(self.attention.take())
            finally:
                runner.eager_steps = False
        return statistics.median(times)

    def async_cycle(self, so, timing: str = ASYNC_TIMING) -> float | None:
        """Seconds per step when the same step is launched back to back with one in flight (async scheduling).
        `timing` "steady" (profiles' way since 680360e, which they record as `async_timing`): in steady state, the
        median interval between successive completions (async_completions), as the sync timings are medians.
        "burst" (profiles before it, which record none; `--quick` times its anchors the way its base was): the mean
        over one short burst of max(4, 2 * reps) launches, its pipeline's fill and drain inside it, 1.5-4.5% above
        the steady way on an H200 (benchmarks/async_cycles.py)."""
        if timing == "burst":
            return self._burst_cycle(so)
        if timing != "steady":
            raise ValueError(f"unknown async cycle timing {timing!r}; expected steady or burst")
        done = self.async_completions(so)
        return None if done is None else statistics.median(b - a for a, b in zip(done, done[1:]))

    def _burst_cycle(self, so) -> float | None:
        if not self.can_async:
            return None
        ex = self.executor
        self.runner.record_timing = False
        try:
            n = max(4, 2 * self.reps)
            ex.execute_async(so)()
            t0 = time.perf_counter()
            pending = ex.execute_async(so)
            for _ in range(n - 1):
                nxt = ex.execute_async(so)
                pending()
                pending = nxt
            pending()
            return (time.perf_counter() - t0) / n
        finally:
            self.runner.record_timing = True

    def async_completions(self, so, n: int | None = None) -> list[float] | None:
        """perf_counter() as each of n + 1 (default max(20, 4 * reps) + 1) launches of `so` back to back, one always
        in flight, is waited for, once the pipeline is full: ASYNC_FILL completions before them are left out (the
        first launch's preparation overlaps nothing), and the last launch's drain is after them. None without an
        async executor."""
        if not self.can_async:
            return None
        ex = self.executor
        n = max(20, 4 * self.reps) if n is None else n
        self.runner.record_timing = False
        try:
            done = []
            pending = ex.execute_async(so)
            for _ in range(ASYNC_FILL + n + 1):
                nxt = ex.execute_async(so)
                pending()
                done.append(time.perf_counter())
                pending = nxt
            pending()
            return done[ASYNC_FILL:]
        finally:
            self.runner.record_timing = True
