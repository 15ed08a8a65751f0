"""Swap preemption in the engine: the CPU block pool keeps the block manager's invariants under random
add/abort/preempt sequences, swapped requests keep their KV (checked by content) and resume before waiting
ones, a full CPU pool falls back to recompute, and the counts reach the step records and the summary."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from testbed.engine.metrics import summarize
from conftest import FIXED_TOKEN, KVCheckingExecutor, make_engine, make_request, run_engine


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 14), num_cpu_blocks=st.integers(0, 30),
       async_scheduling=st.booleans(), prefix=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       reqs=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 10), st.integers(1, 12), st.integers(0, 2),
                               st.none() | st.integers(0, 30)), min_size=2, max_size=8))
def test_swap_keeps_both_pools_consistent_and_every_output_exact(block_size, num_blocks, num_cpu_blocks,
                                                                 async_scheduling, prefix, policy, reqs):
    mml = num_blocks * block_size
    engine = make_engine(num_blocks, mml, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=16,
                         preemption_mode="swap", num_cpu_blocks=num_cpu_blocks, async_scheduling=async_scheduling,
                         enable_prefix_caching=prefix, policy=policy)
    arrivals, aborts, want = [], [], {}
    for i, (step, prompt, out, prio, abort) in enumerate(reqs):
        req = make_request(f"r{i}", tokens=[7] * 3 + [100 + i] * prompt, max_tokens=out, arrival=float(step),
                           priority=prio)
        arrivals.append((step, req))
        if abort is not None:
            aborts.append((step + abort, req.request_id))
        want[req.request_id] = None if 3 + prompt + out > mml else out
    steps, outs = run_engine(engine, arrivals, KVCheckingExecutor(block_size), max_steps=5000, aborts=aborts)
    sched, bm = engine.scheduler, engine.block_manager
    event(f"swapped {sched.num_swap_preemptions > 0}, recomputed {sched.num_preemptions > sched.num_swap_preemptions}")
    for rid, n in want.items():
        last = outs[rid][-1]
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        if n is None:
            assert last.finish_reason == "rejected"
        elif last.finish_reason != "abort":
            assert last.finish_reason == "length" and tokens == [FIXED_TOKEN] * n
    # every block swapped out came back, unless its request was aborted while swapped out
    assert sched.num_swapped_in_blocks <= sched.num_swapped_out_blocks
    assert aborts or sched.num_swapped_in_blocks == sched.num_swapped_out_blocks
    assert bm.num_used_blocks == 0 and bm.num_used_cpu_blocks == 0 and not sched.swapped
    bm.check_invariants()
    cols = engine.records.step_columns()
    assert cols["blocks_swapped_out"].sum() == sched.num_swapped_out_blocks
    assert cols["num_swapped_out"].sum() == sched.num_swap_preemptions


def _pressure(mode: str, num_cpu_blocks: int | None = 64):
    """Four 8-token prompts generating 24 tokens each on 12 blocks of 4: they cannot all stay."""
    engine = make_engine(12, 64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode,
                         num_cpu_blocks=num_cpu_blocks)
    arrivals = [(0, make_request(f"r{i}", prompt_len=8, max_tokens=24)) for i in range(4)]
    steps, outs = run_engine(engine, arrivals, KVCheckingExecutor(4))
    assert all([t for o in outs[f"r{i}"] for t in o.new_token_ids] == [FIXED_TOKEN] * 24 for i in range(4))
    engine.block_manager.check_invariants()
    return engine, steps


def test_swap_keeps_progress_that_recompute_throws_away():
    rec, rec_steps = _pressure("recompute", 0)
    swap, swap_steps = _pressure("swap")
    assert rec.scheduler.num_preemptions > 0 and swap.scheduler.num_swap_preemptions == swap.scheduler.num_preemptions > 0
    # recompute schedules the preempted prompts and outputs again; swap computes every token once
    assert sum(so.total_num_scheduled_tokens for so in swap_steps) == 4 * (8 + 23)
    assert sum(so.total_num_scheduled_tokens for so in rec_steps) > 4 * (8 + 23)
    out = sum(len(so.blocks_to_swap_out) for so in swap_steps)
    assert out == sum(len(so.blocks_to_swap_in) for so in swap_steps) == swap.scheduler.num_swapped_out_blocks > 0
    summary = summarize(swap.records.request_columns(), swap.records.step_columns(), swap.records.itl)
    assert summary["num_swap_preemptions"] == summary["num_preemptions"] > 0
    assert summary["num_blocks_swapped_out"] == summary["num_blocks_swapped_in"] == out
    assert max(swap.records.step_columns()["num_swapped"]) >= 1


def test_a_full_cpu_pool_falls_back_to_recompute_and_says_so():
    engine, steps = _pressure("swap", num_cpu_blocks=2)  # a victim holds more than 2 blocks
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swap_preemptions == 0 and sched.num_swapped_out_blocks == 0
    summary = summarize(engine.records.request_columns(), engine.records.step_columns(), engine.records.itl)
    assert summary["num_swap_preemptions"] == 0 and summary["num_preemptions"] == sched.num_preemptions


def test_swapped_requests_resume_before_waiting_ones_are_admitted():
    engine = make_engine(8, 64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap",
                         num_cpu_blocks=16)
    a, b = make_request("a", prompt_len=12, max_tokens=16), make_request("b", prompt_len=12, max_tokens=16)
    late = make_request("late", prompt_len=4, max_tokens=2, arrival=8.0)  # arrives while b is swapped out
    steps, outs = run_engine(engine, [(0, a), (0, b), (8, late)], KVCheckingExecutor(4))
    swap_out = next(i for i, so in enumerate(steps) if so.blocks_to_swap_out)
    back = next(i for i, so in enumerate(steps) if so.blocks_to_swap_in)
    first_late = next(i for i, so in enumerate(steps) if any(r.request_id == "late" for r in so.requests))
    assert swap_out < 8 < back <= first_late  # late waits while b is swapped out, b comes back first
    assert "b" in steps[back].new_req_ids  # resumed: runners see it as (re)scheduled
    assert outs["late"][-1].finish_reason == "length"


def test_a_shortage_waits_for_a_request_its_in_flight_token_ends_rather_than_swap_it_out():
    """With a step in flight, the request at the back of the queue is ending by its in-flight token: a shortage
    in front of it waits a step for its blocks instead of swapping them out for nothing (hypothesis found this:
    4 blocks swapped out, never back in, their request finished while swapped)."""
    engine = make_engine(14, 28, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="swap",
                         num_cpu_blocks=4, async_scheduling=True, enable_prefix_caching=True)
    arrivals = [(0, make_request("r0", tokens=[7] * 3 + [100], max_tokens=1, arrival=0.0))]
    arrivals += [(1, make_request(f"r{i}", tokens=[7] * 3 + [100 + i] * p, max_tokens=m, arrival=1.0))
                 for i, p, m in ((1, 9, 6), (2, 1, 5), (3, 1, 5))]
    steps, outs = run_engine(engine, arrivals, KVCheckingExecutor(2))
    assert all([t for o in outs[r.request_id] for t in o.new_token_ids] == [FIXED_TOKEN] * r.max_tokens
               for _, r in arrivals)
    assert engine.scheduler.num_preemptions == 0 and not any(so.blocks_to_swap_out for so in steps)
    engine.block_manager.check_invariants()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layers=st.integers(1, 3), num_blocks=st.integers(2, 12), num_cpu=st.integers(1, 12),
       chunk=st.integers(1, 5), staged=st.booleans())
def test_the_cache_engine_moves_each_block_whole_in_any_order_and_chunk(data, layers, num_blocks, num_cpu, chunk,
                                                                       staged):
    """The worker's block moves (gathered and scattered per layer, on a GPU through a staging buffer of `chunk`
    blocks and one copy per run of CPU blocks, on the CPU straight into the pool) against moving every block's
    K and V of every layer one by one: the same device and CPU contents after a random step of swap out, swap
    in and copy on write."""
    import torch

    from testbed.worker.cache_engine import CacheEngine
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1 << 16)))
    caches = [tuple(torch.randn(num_blocks, 2, 3, 4, generator=g) for _ in range(2)) for _ in range(layers)]
    want = [tuple(t.clone() for t in kv) for kv in caches]
    engine = CacheEngine(caches, num_cpu, staged=staged)
    engine.chunk = chunk
    cpu_want = torch.zeros_like(engine.cpu_cache)
    perm = lambda n, k: data.draw(st.permutations(range(n)))[:k]  # noqa: E731  k distinct ids in random order
    k = data.draw(st.integers(0, min(num_blocks, num_cpu)))
    out = list(zip(perm(num_blocks, k), perm(num_cpu, k)))
    back = list(zip(perm(num_cpu, k), perm(num_blocks, k)))
    j = data.draw(st.integers(0, num_blocks // 2))
    ids = perm(num_blocks, 2 * j)
    cow = list(zip(ids[:j], ids[j:]))
    engine.run(out, back, cow)  # one step's moves: out, in, copy, in that order (in may refill a block out read)
    for d, c in out:
        for layer, kv in enumerate(want):
            for w, t in enumerate(kv):
                cpu_want[c, layer, w] = t[d]
    for c, d in back:
        for layer, kv in enumerate(want):
            for w, t in enumerate(kv):
                t[d] = cpu_want[c, layer, w]
    for s, d in cow:
        for kv in want:
            for t in kv:
                t[d] = t[s]
    assert torch.equal(engine.cpu_cache, cpu_want)
    assert all(torch.equal(a, b) for kv, kw in zip(caches, want) for a, b in zip(kv, kw))
