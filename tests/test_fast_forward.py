"""Fast-forward of decode stretches (engine/fast_forward.py) against stepping, step by step.

Two engines get the same requests at the same times. One steps (schedule -> executor -> update); the
other fast-forwards whenever it can, and the stepping one then takes as many ordinary steps, each of
which must be the pure decode step the fast-forward claimed. After every stretch the two must agree on
everything: step rows, ITL samples, request rows, live requests' counters, the block manager's tables,
free list, LRU order and prefix-cache maps, the queues and token counts. The simulator-level tests run
whole traces both ways (data parallelism, prefix caching, preemption) and compare every record table.
"""
from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.engine.core import EngineCore
from testbed.engine.fast_forward import fast_forward
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.request import RequestStatus
from testbed.sim.cluster import simulate
from testbed.sim.environment import SimEnvironment
from testbed.sim.cost_model import RooflineCostModel
from testbed.specs.hardware import get_gpu_spec
from testbed.specs.presets import get_model_spec
from testbed.workload.trace import TraceRequest, gamma_arrivals, load_trace

from conftest import make_engine, make_request

TOKEN = 0


def step_time(so: SchedulerOutput) -> float:
    """A cost that reads every aggregate a cost model may read (and iterates num_computed_before)."""
    return (1e-3 + 1e-6 * so.sum_context_tokens + 3e-7 * so.max_context_tokens + 1e-8 * sum(so.num_computed_before)
            + 1e-9 * so.sum_attn_pairs + 1e-5 * len(so.requests) + 2e-6 * so.total_num_scheduled_tokens)


def step_end(so: SchedulerOutput, start: float) -> float:
    return start + step_time(so)


def decode_ends(b: int, structured: int):
    """step_end's values for successive decode steps of b rows without their SchedulerOutput (what a cost model's
    decode_steps gives a stretch): each step has b more context tokens and its longest row one more."""
    def ends(start: float, sum_ctx: int, max_ctx: int):
        while True:  # step_time's terms, in its order: sum(num_computed_before) is sum_ctx - b for decodes
            start = start + (1e-3 + 1e-6 * sum_ctx + 3e-7 * max_ctx + 1e-8 * (sum_ctx - b) + 1e-9 * sum_ctx + 1e-5 * b
                             + 2e-6 * b)
            yield start
            sum_ctx, max_ctx = sum_ctx + b, max_ctx + 1
    return ends


def snapshot(core: EngineCore) -> dict:
    bm, sched = core.block_manager, core.scheduler
    live = {rid: (r.num_computed_tokens, r.num_tokens, list(r.output_token_ids), r.num_pending, r.first_token_time,
                  r.last_token_time, r.first_scheduled_time, r.status, r.num_preemptions, r.num_cached_tokens)
            for rid, r in core.requests.items()}
    return {"steps": list(core.records.steps), "itl": list(core.records.itl), "requests": list(core.records.requests),
            "live": live, "free": list(bm.free_ids), "cached": list(bm.cached), "tables": dict(bm.req_blocks),
            "hash_to_block": dict(bm.hash_to_block), "block_hash": list(bm.block_hash), "ref": list(bm.ref_cnt),
            "registered": dict(bm.req_num_registered), "running": [r.request_id for r in sched.running],
            "waiting": sched.num_waiting, "counts": core.token_counts, "last_update": core._last_update,
            "waiting_tokens": core.num_waiting_tokens}


