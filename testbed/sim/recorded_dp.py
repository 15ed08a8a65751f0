"""Decision parity for data parallelism: replay a real DP run's timings, recompute its decisions.

A real DP run directory records when each replica scheduled and updated every step (steps.parquet),
when the coordinator routed each request and when its replica admitted it (routes.parquet), and when
each replica sampled a stats report and the coordinator took it (publications.parquet), with the
coordinator's event order (`seq`), and, with structured outputs, when each grammar was ready
(grammars.parquet: applied before the first step at or after that time, as the real replica did). Here the same EngineCores and the same DPCoordinator run on
exactly those times: the coordinator takes reports and routes requests in the recorded order, each
request is admitted at its recorded time (or by a step starting at that very instant), and each
replica schedules every step at its recorded start. Only timing is replayed; every decision (the
replica of a request, each batch, the stats each report carries) is computed again, and the first
one that differs from the record stops the run with a RuntimeError that names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typing import Callable, Generator

import simpy

from testbed.engine.block_manager import prompt_block_hashes
from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import DPCoordinator
from testbed.engine.core import EngineCore
from testbed.engine.metrics import Recorder
from testbed.engine.outputs import SchedulerOutput
from testbed.workload.lora import trace_loras
from testbed.sim.async_timeline import AsyncTimeline, OnTimeline, missing_scheduled, replayable
from testbed.sim.trace_requests import SimResult, trace_to_request
from testbed.sim.collector import collector_paused
from testbed.sim.cost_model import recorded_grammar_events
from testbed.sim.environment import SimEnvironment
from testbed.sim.executor import SimExecutor
from testbed.sim.grammars import SimGrammars
from testbed.sim.replica import ReplicaLoop
from testbed.workload.trace import TraceRequest

# report fields a replica's state determines exactly (kv_usage follows from the block counts)
CHECKED_STATS = ("num_waiting", "num_running", "num_free_blocks", "num_blocks", "num_waiting_tokens", "num_added")


StepHook = Callable[[int, int, SchedulerOutput], None]  # (replica, its step index, the batch)


class _Durations:
    """One replica's recorded step durations, in order (its cost model in this replay); `on_step` sees each batch;
    `timeline`: an async run's (each batch checked against it)."""

    def __init__(self, r: int, durations: list[float], on_step: StepHook | None = None,
                 timeline: AsyncTimeline | None = None) -> None:
        self.r, self.durations, self.on_step, self.k, self.timeline = r, durations, on_step, 0, timeline

    def step_time(self, so: SchedulerOutput) -> float:
        if self.timeline is not None:
            self.timeline.formed(f"replica {self.r}, step {self.k}:")
        if self.on_step is not None:
            self.on_step(self.r, self.k, so)
        d = self.durations[self.k]
        self.k += 1
        return d


class RecordedReplica(ReplicaLoop):
    """A replica on its recorded timeline: step k is scheduled at the recorded start (after admitting what had
    reached it by then) and updated `duration` later; a step the simulated replica cannot schedule is a
    divergence."""

    def __init__(self, env: SimEnvironment, eng: EngineCore, r: int, executor: SimExecutor, grammars: SimGrammars,
                 starts: list[float], admit: Callable[[float], None], report: Callable[[int], None]) -> None:
        super().__init__(env, eng, r, executor, grammars)
        self.starts, self.admit, self.report, self.k = starts, admit, report, 0

    def ready(self, busy: bool) -> Generator[simpy.Event, object, float | None]:
        if self.k == len(self.starts):
            return None
        start = self.starts[self.k]
        if start > self.env.now:
            yield self.env.timeout(start - self.env.now)
        self.admit(start)  # one admitted at this very instant counts as before the step, as in the real loop
        return start

    def stalled(self) -> Generator[simpy.Event, object, None]:
        raise _diverged(f"replica {self.r} ran step {self.k} at {self.starts[self.k]:.6f} s; the simulated one has "
                        f"nothing to schedule ({len(self.eng.requests)} requests live)")
        yield  # a generator

    def wait_end(self, start: float, duration: float) -> simpy.Event:
        return self.env.timeout(duration)

    def updated(self, so: SchedulerOutput, finished: list, busy: bool) -> None:
        self.k += 1
        self.report(self.k)


class RecordedAsyncReplica(OnTimeline, RecordedReplica):
    """A replica of an `--async-scheduling` DP run on its recorded timeline (sim/async_timeline.py): each schedule
    call when the real loop made it (after admitting what had reached the replica by then), each update when the
    real loop made it, its reports after each update as recorded."""

    def __init__(self, env: SimEnvironment, eng: EngineCore, r: int, executor: SimExecutor, grammars: SimGrammars,
                 timeline: AsyncTimeline, admit: Callable[[float], None], report: Callable[[int], None]) -> None:
        super().__init__(env, eng, r, executor, grammars, timeline.scheduled, admit, report)
        self.overlap, self.timeline = True, timeline

    def ready(self, busy: bool) -> Generator[simpy.Event, object, float | None]:
        t = yield from self.next_call(busy)
        if t is not None:
            self.admit(t)
        return t

    def stalled(self) -> Generator[simpy.Event, object, None]:
        raise _diverged(self.nothing_formed())
        yield  # a generator


