"""Where one model-runner step's time goes: host stamps plus device events, for `testbed profile`.

A StepTimer follows the order of `ModelRunner.execute_async`: inputs prepared (host), forward
launched and run (device), LM head and sampler (device), launch done (host), device caught up
(host wait), outputs turned into lists (host). On a GPU the device parts are CUDA-event times; on
the CPU, where the forward runs synchronously, they are the host time of those calls.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Seconds. Host: prepare_s (flat inputs), launch_s (issuing the forward and sampler), wait_s (blocked on
    the device after launching), output_s (token lists). Device: forward_s (decoder), sample_s (LM head on the
    sampled rows + sampler). wall_s: the whole execute, as a caller of `execute` sees it."""

    prepare_s: float
    launch_s: float
    wait_s: float
    output_s: float
    forward_s: float
    sample_s: float
    wall_s: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else None
        self.stamps: list[float] = []

    def _stamp(self, event: int) -> None:
        self.stamps.append(time.perf_counter())
        if self.events is not None:
            self.events[event].record()

    def prepared(self, start: float) -> None:
        self.stamps.append(start)
        self._stamp(0)

    def mark(self) -> None:
        """The forward is launched (on the CPU: done)."""
        self._stamp(1)

    def launched(self) -> None:
        self._stamp(2)

    def synced(self) -> None:
        self.stamps.append(time.perf_counter())

    def result(self, end: float) -> StepTiming:
        start, prepared, marked, launched, synced = self.stamps
        if self.events is not None:
            self.events[2].synchronize()  # a step that sampled nothing was not waited for
            forward = self.events[0].elapsed_time(self.events[1]) / 1e3
            sample = self.events[1].elapsed_time(self.events[2]) / 1e3
        else:
            forward, sample = marked - prepared, launched - marked
        return StepTiming(prepared - start, launched - prepared, synced - launched, end - synced, forward, sample,
                          end - start)