def ordinary_step(core: EngineCore, now: float, pure_decode: bool = False) -> float:
    so = core.schedule(now)
    if pure_decode:  # what the fast-forward claimed this step is
        assert so.num_decode_tokens == so.num_reqs == core.scheduler.num_running and not so.new_req_ids
        assert not so.preempted_req_ids
    out = ModelRunnerOutput([TOKEN if r.num_computed_tokens >= r.num_tokens else -1 for r in so.requests])
    end = step_end(so, now)
    core.update(so, out, end)
    return end


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    config = {"block_size": block_size, "max_num_seqs": draw(st.integers(1, 8)),
              "max_num_batched_tokens": draw(st.integers(8, 64)), "enable_prefix_caching": draw(st.booleans()),
              "policy": draw(st.sampled_from(["fcfs", "priority"]))}
    blocks = draw(st.integers(8, 120))
    shared = [draw(st.integers(1, 50)) for _ in range(3)]  # a common prompt head makes prefix hits
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        n_in = draw(st.integers(1, 40))
        head = shared[:draw(st.integers(0, 3))]
        tokens = (head + [1000 + 37 * i + k for k in range(n_in)])[:max(n_in, 1)]
        reqs.append((draw(st.floats(0, 0.3)), tokens, draw(st.integers(1, 60)), draw(st.integers(0, 2))))
    chunks = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    return config, blocks, sorted(reqs, key=lambda r: r[0]), chunks, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fast_forward_leaves_the_state_stepping_leaves_after_every_stretch(scenario):
    config, blocks, reqs, chunks, priced = scenario  # priced: the stretch prices its steps with decode_ends
    cores = [make_engine(num_gpu_blocks=blocks, max_model_len=128, **config) for _ in range(2)]
    stepping, skipping = cores
    pending = list(enumerate(reqs))
    now, skipped, n = 0.0, 0, 0
    while pending or stepping.requests:
        while pending and pending[0][1][0] <= now:
            i, (t, tokens, max_tokens, prio) = pending.pop(0)
            for core in cores:
                core.add_request(make_request(f"r{i}", tokens=tokens, max_tokens=max_tokens, arrival=t, priority=prio),
                                 now)
        if not stepping.requests:
            if not pending:
                break  # the last arrivals were rejected
            now = pending[0][1][0]
            continue
        until = pending[0][1][0] if pending else math.inf
        chunk = chunks[n % len(chunks)]
        k, end, finished = fast_forward(skipping, now, until, step_end, TOKEN, max_steps=chunk,
                                        decode_ends=decode_ends if priced else None)
        n += 1
        assert k <= chunk and (k == 0 or now < until)
        for i in range(k):
            done = len(stepping.records.requests)
            now = ordinary_step(stepping, now, pure_decode=True)
            if i == k - 1:  # whether the stretch's last step finished a request
                assert finished == (len(stepping.records.requests) > done)
        assert end == now
        skipped += k
        skipping.block_manager.check_invariants()
        assert snapshot(skipping) == snapshot(stepping)
        if stepping.requests:
            now = ordinary_step(stepping, now)
            assert ordinary_step(skipping, end) == now
    assert snapshot(skipping) == snapshot(stepping)
    assert all(r == "length" for r in stepping.records.request_columns()["finish_reason"] if r != "rejected")


def test_a_stretch_stops_before_an_arrival_a_finish_and_a_preemption():
    core = make_engine(num_gpu_blocks=8, max_model_len=128, block_size=4)
    for rid in "ab":
        core.add_request(make_request(rid, 3, 20), 0.0)
    now = ordinary_step(core, 0.0)  # both prefills: 3 tokens in one block each, the first output tokens sampled
    assert fast_forward(core, now, now, step_end, TOKEN) == (0, now, False)  # `until` reached: nothing advanced
    k, t, _ = fast_forward(core, now, math.inf, step_end, TOKEN)
    assert k == 13 and core.block_manager.num_free_blocks == 0  # 4 blocks each hold 16 tokens; the 17th needs a 5th
    assert fast_forward(core, t, math.inf, step_end, TOKEN)[0] == 0  # the next step preempts: stepping does it
    for req in core.requests.values():
        assert req.num_computed_tokens == 16 and req.num_tokens == 17 and req.status == RequestStatus.RUNNING



def test_a_stretch_goes_on_past_a_finish_with_the_smaller_batch_unless_told_to_stop():
    for go_on in (None, True, False):  # no after_finish; one that lets the stretch go on; one that stops it
        core = make_engine(num_gpu_blocks=64, max_model_len=128)
        core.add_request(make_request("b", 8, 5), 0.0)
        core.add_request(make_request("c", 8, 9), 0.0)
        now = ordinary_step(core, 0.0)  # both prompts, and the first token of each
        calls = []

        def after_finish(j, t):  # what a report samples: the queues and blocks as that step's update leaves them
            calls.append((j, t, [r.request_id for r in core.scheduler.running], core.stats().num_running,
                          core.block_manager.num_used_blocks, len(core.block_manager.req_blocks["c"])))
            return go_on

        k, t, finished = fast_forward(core, now, math.inf, step_end, TOKEN,
                                      after_finish=None if go_on is None else after_finish)
        assert "b" not in core.requests and k == (4 if go_on is False else 8) and (("c" in core.requests) == (k == 4))
        assert finished == (go_on is not False)  # told of b's finish only when after_finish did not take it
        if go_on is not None:  # b's finish (c's ends the batch: the driver acts on it)
            assert [c[:4] for c in calls] == [(4, calls[0][1], ["c"], 1)] and calls[0][4] == calls[0][5]  # b's blocks freed
        cols = core.records.request_columns()
        assert list(zip(cols["request_id"], cols["output_tokens"], cols["finish_reason"])) == [("b", 5, "length")] + (
            [] if k == 4 else [("c", 9, "length")])