@dataclass
class RecordedDPRun:
    """The timings of a real data-parallel run (see the module docstring)."""

    path: str
    policy: str
    starts: list[list[float]]       # per replica, step k's schedule time
    durations: list[list[float]]    # per replica, schedule -> update of step k
    routes: list[dict]              # ROUTE_COLUMNS rows in seq order
    publications: list[dict]        # PUBLICATION_COLUMNS rows in seq order
    grammars: dict[str, tuple] | None = None  # request id -> (ready time, None or why it failed, None)
    scheduled: list[list[float]] | None = None  # an async run's: per replica, when step k was scheduled

    @property
    def num_replicas(self) -> int:
        return len(self.starts)

    @staticmethod
    def is_dp_run(path) -> bool:
        """A run with the coordinator's record, or with steps of several replicas."""
        import pandas as pd
        p = Path(path)
        if (p / "routes.parquet").is_file():
            return True
        steps = p / "steps.parquet"
        return steps.is_file() and pd.read_parquet(steps, columns=["replica"])["replica"].nunique() > 1

    @classmethod
    def from_run_dir(cls, path) -> "RecordedDPRun":
        from testbed.runs.rundir import read_run
        run = read_run(path)
        routes, pubs = run.dp_table("routes"), run.dp_table("publications")
        if routes is None or pubs is None:
            raise ValueError(f"{path}: a data-parallel run without routes.parquet / publications.parquet; record it "
                             "with `testbed replay --data-parallel-size N` (which writes the coordinator's record)")
        cfg = run.manifest.get("config", {})
        overlapped = bool(cfg.get("async_scheduling"))
        dp = int(cfg.get("data_parallel_size", 0))
        if not replayable(run):
            raise missing_scheduled(path)
        steps = run.steps(columns=["replica", "start", "duration", *(["scheduled"] if overlapped else [])])
        if dp < 2 or not steps["replica"].between(0, dp - 1).all():
            raise ValueError(f"{path}: manifest says data_parallel_size={dp} but steps name replicas "
                             f"{sorted(steps['replica'].unique())}")
        by = [steps[steps["replica"] == r] for r in range(dp)]
        grammars = recorded_grammar_events(path) or None
        return cls(str(path), cfg.get("dp_policy", ""), [s["start"].tolist() for s in by],
                   [s["duration"].tolist() for s in by], routes.sort_values("seq").to_dict("records"),
                   pubs.sort_values("seq").to_dict("records"), grammars,
                   [s["scheduled"].tolist() for s in by] if overlapped else None)


def _diverged(msg: str) -> RuntimeError:
    return RuntimeError(f"the simulation diverged from the recorded data-parallel run: {msg} (different trace, "
                        "flags or cache size? or a decision that depends on something the record does not hold)")


