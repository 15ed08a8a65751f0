"""SimPy cluster: an arrival process, the DP coordinator and one process per EngineCore replica.

Each replica loops schedule -> cost model -> `yield env.timeout(duration)` -> update, and sleeps
on an event while it has no requests. The simulation ends when every trace request has arrived
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

import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from testbed.engine.block_manager import prompt_block_hashes
from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import DPCoordinator, StatsPublisher
from testbed.engine.core import EngineCore
from testbed.engine.fast_forward import fast_forward
from testbed.engine.metrics import Recorder
from testbed.engine.params import BeamSearchParams, SamplingParams
from testbed.engine.request import Request
from testbed.engine.outputs import ModelRunnerOutput
from testbed.sim.cost_model import CostModel
from testbed.sim.environment import SimEnvironment
from testbed.sim.executor import SIM_TOKEN_ID, SimExecutor, add_beam_logprobs
from testbed.sim.grammars import SimGrammars
from testbed.sim.horizon import AdmissionHorizon
from testbed.workload.lora import trace_loras
from testbed.sim.pipeline import PipelineCostModel
from testbed.workload.trace import TraceRequest, synthesize_prompt


class LazyPrompt(Sequence[int]):
    """A trace request's prompt tokens, synthesised on first read (only prefix caching reads them)."""

    __slots__ = ("_req", "_vocab", "_seed", "_tokens")

    def __init__(self, req: TraceRequest, vocab_size: int, seed: int) -> None:
        self._req, self._vocab, self._seed, self._tokens = req, vocab_size, seed, None

    def __len__(self) -> int:
        return self._req.input_tokens

    def tolist(self) -> list[int]:
        return self._materialize().tolist()

    def __getitem__(self, i):  # type: ignore[override]
        return self._materialize()[i]

    def _materialize(self):
        if self._tokens is None:
            self._tokens = synthesize_prompt(self._req, self._vocab, self._seed)
        return self._tokens


@functools.lru_cache(maxsize=4096)
def _sampling_params(output_tokens: int, structured_output: bool) -> SamplingParams:
    """One validated SamplingParams per (output length, grammar) shared by the requests that have them (the
    engine only reads a request's sampling params)."""
    return TraceRequest("", 0.0, 1, output_tokens, structured_output=structured_output).sampling_params()


@functools.lru_cache(maxsize=4096)
def _beam_params(width: int, output_tokens: int) -> BeamSearchParams:
    return TraceRequest("", 0.0, 1, output_tokens, beam_width=width).beam_params()


def trace_to_request(tr: TraceRequest, vocab_size: int, seed: int, loras: dict | None = None) -> Request:
    """Engine request for a trace line: its output forced to the trace's length, its adapter from `loras`
    (workload/lora.py's trace_loras) when it names one; a beam search of that many steps when it has a
    beam_width."""
    prompt = tr.prompt_token_ids if tr.prompt_token_ids is not None else LazyPrompt(tr, vocab_size, seed)
    bp = None if tr.beam_width is None else _beam_params(tr.beam_width, tr.output_tokens)
    sp = _sampling_params(tr.output_tokens, tr.structured_output) if bp is None else bp.sampling_params()
    return Request(tr.id, prompt, sp, arrival_time=tr.arrival_s, priority=tr.priority,
                   lora_request=None if tr.lora is None else loras[tr.lora], beam_params=bp)


@dataclass
class SimResult:
    engines: list[EngineCore]
    records: Recorder
    sim_time: float
    prefix_queries: int
    prefix_hits: int
    fast_forwarded_steps: int = 0  # of the steps in the records, those advanced by engine/fast_forward.py

    @classmethod
    def collect(cls, engines: list[EngineCore], records: Recorder, sim_time: float) -> "SimResult":
        """The result of a run: `records` plus every replica's, and the prefix-cache totals."""
        for e in engines:
            records.extend(e.records)
        return cls(engines, records, sim_time, sum(e.block_manager.prefix_queries for e in engines),
                   sum(e.block_manager.prefix_hits for e in engines))


