"""Scheduler, driven through EngineCore with a fixed-token executor: budgets, preemption, fairness,
priority, chunked prefill and prefix caching. Per-step invariants are asserted by conftest.check_step."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from conftest import FIXED_TOKEN, FixedTokenExecutor, KVCheckingExecutor, make_engine, make_request, run_engine


def finished_tokens(outs, rid) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def first_step_of(steps, rid) -> int:
    return next(i for i, so in enumerate(steps) if any(r.request_id == rid for r in so.requests))


# ---- property test over random workloads and configs -----------------------------------------------
@st.composite
def scenarios(draw):
    max_num_seqs = draw(st.integers(1, 6))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(24, 128))
    mml_in_config = draw(st.booleans())  # else only EngineCore gets it (as from an executor), unvalidated
    mnbt = draw(st.one_of(st.integers(max_num_seqs, max_num_seqs + 16), st.integers(max_num_seqs, 160)))
    if not chunked and mml_in_config:
        mnbt = max(mnbt, max_model_len)
    cfg = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt, block_size=block_size,
               enable_chunked_prefill=chunked, enable_prefix_caching=draw(st.booleans()),
               async_scheduling=draw(st.booleans()),
               policy=draw(st.sampled_from(["fcfs", "priority"])),
               max_model_len=max_model_len if mml_in_config else None,
               preemption_mode=draw(st.sampled_from(["recompute", "swap"])), num_cpu_blocks=draw(st.integers(0, 24)))
    reqs = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 1), st.integers(1, 40), st.integers(1, 24),
                                   st.integers(0, 2), st.none() | st.integers(0, 40)), min_size=1, max_size=10))
    lengths = [20 + tail + out for _, _, tail, out, _, _ in reqs if 20 + tail + out <= max_model_len] or [max_model_len]
    fit = -(-max(lengths) // block_size)  # blocks the longest servable request needs
    num_blocks = draw(st.one_of(st.integers(1, 48), st.integers(fit, 2 * fit)))  # the latter: tight, preempting
    return cfg, num_blocks, max_model_len, reqs


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_finish_with_exact_outputs(scenario):
    cfg, num_blocks, max_model_len, reqs = scenario
    engine = EngineCore(EngineConfig(**cfg), num_gpu_blocks=num_blocks, max_model_len=max_model_len)
    bs = cfg["block_size"]
    arrivals, want, aborts = [], {}, []
    for i, (step, group, tail, max_tokens, prio, abort_step) in enumerate(reqs):
        tokens = [500 + group] * 20 + [1000 * (i + 1) + j for j in range(tail)]  # groups share a prefix
        req = make_request(f"r{i}", tokens=tokens, max_tokens=max_tokens, arrival=float(step), priority=prio)
        arrivals.append((step, req))
        if abort_step is not None:
            aborts.append((step + abort_step, req.request_id))
        n = len(tokens) + max_tokens
        rejected = n > max_model_len or -(-n // bs) > num_blocks
        if not cfg["enable_chunked_prefill"] and len(tokens) + max_tokens - 1 > cfg["max_num_batched_tokens"]:
            rejected = True
        want[req.request_id] = None if rejected else max_tokens
    total = sum(len(r.prompt_token_ids) + r.max_tokens for _, r in arrivals)
    steps, outs = run_engine(engine, arrivals, KVCheckingExecutor(bs), max_steps=50 * total + 50, aborts=aborts)
    event(f"swapped out {engine.scheduler.num_swapped_out_blocks > 0}")
    aborted = {rid for rid, o in outs.items() if o[-1].finish_reason == "abort"}
    assert aborted <= {rid for _, rid in aborts}

    for rid, n in want.items():
        last = outs[rid][-1]
        assert last.finished and all(not o.finished for o in outs[rid][:-1])
        if n is None:
            assert last.finish_reason == "rejected" and last.stop_reason
        elif rid in aborted:
            assert finished_tokens(outs, rid) == [FIXED_TOKEN] * len(finished_tokens(outs, rid)) and \
                len(finished_tokens(outs, rid)) < n
        else:
            assert last.finish_reason == "length" and finished_tokens(outs, rid) == [FIXED_TOKEN] * n
    bm, sched = engine.block_manager, engine.scheduler
    assert bm.num_used_blocks == 0 and bm.usage == 0 and not sched.running and not sched.num_waiting
    assert bm.num_used_cpu_blocks == 0 and not sched.swapped
    bm.check_invariants()
    rows = engine.records.request_columns()
    assert sorted(rows["request_id"]) == sorted(want)
    assert sum(rows["preemptions"]) == sched.num_preemptions == sum(len(so.preempted_req_ids) for so in steps)
    if cfg["policy"] == "fcfs":  # admission in arrival order: the waiting head blocks the ones behind it
        order = [r.first_scheduled_time for _, r in sorted(arrivals, key=lambda a: a[0])]
        order = [t for t in order if t is not None]
        assert order == sorted(order)
    event(f"preempted={sched.num_preemptions > 0}")
    event(f"rejected={any(v is None for v in want.values())}")
    event(f"aborted={bool(aborted)}")
    event(f"prefix_hits={engine.block_manager.prefix_hits > 0}")
    for so in steps:
        if so.preempted_req_ids:
            assert not so.new_req_ids, "a waiting request was admitted in a step that preempted"


# ---- targeted scenarios ------------------------------------------------------------------------------
def test_preemption_under_a_tiny_cache_still_finishes_everyone():
    engine = make_engine(num_gpu_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 8, 16, arrival=float(i)) for i in range(4)]
    steps, outs = run_engine(engine, [(0, r) for r in reqs])
    assert all(finished_tokens(outs, r.request_id) == [FIXED_TOKEN] * 16 for r in reqs)
    assert engine.scheduler.num_preemptions > 0 and sum(r.num_preemptions for r in reqs) > 0
    assert reqs[0].num_preemptions == 0, "fcfs never preempts the oldest running request"
    preempted = {rid for so in steps for rid in so.preempted_req_ids}
    for rid in preempted:  # a preempted request comes back as new (recomputed from scratch)
        k = next(i for i, so in enumerate(steps) if rid in so.preempted_req_ids)
        assert any(rid in so.new_req_ids for so in steps[k + 1:])
    assert engine.block_manager.num_used_blocks == 0
    steps_rows, req_rows = engine.records.step_columns(), engine.records.request_columns()
    assert sum(steps_rows["num_preempted"]) == engine.scheduler.num_preemptions == sum(req_rows["preemptions"])


def test_fcfs_serves_in_arrival_order_within_exact_step_count():
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 8, 4, arrival=i * 0.1) for i in range(6)]
    steps, outs = run_engine(engine, [(0, r) for r in reqs])
    firsts = [r.first_token_time for r in reqs]
    assert firsts == sorted(firsts) and firsts == [1.0, 1.0, 5.0, 5.0, 9.0, 9.0]
    assert len(steps) == 12, "pairs of (1 prefill + 3 decode) steps"


def test_fcfs_no_starvation_under_preemption():
    engine = make_engine(num_gpu_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    reqs = [make_request(f"r{i}", 6, 10, arrival=float(i)) for i in range(8)]
    steps, outs = run_engine(engine, [(i, r) for i, r in enumerate(reqs)], max_steps=400)
    finishes = [r.finish_time for r in reqs]
    assert finishes == sorted(finishes), "equal requests must finish in arrival order"
    assert all(len(finished_tokens(outs, r.request_id)) == 10 for r in reqs)


def test_fcfs_waiting_head_blocks_later_requests():
    engine = make_engine(num_gpu_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    hog = make_request("hog", 16, 8)      # holds 4..6 blocks while decoding
    big = make_request("big", 24, 4)      # needs 7 blocks: cannot start before hog ends
    small = make_request("small", 4, 2)   # would fit, but fcfs keeps it behind big
    steps, _ = run_engine(engine, [(0, hog), (1, big), (1, small)])
    assert big.first_scheduled_time >= hog.finish_time
    assert small.first_scheduled_time >= big.first_scheduled_time


def test_priority_serves_lower_values_first():
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    prios = [2, 0, 1, 0, 3]
    reqs = [make_request(f"r{i}", 8, 2, arrival=i * 0.1, priority=p) for i, p in enumerate(prios)]
    run_engine(engine, [(0, r) for r in reqs])
    order = [r.request_id for r in sorted(reqs, key=lambda r: r.first_token_time)]
    assert order == ["r1", "r3", "r2", "r0", "r4"]


def test_priority_preempts_the_lowest_priority_running_request():
    engine = make_engine(num_gpu_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                         policy="priority")
    low = make_request("low", 8, 12, arrival=0.0, priority=5)
    high = make_request("high", 8, 12, arrival=1.0, priority=0)
    steps, outs = run_engine(engine, [(0, low), (1, high)])
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert high.finish_time < low.finish_time
    assert all(len(finished_tokens(outs, r)) == 12 for r in ("low", "high"))


def test_chunked_prefill_splits_a_long_prompt():
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=32)
    req = make_request("long", 100, 3)
    steps, outs = run_engine(engine, [(0, req)])
    assert [so.num_new_tokens[0] for so in steps] == [32, 32, 32, 4, 1, 1]
    assert [so.num_computed_before[0] for so in steps[:4]] == [0, 32, 64, 96]
    assert [so.num_prefill_tokens for so in steps[:4]] == [32, 32, 32, 4]
    assert [so.num_decode_tokens for so in steps] == [0, 0, 0, 0, 1, 1]
    assert req.first_token_time == 4.0, "no token before the prompt's last chunk"
    assert [len(o.new_token_ids) for o in outs["long"]] == [1, 1, 1]


def test_chunked_prefill_shares_the_budget_with_decodes():
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=16)
    short = make_request("short", 4, 6)
    long = make_request("long", 40, 2)
    steps, _ = run_engine(engine, [(0, short), (1, long)])
    got = [dict(zip((r.request_id for r in so.requests), so.num_new_tokens)) for so in steps[1:4]]
    assert got == [{"short": 1, "long": 15}] * 2 + [{"short": 1, "long": 10}], "decodes first, chunk takes the rest"


def test_no_chunked_prefill_schedules_whole_prompts():
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=128, enable_chunked_prefill=False,
                         max_model_len=128)
    a, b = make_request("a", 100, 2), make_request("b", 60, 2)
    steps, _ = run_engine(engine, [(0, a), (0, b)])
    assert [so.num_new_tokens for so in steps[:2]] == [[100], [1, 60]]


def _run_repeat(prefix_caching: bool):
    engine = make_engine(block_size=16, enable_prefix_caching=prefix_caching)
    tokens = list(range(1, 65))
    first, again = make_request("first", tokens=tokens), make_request("again", tokens=tokens)
    steps, outs = run_engine(engine, [(0, first), (10, again)])
    return engine, steps, outs, again


def test_prefix_caching_reduces_scheduled_tokens():
    engine, steps, outs, again = _run_repeat(True)
    k = first_step_of(steps, "again")
    assert steps[k].num_new_tokens == [16] and steps[k].num_computed_before == [48]
    assert again.num_cached_tokens == 48 and all(o.num_cached_tokens == 48 for o in outs["again"])
    rows = engine.records.request_columns()
    assert dict(zip(rows["request_id"], rows["cached_tokens"])) == {"first": 0, "again": 48}
    assert (engine.block_manager.prefix_queries, engine.block_manager.prefix_hits) == (128, 48)
    cached_total = sum(so.total_num_scheduled_tokens for so in steps)
    _, plain_steps, _, plain = _run_repeat(False)
    assert sum(so.total_num_scheduled_tokens for so in plain_steps) == cached_total + 48
    assert plain.num_cached_tokens == 0


def test_prefix_hit_for_request_admitted_in_the_same_step():
    engine = make_engine(block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 21))
    a, b = make_request("a", tokens=tokens), make_request("b", tokens=tokens + [99])
    steps, _ = run_engine(engine, [(0, a), (0, b)])
    assert steps[0].num_new_tokens == [20, 1] and b.num_cached_tokens == 20
    assert engine.block_manager.block_ids("a") == [] and engine.block_manager.num_used_blocks == 0


# ---- grammars compiled off the step loop (WAITING_FOR_FSM) -------------------------------------------
@given(policy=st.sampled_from(["fcfs", "priority"]), ready_after=st.integers(0, 3), n_behind=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_a_request_whose_grammar_compiles_is_passed_over_and_keeps_its_place(policy, ready_after, n_behind):
    """While its grammar compiles, a structured request waits without holding up those behind it; once
    marked ready it is admitted before anyone who arrived after it (its place in the queue is kept)."""
    from testbed.engine.params import StructuredOutputsParams
    from testbed.engine.request import RequestStatus
    engine = make_engine(max_num_seqs=1, policy=policy)
    engine.compile_grammars = True
    first = make_request("json", max_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))
    assert engine.add_request(first, 0.0) is None and first.status == RequestStatus.WAITING_FOR_FSM
    assert [r.request_id for r in engine.take_new_grammars()] == ["json"] and engine.take_new_grammars() == []
    for i in range(n_behind):
        engine.add_request(make_request(f"plain{i}", max_tokens=1, arrival=0.1 * (i + 1)), 0.0)
    executor, order = FixedTokenExecutor(), []
    for step in range(40):
        if step == ready_after:
            engine.mark_grammar_ready("json", float(step))
            engine.add_request(make_request("late", max_tokens=1, arrival=9.0), float(step))
        so, _ = engine.step(float(step), executor)
        order += [r for r in so.new_req_ids]
        if not engine.has_unfinished_requests():
            break
    admitted_before = min(ready_after, n_behind)  # one step each (max_num_seqs 1, one-token outputs)
    assert order[:admitted_before] == [f"plain{i}" for i in range(admitted_before)]
    assert order[admitted_before] == "json"  # before the rest that waited behind it, and before "late"
    assert engine.records.grammars == [("json", 0, float(ready_after), None)]


def test_a_grammar_that_fails_rejects_its_request_and_records_why():
    from testbed.engine.params import StructuredOutputsParams
    engine = make_engine()
    engine.compile_grammars = True
    engine.add_request(make_request("json", structured_outputs=StructuredOutputsParams(json_object=True)), 0.0)
    out = engine.fail_grammar("json", "structured_outputs: too slow", 1.5)
    assert (out.finished, out.finish_reason, out.stop_reason) == (True, "rejected", "structured_outputs: too slow")
    assert engine.fail_grammar("json", "again", 2.0) is None and not engine.has_unfinished_requests()
    assert engine.records.grammars == [("json", 0, 1.5, "structured_outputs: too slow")]
    assert engine.records.request_columns()["finish_reason"] == ["rejected"] and engine.scheduler.num_waiting == 0
