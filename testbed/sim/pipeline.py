"""Pipeline parallelism in the simulator: each batch's way through the stages, and the bubbles between them.

The schedule is real mode's (engine/stepper.py, vLLM V1's batch queue), which sim/cluster.py replays call for call:
a batch is scheduled and launched; while fewer than P = pipeline_parallel_size batches are in flight the next one
is scheduled at once (of requests in no in-flight batch); when P are in flight, or nothing more is schedulable, the
oldest is waited for and updated. Only one in-flight batch holds a request, so how full the pipeline gets depends on
the requests: their cohorts (admitted while the others were in flight) alternate between the batches.

A batch's cost (PipelineCostModel) is cut from a one-stage cost model's split of the same step (`pipeline_split`
of the profile or roofline at the run's TP, which sums to its step time: host, decoder layers, LM head):

    host        the driver's host work for the batch: engine, input preparation, readback
    stage s     layers * n_s / L + (LM head, on the last stage)        n_s: the stage's layers (specs/partition.py)
    transfer    p2p_latency_s + 2 * T * hidden_size * dtype_bytes / p2p_bandwidth, before every stage but the first
                (the hidden states and the residual stream of the step's T tokens; with TP, each rank sends its own
                copy over its own link, at the same time)

The resources host, stage 0, ..., stage P-1 each hold one batch at a time, in launch order: a batch enters resource
r once it left resource r-1 and r is done with the batch before it,

    enter[r] = max(leave[r-1], free[r]),   leave[r] = enter[r] + time[r],   free[r] = leave[r]

(leave[-1] = the batch's launch), and it is done, read back and updated, when it leaves the last stage. Alone, a
batch takes host + the sum of the stages and P-1 transfers; a full pipeline finishes one batch per max(host, the
slowest stage with its transfer). Bubbles are the time a stage waits (free[r] < leave[r-1]): while the pipeline
fills, and whenever fewer than P batches are in flight.

The transfer is the GPU preset's send/recv where `benchmarks/pp.py` measured one (H100: 42.2 us + bytes / 380.5
GB/s over NVLink between two GPUs of one host), else its all-reduce link (H200: the bandwidth and latency
benchmarks/tp.py measured for the all-reduce over NVLink); `p2p_bandwidth` / `p2p_latency_s` override both.
"""
from __future__ import annotations

import copy
import math

from testbed.engine.outputs import SchedulerOutput
from testbed.specs.hardware import GPUSpec
from testbed.specs.partition import pp_partition
from testbed.specs.presets import ModelSpec