@collector_paused()
def simulate_recorded_dp(trace: list[TraceRequest], config: EngineConfig, rec: RecordedDPRun, num_gpu_blocks: int,
                         max_model_len: int, vocab_size: int, num_cpu_blocks: int | None = None,
                         on_step: StepHook | None = None):
    """Run `trace` through DP replicas on the recorded timings (SimResult, as cluster.simulate); `on_step(r, k, so)`
    is called with every batch `so`, replica r's step k, as it is executed (calibrate pairs it with the record)."""
    dp = config.data_parallel_size
    if dp != rec.num_replicas:
        raise ValueError(f"--data-parallel-size {dp}, but {rec.path} recorded {rec.num_replicas} replicas; use "
                         f"{rec.num_replicas}")
    if rec.policy and config.dp_policy != rec.policy:
        raise ValueError(f"--dp-policy {config.dp_policy}, but {rec.path} routed with {rec.policy}; use {rec.policy}")
    by_id = {tr.id: tr for tr in trace}
    loras = trace_loras([tr.lora for tr in trace], config)
    missing = [r["request_id"] for r in rec.routes if r["request_id"] not in by_id]
    if missing or len(rec.routes) != len(trace):
        raise ValueError(f"{rec.path} routed {len(rec.routes)} requests, the trace has {len(trace)}"
                         + (f" (e.g. {missing[0]!r} is not in it)" if missing else "") + "; replay the same trace")
    env = SimEnvironment()
    engines = [EngineCore(config, num_gpu_blocks, max_model_len, replica=r, stream_outputs=False,
                          num_cpu_blocks=num_cpu_blocks) for r in range(dp)]
    timelines = ([AsyncTimeline(*parts) for parts in zip(rec.scheduled, rec.starts, rec.durations)]
                 if rec.scheduled is not None else [None] * dp)
    executors = [SimExecutor(_Durations(r, d, on_step, timelines[r])) for r, d in enumerate(rec.durations)]
    grammars = SimGrammars(engines, rec.grammars)
    coord = DPCoordinator(dp, config.dp_policy, config.block_size, affinity_capacity_blocks=num_gpu_blocks,
                          lora_capacity=config.max_cpu_loras)
    inbox: list[list] = [[] for _ in range(dp)]   # (added, request) routed to each replica, in order
    reports: list[list] = [[] for _ in range(dp)]  # stats each replica reported, in order
    taken = [0] * dp
    pub_points = [[p for p in rec.publications if p["replica"] == r] for r in range(dp)]
    records = Recorder()
    need_hashes = config.dp_policy == "prefix_affinity"

    def report(r: int, steps_done: int) -> None:
        """Every report replica r sampled after `steps_done` steps, checked against the record."""
        while len(reports[r]) < len(pub_points[r]) and pub_points[r][len(reports[r])]["steps"] == steps_done:
            p = pub_points[r][len(reports[r])]
            stats = engines[r].stats()
            for f in CHECKED_STATS:
                if getattr(stats, f) != p[f]:
                    raise _diverged(f"replica {r}'s report after {steps_done} steps has {f}={getattr(stats, f)}, "
                                    f"the real one {p[f]}")
            reports[r].append(stats)
            records.publications.append((p["seq"], r, steps_done, env.now, p["received"], stats.num_waiting,
                                         stats.num_running, stats.kv_usage, stats.num_free_blocks, stats.num_blocks,
                                         stats.num_waiting_tokens, stats.num_added))

    def admit(r: int, until: float) -> None:
        box = inbox[r]
        while box and box[0][0] <= until:
            added, req = box.pop(0)
            engines[r].add_request(req, added)
            grammars.submit(r, added)

    def coordinator():
        events = sorted([(p["seq"], p["received"], "report", p) for p in rec.publications]
                        + [(x["seq"], x["routed"], "route", x) for x in rec.routes], key=lambda e: e[0])
        for _, t, kind, x in events:
            if t > env.now:
                yield env.timeout(t - env.now)
            r = int(x["replica"])
            if kind == "report":
                if taken[r] >= len(reports[r]):
                    raise _diverged(f"the coordinator took replica {r}'s report #{taken[r]} at {t:.6f} s, which the "
                                    "simulated replica had not sent by then")
                coord.update_stats(r, reports[r][taken[r]])
                taken[r] += 1
                continue
            req = trace_to_request(by_id[x["request_id"]], vocab_size, config.seed, loras)
            hashes = ()
            if need_hashes:
                hashes = req.block_hashes = prompt_block_hashes(req.prompt_token_ids, config.block_size)
            chosen = coord.route(req.num_prompt_tokens, hashes,
                                 0 if req.lora_request is None else req.lora_request.lora_int_id)
            if chosen != r:
                raise _diverged(f"request {req.request_id!r} (event {x['seq']}) went to replica {r}, the simulated "
                                f"coordinator ({config.dp_policy}) picks {chosen}")
            inbox[r].append((x["added"], req))
            env.timeout(max(0.0, x["added"] - env.now)).callbacks.append(lambda _, r=r: admit(r, env.now))
            records.routes.append((x["seq"], req.request_id, r, x["arrival"], x["sent"], env.now, x["added"]))

    for r in range(dp):
        report(r, 0)  # the reports the replicas sent when they came up
    env.process(coordinator())
    for r in range(dp):
        admit_r, report_r = (lambda until, r=r: admit(r, until)), (lambda k, r=r: report(r, k))
        replica = (RecordedReplica(env, engines[r], r, executors[r], grammars, rec.starts[r], admit_r, report_r)
                   if timelines[r] is None else
                   RecordedAsyncReplica(env, engines[r], r, executors[r], grammars, timelines[r], admit_r, report_r))
        env.process(replica.run())
    env.run()
    for r in range(dp):
        admit(r, float("inf"))  # what reached a replica after its last step (rejections finish at once)
        if engines[r].requests:
            raise _diverged(f"replica {r} still holds {len(engines[r].requests)} requests after the real run's "
                            f"last step")
        if taken[r] != len(reports[r]) or len(reports[r]) != len(pub_points[r]):
            raise _diverged(f"replica {r} sent {len(reports[r])} reports, the real one {len(pub_points[r])}")
    return SimResult.collect(engines, records, env.now)
