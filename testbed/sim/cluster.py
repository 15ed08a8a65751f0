"""SimPy cluster: an arrival process, the DP coordinator and one process per EngineCore replica.

Each replica runs the simulator's one step loop (replica.py: schedule -> cost model -> wait for the step's
end -> update), and sleeps on an event while it has no requests. The simulation ends when every trace request has arrived
and every replica is idle. Deterministic: no wall clock reaches the core or the records.

With data parallelism the cluster mirrors real DP serving: a request reaches the coordinator one
hop (half of `dp_routing_delay`) after its arrival and its replica one hop later; replicas report
their stats by the same StatsPublisher rule as real replicas, and a report reaches the coordinator
one hop after it was sampled. Routes and reports are recorded (routes / publications tables).
(`--cost-model recorded:RUN_DIR` of a DP run replays that run's own timings instead: recorded_dp.py.)

With pipeline parallelism a replica runs real mode's batch queue (engine/stepper.py) over a PipelineCostModel or
RecordedPipeline (sim/pipeline.py): up to P batches in flight, each through the stages in turn.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Generator, Iterator

import simpy

from testbed.engine.block_manager import prompt_block_hashes
from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import DPCoordinator, StatsPublisher
from testbed.engine.core import EngineCore
from testbed.engine.fast_forward import advance
from testbed.engine.metrics import Recorder
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.request import Request
from testbed.sim.async_timeline import AsyncTimeline, OnTimeline
from testbed.sim.collector import collector_paused
from testbed.sim.cost_model import CostModel
from testbed.sim.environment import SimEnvironment, landing
from testbed.sim.executor import SIM_TOKEN_ID, SimExecutor, add_beam_logprobs
from testbed.sim.grammars import SimGrammars
from testbed.sim.horizon import AdmissionHorizon
from testbed.sim.pipeline import PipelineCostModel
from testbed.sim.replica import ReplicaLoop
from testbed.sim.trace_requests import SimResult, trace_to_request
from testbed.workload.lora import trace_loras
from testbed.workload.trace import TraceRequest


class ClusterSim:
    """One simulation's shared state: the replicas' engines, the coordinator, the arrival process, the stats
    reports and the end condition (every request admitted and every replica idle)."""

    def __init__(self, trace: list[TraceRequest], config: EngineConfig, cost_model: CostModel, num_gpu_blocks: int,
                 max_model_len: int, vocab_size: int, num_cpu_blocks: int | None) -> None:
        self.trace, self.config, self.cost_model, self.vocab_size = trace, config, cost_model, vocab_size
        self.env = env = SimEnvironment()
        self.loras = trace_loras([tr.lora for tr in trace], config)
        self.dp = dp = config.data_parallel_size
        self.engines = [EngineCore(config, num_gpu_blocks, max_model_len, replica=r, stream_outputs=False,
                                   num_cpu_blocks=num_cpu_blocks) for r in range(dp)]
        self.coord = DPCoordinator(dp, config.dp_policy, config.block_size, affinity_capacity_blocks=num_gpu_blocks,
                                   lora_capacity=config.max_cpu_loras)
        self.executor = SimExecutor(cost_model)
        self.grammars = SimGrammars(self.engines, getattr(cost_model, "grammar_events", None),
                                    lambda: getattr(cost_model, "step", 0))
        self.wake = [env.event() for _ in range(dp)]
        self.done = env.event()
        self.admitted, self.seq = 0, 0
        self.idle = set(range(dp))
        self.hop = config.dp_routing_delay / 2 if dp > 1 else 0.0  # one ZMQ hop; dp 1 has no coordinator
        self.horizon = AdmissionHorizon([tr.arrival_s for tr in trace], self.hop, dp, config.dp_policy == "round_robin")
        self.publishers = [StatsPublisher(config.dp_stats_interval) for _ in range(dp)]
        self.steps_done = [0] * dp
        self.skipped = 0  # steps fast-forwarded
        self.decode_clocks: dict[tuple[int, int], Callable | None] = {}  # decode_ends', by (rows, structured rows)
        # stretches go on lazily where the next request's replica is not known in advance (a policy reading stats)
        self.lazy = dp > 1 and config.dp_policy != "round_robin"
        self.coasting: list[Generator | None] = [None] * dp  # a replica's lazy stretch, while it waits
        self.replicas: list[ServingReplica] = []
        self.routes: list[list] = []        # ROUTE_COLUMNS rows
        self.publications: list[list] = []  # PUBLICATION_COLUMNS rows

    def after_hop(self, fn: Callable, *args) -> None:
        if self.hop:
            self.env.timeout(self.hop).callbacks.append(lambda _: fn(*args))
        else:
            fn(*args)

    def wake_up(self, r: int) -> None:
        if not self.wake[r].triggered:
            self.wake[r].succeed()

    def finish_if_done(self) -> None:
        if self.admitted == len(self.trace) and len(self.idle) == self.dp and not self.done.triggered:
            self.done.succeed()

    def admit(self, r: int, req: Request, route: list | None) -> None:
        env = self.env
        self.horizon.admit(r)
        if route is not None:
            route[-1] = env.now
        self.admitted += 1
        if self.engines[r].add_request(req, env.now) is None:  # accepted; a rejection is recorded at once
            self.idle.discard(r)  # busy from now on, so the end check cannot fire before it wakes
            for t in self.grammars.submit(r, env.now):  # its grammar compiles meanwhile: wake the replica when due
                env.timeout_at(t).callbacks.append(lambda _: self.wake_up(r))
            self.wake_up(r)
        else:
            self.finish_if_done()

    def publish(self, r: int, transit: bool = True, at: float | None = None) -> None:
        """Replica r samples its stats now (or at `at`, a later time its stats are already those of: a report taken
        inside a fast-forwarded stretch); the coordinator takes them one hop later."""
        stats = self.engines[r].stats()
        row = [None, r, self.steps_done[r], self.env.now if at is None else at, None, stats.num_waiting,
               stats.num_running, stats.kv_usage, stats.num_free_blocks, stats.num_blocks, stats.num_waiting_tokens,
               stats.num_added]
        self.publications.append(row)

        def receive() -> None:
            row[0], row[4] = self.seq, self.env.now
            self.seq += 1
            self.coord.update_stats(r, stats)
        if at is not None:  # where a timeout made at `at` would land
            self.env.timeout_at(at + self.hop).callbacks.append(lambda _: receive())
        elif transit:
            self.after_hop(receive)
        else:
            receive()

    def arrivals(self) -> Generator[simpy.Event, object, None]:
        env, config, need_hashes = self.env, self.config, self.config.dp_policy == "prefix_affinity"
        for tr in self.trace:
            delay = tr.arrival_s + self.hop - env.now  # the coordinator sees it one hop after its arrival
            if delay > 0:
                yield env.timeout(delay)
            req = trace_to_request(tr, self.vocab_size, config.seed, self.loras)
            hashes = ()
            if need_hashes:
                hashes = req.block_hashes = prompt_block_hashes(req.prompt_token_ids, config.block_size)
            r = 0 if self.dp == 1 else self.coord.route(  # one replica: no coordinator, as in real mode
                req.num_prompt_tokens, hashes, 0 if req.lora_request is None else req.lora_request.lora_int_id)
            self.horizon.route(r)
            if self.coasting[r] is not None:
                self.replicas[r].cut()
            route = None
            if self.dp > 1:  # seq, request, replica, arrival, sent, routed, added (set on admission)
                route = [self.seq, req.request_id, r, tr.arrival_s, tr.arrival_s, env.now, None]
                self.routes.append(route)
                self.seq += 1
            self.after_hop(self.admit, r, req, route)

    def after_update(self, r: int, so: SchedulerOutput, finished: list, busy: bool) -> None:
        """Count an updated step; a DP replica reports its stats when the publisher says so."""
        self.steps_done[r] += 1
        if self.dp > 1 and self.publishers[r].after_update(
                self.env.now, bool(finished or so.new_req_ids or so.preempted_req_ids),
                idle=not self.engines[r].requests and not busy):
            self.publish(r)

    def step_end(self, so: SchedulerOutput, start: float) -> float:
        """When a step scheduled at `start` ends: where `yield env.timeout(start + d - env.now)` lands."""
        return landing(start, self.cost_model.step_time(so))

    def decode_ends(self, b: int, structured: int) -> Callable[[float, int, int], Iterator[float]] | None:
        """The ends of successive decode steps of b rows (`structured` under a grammar), each starting where the
        one before ended, from the first one's (start, sum_context_tokens, max_context_tokens): step_end's values
        for them, when the cost model prices such a batch without its SchedulerOutput (decode_steps)."""
        key = (b, structured)
        if key in self.decode_clocks:  # a pure function of the batch size: made once
            return self.decode_clocks[key]
        decode_steps = getattr(self.cost_model, "decode_steps", None)
        steps = decode_steps(b, structured) if decode_steps is not None else None
        ends = None if steps is None else (lambda start, sum_ctx, max_ctx: steps(sum_ctx, max_ctx, start))
        self.decode_clocks[key] = ends
        return ends

    def run(self, on_progress: Callable[[float, int], None] | None, progress_interval_s: float,
            fast_forward_decodes: bool) -> SimResult:
        env, dp = self.env, self.dp

        def progress():
            while True:
                yield env.timeout(progress_interval_s)
                on_progress(env.now, sum(len(e.records.requests) for e in self.engines))

        if dp > 1:
            for r in range(dp):  # the report each replica sends once it is up, long before the first request
                self.publish(r, transit=False)
        env.process(self.arrivals())
        timeline = getattr(self.cost_model, "async_timeline", None)  # a recorded async run's (one replica)
        for r in range(dp):
            replica = (PipelinedReplica(self, r) if self.config.pipeline_parallel_size > 1
                       else TimelineReplica(self, r, timeline) if timeline is not None
                       else ServingReplica(self, r, fast_forward_decodes))
            replica.process = env.process(replica.run())
            self.replicas.append(replica)
        if on_progress is not None:
            env.process(progress())
        if self.trace:
            env.run(until=self.done)
        # reports still on their way when the run ended never reached the coordinator: not recorded; the others in the
        # order they were received (that of their sampling, but for those sampled ahead inside a stretch)
        result = SimResult.collect(self.engines, Recorder(routes=[tuple(row) for row in self.routes], publications=sorted(
            (tuple(row) for row in self.publications if row[0] is not None), key=lambda row: row[0])), env.now)
        result.fast_forwarded_steps = self.skipped
        return result


class ServingReplica(ReplicaLoop):
    """A replica of a simulated deployment: it sleeps while it holds no request, fast-forwards stretches of
    decodes where that is exact (sync scheduling only), and waits for a compiling grammar when only such
    requests remain."""

    def __init__(self, sim: ClusterSim, r: int, fast_forward_decodes: bool = False) -> None:
        super().__init__(sim.env, sim.engines[r], r, sim.executor, sim.grammars, sim.config.async_scheduling)
        self.sim = sim
        self.skip = fast_forward_decodes and not self.overlap
        self.stretch_from = 0  # steps_done when the current stretch began
        # a recorded timeline's first step starts where the real one did (not at the first arrival): its cycles, and
        # so every later step, then start where the real ones did, with the same requests arrived by then
        self.start_at: float | None = getattr(sim.cost_model, "first_start", None)
        self.process: simpy.Process | None = None  # this loop's, once started
        self.cut_stretch: tuple = ()  # (steps, end, finished, the event at its end) of a stretch `cut` ended

    def ready(self, busy: bool) -> Generator[simpy.Event, object, float]:
        sim, r = self.sim, self.r
        if not self.eng.requests and not busy:
            sim.idle.add(r)
            sim.finish_if_done()
            wake = sim.wake[r] = self.env.event()
            yield wake
            sim.idle.discard(r)
        if self.start_at is not None:
            t, self.start_at = self.start_at, None
            if t > self.env.now:
                yield self.env.timeout_at(t)
        return self.env.now

    def fast_forward(self) -> Generator[simpy.Event, object, bool]:
        """A stretch (engine/fast_forward.py). Under a policy that reads stats, where the replica of the next request
        is not known in advance, the stretch goes on lazily: it waits until each chunk of its steps is final, and
        the arrival process cuts it (`cut`) where it routes a request here first."""
        sim, r, eng, env = self.sim, self.r, self.eng, self.env
        if not self.skip or sim.publishers[r].dirty:  # a report pending would go out after one of these steps
            return False
        horizon, lazy = sim.horizon, sim.lazy
        until = min(horizon.routed_here(r) if lazy else horizon.until(r), self.grammars.next_due(r))
        done = self.stretch_from = sim.steps_done[r]
        steps = advance(eng, env.now, until, sim.step_end, SIM_TOKEN_ID, max_steps=self.grammars.steps_until_due(r),
                        after_finish=self.report_after if sim.dp > 1 else None, decode_ends=sim.decode_ends,
                        next_routing=horizon.next_routing() if lazy else None)
        resume = None
        try:
            chunk_end = next(steps)
            while True:  # lazy: wait until the chunk's steps are final (or a cut)
                sim.coasting[r] = steps
                try:
                    yield env.timeout_at(chunk_end)
                except simpy.Interrupt:  # cut: the stretch ended there
                    k, end, finished, resume = self.cut_stretch
                    break
                sim.coasting[r] = None
                chunk_end = steps.send(math.inf)
        except StopIteration as stop:
            k, end, finished = stop.value
        if not k:
            return False
        sim.steps_done[r] = done + k
        sim.skipped += k
        yield env.timeout_at(end) if resume is None else resume
        if sim.dp > 1 and sim.publishers[r].after_update(env.now, finished, idle=not eng.requests):
            sim.publish(r)
        return True

    def cut(self) -> None:
        """A request was routed here now, while a stretch waits for its chunk to be final: the stretch keeps the steps
        that started before now, and the replica resumes at the end of its last one (an event made now, before the
        request's own hop, as the step's end would be stepping)."""
        steps, self.sim.coasting[self.r] = self.sim.coasting[self.r], None
        try:
            steps.send(self.env.now)
        except StopIteration as stop:
            k, end, finished = stop.value
        else:
            raise AssertionError(f"replica {self.r}: a stretch went on past the routing of a request to it")
        self.cut_stretch = (k, end, finished, self.env.timeout_at(end))
        self.process.interrupt()

    def report_after(self, j: int, t: float) -> bool:
        """Inside a stretch: its j-th step, which ends at t before the replica's next admission, finished a request
        (so no request reached the replica by t, and its stats at t are what the stretch left): the report
        stepping would send at t, taken now and received one hop after t; whether the stretch may go on (no
        report is left pending)."""
        sim, r = self.sim, self.r
        sim.steps_done[r] = self.stretch_from + j
        publisher = sim.publishers[r]
        if publisher.after_update(t, True, idle=False):  # it holds requests: not idle
            sim.publish(r, at=t)
        return not publisher.dirty

    def stalled(self) -> Generator[simpy.Event, object, None]:
        """Idle if it holds no request (its last grammar failed); if only requests whose grammar compiles
        remain, wait until one is due or an arrival; otherwise a scheduler bug."""
        if not self.eng.requests:
            return
        due = self.grammars.next_due(self.r)
        if self.env.now < due < math.inf:
            wake = self.sim.wake[self.r] = self.env.event()
            yield wake | self.env.timeout_at(due)
            return
        yield from super().stalled()

    def updated(self, so: SchedulerOutput, finished: list, busy: bool) -> None:
        self.sim.after_update(self.r, so, finished, busy)


class TimelineReplica(OnTimeline, ServingReplica):
    """A replica on a recorded `--async-scheduling` run's timeline (sim/async_timeline.py): each schedule call when the
    real loop made it, each update when the real loop made it."""

    def __init__(self, sim: ClusterSim, r: int, timeline: AsyncTimeline) -> None:
        super().__init__(sim, r)
        self.timeline = timeline

    def ready(self, busy: bool) -> Generator[simpy.Event, object, float]:
        if (yield from self.next_call(busy)) is None:  # every recorded step ran: idle until the end (a later
            return (yield from super().ready(busy))    # request would outrun the record)
        return self.env.now

    def stalled(self) -> Generator[simpy.Event, object, None]:
        raise RuntimeError(f"the simulation diverged from the recorded async run: {self.nothing_formed()}")
        yield  # a generator


class PipelinedReplica(ServingReplica):
    """A replica with pipeline parallelism: real mode's batch queue (engine/stepper.py), call for call."""

    def run(self) -> Generator[simpy.Event, object, None]:
        """Schedule and launch while fewer than P batches are in flight, else (or when nothing is schedulable)
        wait for the oldest and update it. A recorded timeline schedules each batch when the real run did, and
        updates the oldest first when the real run updated it before that."""
        sim, env, eng, r = self.sim, self.env, self.eng, self.r
        pp, cost_model = sim.config.pipeline_parallel_size, sim.cost_model
        recorded = not isinstance(cost_model, PipelineCostModel)
        stages = cost_model.for_replica()  # this replica's stages: busy with its batches only
        queue: deque = deque()  # (SchedulerOutput, ModelRunnerOutput, end time), oldest first
        while True:
            yield from self.ready(bool(queue))
            if len(queue) < pp:
                t = stages.next_launch(env.now, bool(queue))
                if not (recorded and queue and queue[0][2] <= t):
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    self.grammars.apply(r, env.now)  # as EngineStepper.step polls its grammars before each schedule
                    if not eng.requests and not queue:
                        continue  # its last request's grammar failed
                    so = eng.schedule(env.now)
                    if not so.is_empty:
                        out = ModelRunnerOutput(self.executor.sampled(so), 0.0)
                        if so.has_beams:
                            add_beam_logprobs(so, out)
                        queue.append((so, out, stages.launch(so, env.now)))
                        if len(queue) < pp:
                            continue
                    elif not queue:
                        yield from self.stalled()
                        continue
            step_so, step_out, end = queue.popleft()
            if end > env.now:
                yield env.timeout(end - env.now)
            self.updated(step_so, eng.update(step_so, step_out, env.now), bool(queue))


@collector_paused()
def simulate(trace: list[TraceRequest], config: EngineConfig, cost_model: CostModel, num_gpu_blocks: int,
             max_model_len: int, vocab_size: int = 32000,
             on_progress: Callable[[float, int], None] | None = None, progress_interval_s: float = 5.0,
             fast_forward_decodes: bool = True, num_cpu_blocks: int | None = None) -> SimResult:
    """Replay a trace through `config.data_parallel_size` EngineCore replicas in simulated time.

    `fast_forward_decodes`: advance stretches of decode-only steps in one go (engine/fast_forward.py); the
    records are the same either way (False steps through every one, for the tests that check that).
    `num_cpu_blocks`: each replica's CPU swap pool (None: the config's)."""
    sim = ClusterSim(trace, config, cost_model, num_gpu_blocks, max_model_len, vocab_size, num_cpu_blocks)
    return sim.run(on_progress, progress_interval_s, fast_forward_decodes)