class PipelineCostModel:
    """The stages of one replica as resources (module docstring); `launch(so, now)` places a batch and gives the
    time it is done. `step_time(so)` is a lone batch's time (what an emulated or single-step caller needs)."""

    def __init__(self, base, model: ModelSpec, gpu: GPUSpec, pipeline_parallel_size: int, dtype_bytes: int = 2,
                 p2p_bandwidth: float | None = None, p2p_latency_s: float | None = None) -> None:
        if not hasattr(base, "pipeline_split"):
            raise ValueError(f"{type(base).__name__} cannot be split into pipeline stages (it has no per-layer share);"
                             " use the roofline or a profile")
        self.base, self.pp = base, pipeline_parallel_size
        self.parts = pp_partition(model.num_hidden_layers, pipeline_parallel_size)
        self.shares = [n / model.num_hidden_layers for n in self.parts]
        bw = next(x for x in (p2p_bandwidth, gpu.p2p_bandwidth, gpu.interconnect_bandwidth) if x is not None)
        lat = next(x for x in (p2p_latency_s, gpu.p2p_latency_s, gpu.allreduce_latency_s) if x is not None)
        if not bw > 0 or not lat >= 0:
            raise ValueError(f"p2p_bandwidth must be > 0 and p2p_latency_s >= 0, got {bw}, {lat}")
        self.p2p_latency_s, self.p2p_bandwidth = lat, bw
        self._bytes_per_token = 2 * model.hidden_size * dtype_bytes
        self.free = [0.0] * (pipeline_parallel_size + 1)  # host, then each stage: when it is done with its last batch
        self.async_scheduling = False

    def for_replica(self) -> "PipelineCostModel":
        """The same model over stages of their own (each data-parallel replica has its GPUs)."""
        twin = copy.copy(self)
        twin.free = [0.0] * (self.pp + 1)
        return twin

    def transfer_time(self, so: SchedulerOutput) -> float:
        """One stage-to-stage send of the step's activations."""
        return self.p2p_latency_s + so.total_num_scheduled_tokens * self._bytes_per_token / self.p2p_bandwidth

    def resource_times(self, so: SchedulerOutput) -> list[float]:
        """[host, stage 0, ..., stage P-1] busy times of the batch (transfers included in the receiving stage)."""
        host, layers, head = self.base.pipeline_split(so)
        p2p = self.transfer_time(so)
        times = [host] + [layers * share + (p2p if s else 0.0) for s, share in enumerate(self.shares)]
        times[-1] += head
        return times

    def step_time(self, so: SchedulerOutput) -> float:
        if not so.requests:
            return 0.0
        return sum(self.resource_times(so))

    def launch(self, so: SchedulerOutput, now: float) -> float:
        """Place a batch launched at `now` on the resources; the time it leaves the last stage."""
        t = now
        free = self.free
        for r, busy in enumerate(self.resource_times(so)):
            t = (t if t > free[r] else free[r]) + busy
            free[r] = t
        return t

    def next_launch(self, now: float, in_flight: bool = False) -> float:
        """When the next batch is scheduled, given that the engine could schedule it at `now`: at once."""
        return now

    def to_json(self) -> dict:
        return {"kind": "pipeline", "pipeline_parallel_size": self.pp, "stages": self.parts,
                "p2p_bandwidth": self.p2p_bandwidth, "p2p_latency_s": self.p2p_latency_s,
                "base": self.base.to_json() if hasattr(self.base, "to_json") else type(self.base).__name__}


class RecordedPipeline:
    """Decision parity for a pipeline-parallel real run: its batches are scheduled when the real ones were and are
    done when the real ones were updated (its steps.parquet: start = scheduled, start + duration = updated). The
    cluster then makes the core's calls in the real order: the next schedule at its recorded time, unless the
    oldest batch in flight was updated before it (or P are in flight)."""

    def __init__(self, starts: list[float], durations: list[float], pipeline_parallel_size: int) -> None:
        if not starts or len(starts) != len(durations):
            raise ValueError("a recorded timeline needs one start and one duration per step (and at least one step)")
        self.starts, self.ends = starts, [a + d for a, d in zip(starts, durations)]
        self.pp = pipeline_parallel_size
        self.step = 0
        self.grammar_events: dict[str, tuple[float, str | None, int]] = {}  # sim/grammars.py replays them

    def _check(self) -> None:
        if self.step >= len(self.starts):
            raise RuntimeError(f"the simulation needs more than the {len(self.starts)} recorded steps: its decisions "
                               "diverged from the recorded run (different trace, flags or cache size?)")

    @classmethod
    def from_run_dir(cls, path, pipeline_parallel_size: int) -> "RecordedPipeline":
        import pandas as pd
        from pathlib import Path
        steps = pd.read_parquet(Path(path) / "steps.parquet", columns=["replica", "start", "duration"])
        if steps["replica"].nunique() > 1:
            raise ValueError(f"{path}: recorded timelines replay one replica; this run has {steps['replica'].nunique()}")
        from testbed.sim.cost_model import recorded_grammar_events
        model = cls(steps["start"].tolist(), steps["duration"].tolist(), pipeline_parallel_size)
        model.grammar_events = recorded_grammar_events(path, model.starts)
        return model

    def next_launch(self, now: float, in_flight: bool = False) -> float:
        """When the real run scheduled its next batch (never before `now`); after its last one, infinity while
        batches are in flight (they are updated first), else the divergence error."""
        if self.step >= len(self.starts) and in_flight:
            return math.inf
        self._check()
        return max(now, self.starts[self.step])

    def launch(self, so: SchedulerOutput, now: float) -> float:
        self._check()
        end = self.ends[self.step]
        self.step += 1
        return max(now, end)

    def step_time(self, so: SchedulerOutput) -> float:
        return 0.0  # unused: launch gives the end

    def for_replica(self) -> "RecordedPipeline":
        return self  # one replica's timeline