def test_nothing_is_fast_forwarded_while_someone_could_be_admitted():
    core = make_engine(num_gpu_blocks=64, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=8)
    core.add_request(make_request("a", 4, 20), 0.0)
    now = ordinary_step(core, 0.0)
    core.add_request(make_request("b", 40, 20), now)  # longer than the budget: admitted in chunks
    assert fast_forward(core, now, math.inf, step_end, TOKEN)[0] == 0
    core.add_request(make_request("c", 4, 20), now)
    while core.requests["b"].num_computed_tokens < 40:  # b's prompt in chunks beside a's decodes
        now = ordinary_step(core, now)
    assert core.scheduler.num_running == 2 and core.scheduler.num_waiting == 1  # max_num_seqs reached: c waits
    assert fast_forward(core, now, math.inf, step_end, TOKEN)[0] > 0


def test_a_replica_resumes_at_exactly_the_time_stepping_reaches():
    """0.0170056 + d is never 0.05646955386143295 for any float d (round to nearest even); timeout_at gets there."""
    env = SimEnvironment()
    now, t = 0.0170056, 0.05646955386143295
    d = t - now
    assert {now + x for x in (math.nextafter(d, 0), d, math.nextafter(d, 1))} == {math.nextafter(t, 0),
                                                                                 math.nextafter(t, 1)}
    seen = []

    def proc():
        yield env.timeout(now)
        yield env.timeout_at(t)
        seen.append(env.now)

    env.process(proc())
    env.run()
    assert seen == [t]


@functools.cache
def profiled_8b():
    from testbed.sim.profiled import ProfiledCostModel
    return ProfiledCostModel.from_file("testbed/profiling/profiles/Llama-3.1-8B_H100-SXM_tp1.json")


def simulate_both(trace: list[TraceRequest], cm=None, **config_overrides):
    from testbed.engine.config import EngineConfig
    cfg = EngineConfig(**config_overrides)
    cm = cm or RooflineCostModel(get_model_spec("Llama-3.2-1B"), get_gpu_spec("H100-SXM"))
    blocks = cfg.num_gpu_blocks or 4000
    results = [simulate(trace, cfg, cm, blocks, 4096, fast_forward_decodes=ff) for ff in (False, True)]
    tables = [(r.records.steps, r.records.itl, r.records.requests, r.records.routes,
               r.records.publications, r.sim_time, r.prefix_queries, r.prefix_hits) for r in results]
    for r in results:  # the arrays the summary and steps.parquet are made from: the rows' floats, bit for bit
        cols, rows = r.records.step_columns(), list(r.records.steps)
        assert all(cols[c].tobytes() == np.array([row[i] for row in rows], dtype=cols[c].dtype).tobytes()
                   for i, c in enumerate(cols))
        assert r.records.itl.array().tobytes() == np.array(list(r.records.itl), dtype=np.float64).tobytes()
        # the same from the step table's flattening, made once for both (as a run directory's summary takes it)
        assert r.records.itl_array().tobytes() == r.records.itl.array().tobytes()
    return tables, results


def test_the_azure_slice_gives_the_same_records_fast_forwarded():
    trace = load_trace("traces/azure_conv_10min.jsonl", limit=400)
    (stepped, skipped), (_, res) = simulate_both(trace)
    assert stepped == skipped
    assert res.fast_forwarded_steps > 0.5 * len(res.records.steps)  # the comparison is about something