def simulate(trace: list[TraceRequest], config: EngineConfig, cost_model: CostModel, num_gpu_blocks: int,
             max_model_len: int, vocab_size: int = 32000,
             on_progress: Callable[[float, int], None] | None = None, progress_interval_s: float = 5.0,
             fast_forward_decodes: bool = True, num_cpu_blocks: int | None = None) -> SimResult:
    """Replay a trace through `config.data_parallel_size` EngineCore replicas in simulated time.

    `fast_forward_decodes`: advance stretches of decode-only steps in one go (engine/fast_forward.py); the
    records are the same either way (False steps through every one, for the tests that check that).
    `num_cpu_blocks`: each replica's CPU swap pool (None: the config's)."""
    env = SimEnvironment()
    loras = trace_loras([tr.lora for tr in trace], config)
    dp = config.data_parallel_size
    engines = [EngineCore(config, num_gpu_blocks, max_model_len, replica=r, stream_outputs=False,
                          num_cpu_blocks=num_cpu_blocks) for r in range(dp)]
    coord = DPCoordinator(dp, config.dp_policy, config.block_size, affinity_capacity_blocks=num_gpu_blocks,
                          lora_capacity=config.max_cpu_loras)
    executor = SimExecutor(cost_model)
    grammars = SimGrammars(engines, getattr(cost_model, "grammar_events", None),
                           lambda: getattr(cost_model, "step", 0))
    wake = [env.event() for _ in range(dp)]
    done = env.event()
    state = {"admitted": 0, "idle": set(range(dp)), "seq": 0}
    need_hashes = config.dp_policy == "prefix_affinity"
    hop = config.dp_routing_delay / 2 if dp > 1 else 0.0  # one ZMQ hop; dp 1 has no coordinator
    horizon = AdmissionHorizon([tr.arrival_s for tr in trace], hop, dp, config.dp_policy == "round_robin")
    publishers = [StatsPublisher(config.dp_stats_interval) for _ in range(dp)]
    steps_done = [0] * dp
    skipped = [0]  # steps fast-forwarded
    routes: list[list] = []        # ROUTE_COLUMNS rows
    publications: list[list] = []  # PUBLICATION_COLUMNS rows

    def after_hop(fn, *args) -> None:
        if hop:
            env.timeout(hop).callbacks.append(lambda _: fn(*args))
        else:
            fn(*args)

    def wake_up(r: int) -> None:
        if not wake[r].triggered:
            wake[r].succeed()

    def finish_if_done() -> None:
        if state["admitted"] == len(trace) and len(state["idle"]) == dp and not done.triggered:
            done.succeed()

    def admit(r: int, req: Request, route: list | None) -> None:
        horizon.admit(r)
        if route is not None:
            route[-1] = env.now
        state["admitted"] += 1
        if engines[r].add_request(req, env.now) is None:  # accepted; a rejection is recorded at once
            state["idle"].discard(r)  # busy from now on, so the end check cannot fire before it wakes
            for t in grammars.submit(r, env.now):  # its grammar compiles meanwhile: wake the replica when due
                env.timeout_at(t).callbacks.append(lambda _: wake_up(r))
            wake_up(r)
        else:
            finish_if_done()

    def publish(r: int, transit: bool = True) -> None:
        """Replica r samples its stats now; the coordinator takes them one hop later."""
        stats = engines[r].stats()
        row = [None, r, steps_done[r], env.now, None, stats.num_waiting, stats.num_running, stats.kv_usage,
               stats.num_free_blocks, stats.num_blocks, stats.num_waiting_tokens, stats.num_added]
        publications.append(row)

        def receive() -> None:
            row[0], row[4] = state["seq"], env.now
            state["seq"] += 1
            coord.update_stats(r, stats)
        if transit:
            after_hop(receive)
        else:
            receive()

    def arrivals():
        for tr in trace:
            delay = tr.arrival_s + hop - env.now  # the coordinator sees it one hop after its arrival
            if delay > 0:
                yield env.timeout(delay)
            req = trace_to_request(tr, vocab_size, config.seed, loras)
            hashes = ()
            if need_hashes:
                hashes = req.block_hashes = prompt_block_hashes(req.prompt_token_ids, config.block_size)
            r = coord.route(req.num_prompt_tokens, hashes, 0 if req.lora_request is None else req.lora_request.lora_int_id)
            horizon.route(r)
            route = None
            if dp > 1:  # seq, request, replica, arrival, sent, routed, added (set on admission)
                route = [state["seq"], req.request_id, r, tr.arrival_s, tr.arrival_s, env.now, None]
                routes.append(route)
                state["seq"] += 1
            after_hop(admit, r, req, route)

    def after_update(r: int, so, finished, busy: bool) -> None:
        """Count an updated step; a DP replica reports its stats when the publisher says so."""
        steps_done[r] += 1
        if dp > 1 and publishers[r].after_update(
                env.now, bool(finished or so.new_req_ids or so.preempted_req_ids),
                idle=not engines[r].requests and not busy):
            publish(r)

    def pipelined_replica(r: int):
        """The replica's batch queue (pipeline parallelism), call for call as EngineStepper makes it: schedule
        and launch while fewer than P batches are in flight, else (or when nothing is schedulable) wait for the
        oldest and update it. A recorded timeline schedules each batch when the real run did, and updates the
        oldest first when the real run updated it before that."""
        eng, pp = engines[r], config.pipeline_parallel_size
        recorded = not isinstance(cost_model, PipelineCostModel)
        stages = cost_model.for_replica()  # this replica's stages: busy with its batches only
        queue: deque = deque()  # (SchedulerOutput, ModelRunnerOutput, end time), oldest first
        while True:
            if not eng.requests and not queue:
                state["idle"].add(r)
                finish_if_done()
                wake[r] = env.event()
                yield wake[r]
                state["idle"].discard(r)
            if len(queue) < pp:
                t = stages.next_launch(env.now, bool(queue))
                if not (recorded and queue and queue[0][2] <= t):
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    grammars.apply(r, env.now)  # as EngineStepper.step polls its grammars before each schedule
                    if not eng.requests and not queue:
                        continue  # its last request's grammar failed
                    so = eng.schedule(env.now)
                    if not so.is_empty:
                        out = ModelRunnerOutput(executor.sampled(so), 0.0)
                        if so.has_beams:
                            add_beam_logprobs(so, out)
                        queue.append((so, out, stages.launch(so, env.now)))
                        if len(queue) < pp:
                            continue
                    elif not queue and env.now < grammars.next_due(r) < float("inf"):
                        wake[r] = env.event()  # only requests whose grammar compiles: until one is due, or an arrival
                        yield wake[r] | env.timeout_at(grammars.next_due(r))
                        continue
                    elif not queue:
                        raise RuntimeError(f"replica {r}: nothing schedulable with {len(eng.requests)} requests "
                                           "live (scheduler bug: every admitted request must fit the cache)")
            step_so, step_out, end = queue.popleft()
            if end > env.now:
                yield env.timeout(end - env.now)
            after_update(r, step_so, eng.update(step_so, step_out, env.now), bool(queue))

    def replica(r: int):
        """The replica's step loop. With async scheduling it keeps one step in flight like the real
        EngineStepper: step N+1 is scheduled when step N starts, starts on the device when N ends,
        and N is updated at its end (host work hidden); the core sees the same call order."""
        eng = engines[r]
        overlap = config.async_scheduling
        skip = fast_forward_decodes and not overlap
        in_flight = None  # (SchedulerOutput, ModelRunnerOutput, end time) of the launched step
        while True:
            if not eng.requests and in_flight is None:
                state["idle"].add(r)
                finish_if_done()
                wake[r] = env.event()
                yield wake[r]
                state["idle"].discard(r)
            grammars.apply(r, env.now)
            if not eng.requests and in_flight is None:
                continue  # its last request's grammar failed
            if skip and not publishers[r].dirty:  # a report pending would go out after one of these steps
                until = min(horizon.until(r), grammars.next_due(r))
                k, end, finished = fast_forward(eng, env.now, until, step_end, SIM_TOKEN_ID,
                                                max_steps=grammars.steps_until_due(r), stop_after_finish=dp > 1)
                if k:
                    steps_done[r] += k
                    skipped[0] += k
                    yield env.timeout_at(end)
                    if dp > 1 and publishers[r].after_update(env.now, finished, idle=not eng.requests):
                        publish(r)
                    continue  # the stretch may go on (an arrival it stopped for went elsewhere)
            so = eng.schedule(env.now)
            if so.is_empty and in_flight is None and env.now < grammars.next_due(r) < float("inf"):
                wake[r] = env.event()  # only requests whose grammar compiles: until one is due, or an arrival
                yield wake[r] | env.timeout_at(grammars.next_due(r))
                continue
            if so.is_empty and in_flight is None:
                raise RuntimeError(f"replica {r}: nothing schedulable with {len(eng.requests)} requests live "
                                   "(scheduler bug: every admitted request must fit the cache)")
            launched = None
            if not so.is_empty:
                out = executor.execute(so)
                start = in_flight[2] if in_flight is not None else env.now
                launched = (so, out, start + out.duration)
            if not overlap:
                in_flight, launched = launched, None
            if in_flight is not None:
                step_so, step_out, end = in_flight
                yield env.timeout(end - env.now)
                after_update(r, step_so, eng.update(step_so, step_out, env.now), launched is not None)
            in_flight = launched

    def step_end(so, start: float) -> float:
        """When a step scheduled at `start` ends: where `yield env.timeout(start + d - env.now)` lands."""
        end = start + cost_model.step_time(so)
        return start + (end - start)

    def progress():
        while True:
            yield env.timeout(progress_interval_s)
            on_progress(env.now, sum(len(e.records.requests) for e in engines))

    if dp > 1:
        for r in range(dp):  # the report each replica sends once it is up, long before the first request
            publish(r, transit=False)
    env.process(arrivals())
    for r in range(dp):
        env.process(pipelined_replica(r) if config.pipeline_parallel_size > 1 else replica(r))
    if on_progress is not None:
        env.process(progress())
    if trace:
        env.run(until=done)
    # reports still on their way when the run ended never reached the coordinator: not recorded
    result = SimResult.collect(engines, Recorder(routes=[tuple(row) for row in routes], publications=[
        tuple(row) for row in publications if row[0] is not None]), env.now)
    result.fast_forwarded_steps = skipped[0]
    return result