def test_a_profiled_cost_model_gives_the_same_records_fast_forwarded():
    """The profiled model prices a stretch's decodes without their SchedulerOutput (decode_time, built once per
    batch size): the same records as stepping, which prices each step from its SchedulerOutput."""
    from testbed.sim.profiled import ProfiledCostModel
    cm = ProfiledCostModel.from_file("testbed/profiling/profiles/Llama-3.1-8B_H100-SXM_tp1.json")
    trace = load_trace("traces/azure_conv_10min.jsonl", limit=300)
    for overrides in ({}, {"data_parallel_size": 2, "dp_policy": "least_loaded"}):
        (stepped, skipped), (_, res) = simulate_both(trace, cm, **overrides)
        assert stepped == skipped
        assert res.fast_forwarded_steps > 0.5 * len(res.records.steps)


@st.composite
def traces(draw):
    n = draw(st.integers(1, 25))
    t, out = 0.0, []
    for i in range(n):
        t += draw(st.floats(0, 0.05))
        n_in = draw(st.integers(1, 300))
        hashes = draw(st.lists(st.integers(0, 3), min_size=-(-n_in // 32), max_size=-(-n_in // 32)))
        out.append(TraceRequest(f"q{i}", t, n_in, draw(st.integers(1, 200)), hash_ids=hashes, hash_block_size=32,
                                priority=draw(st.integers(0, 1)), structured_output=draw(st.booleans())))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(1, 3), st.sampled_from(["round_robin", "least_loaded", "kv_aware", "prefix_affinity"]),
       st.booleans(), st.sampled_from([0.0, 0.01]), st.integers(40, 400), st.sampled_from(["fcfs", "priority"]),
       st.booleans())
def test_simulations_give_the_same_records_fast_forwarded(trace, dp, dp_policy, prefix, interval, blocks, policy,
                                                          profiled):
    """profiled: the profiled model, whose decode_steps prices a stretch's steps without their SchedulerOutput."""
    (stepped, skipped), _ = simulate_both(trace, profiled_8b() if profiled else None, data_parallel_size=dp,
                                          dp_policy=dp_policy,
                                          enable_prefix_caching=prefix, dp_stats_interval=interval,
                                          num_gpu_blocks=blocks, policy=policy, max_num_batched_tokens=256,
                                          max_num_seqs=16)
    assert stepped == skipped


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(2, 4), st.sampled_from([0.0, 7e-4, 0.013]),
       st.sampled_from(["round_robin", "least_loaded"]))
def test_the_admission_horizon_replays_the_arrival_process_times_exactly(trace, dp, delay, policy):
    """Its routing and admission times are, float for float, the `routed` and `added` times the simulation
    records; under round_robin, request i went to replica i % dp."""
    from testbed.engine.config import EngineConfig
    from testbed.sim.horizon import AdmissionHorizon
    cfg = EngineConfig(data_parallel_size=dp, dp_policy=policy, dp_routing_delay=delay, num_gpu_blocks=400)
    res = simulate(trace, cfg, RooflineCostModel(get_model_spec("Llama-3.2-1B"), get_gpu_spec("H100-SXM")), 400, 4096)
    horizon = AdmissionHorizon([tr.arrival_s for tr in trace], delay / 2, dp, policy == "round_robin")
    routes = sorted(res.records.routes, key=lambda row: row[0])  # seq, request, replica, arrival, sent, routed, added
    assert [row[5] for row in routes] == horizon.route_times
    assert [row[6] for row in routes] == horizon.admit_times
    if policy == "round_robin":
        assert [row[2] for row in routes] == [i % dp for i in range(len(trace))]


@pytest.mark.parametrize("policy, n, seed", [("kv_aware", 800, 2), ("least_loaded", 600, 4)])
def test_lazy_stretches_cut_by_a_routing_give_the_records_stepping_gives(policy, n, seed):
    """Under a policy that reads stats, a replica's stretch goes on past other replicas' routings and is cut where a
    request is routed to it, in the middle of a chunk or of the stretch's first step (whose finish must then not be
    reported from inside the stretch): 4 loaded replicas, the same records as stepping."""
    lengths = [(r.input_tokens, r.output_tokens) for r in load_trace("traces/azure_conv_10min.jsonl")]
    rng = random.Random(seed)
    trace = [TraceRequest(f"syn-{i}", t, *rng.choice(lengths)) for i, t in enumerate(gamma_arrivals(n, 16.0, 1.0, seed))]
    (stepped, skipped), (_, res) = simulate_both(trace, profiled_8b(), data_parallel_size=4, dp_policy=policy)
    assert stepped == skipped
    assert res.fast_forwarded_steps > 0.9 * len(res.records.steps)
