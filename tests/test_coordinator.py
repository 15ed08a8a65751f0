"""DPCoordinator: each routing policy's choice on hand-made replica stats."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.engine.block_manager import prompt_block_hashes
from testbed.engine.coordinator import DPCoordinator
from testbed.engine.core import ReplicaStats


def stats(waiting=0, running=0, free=100, blocks=100, waiting_tokens=0) -> ReplicaStats:
    return ReplicaStats(waiting, running, (blocks - free) / blocks, free, blocks, waiting_tokens)


def test_round_robin_cycles_whatever_the_load():
    c = DPCoordinator(3, "round_robin")
    c.update_stats(0, stats(waiting=100))
    assert [c.route(10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_scores_four_waiting_plus_running():
    c = DPCoordinator(3, "least_loaded")
    c.update_stats(0, stats(waiting=1, running=0))   # 4
    c.update_stats(1, stats(waiting=0, running=3))   # 3
    c.update_stats(2, stats(waiting=0, running=5))   # 5
    assert c.route(10) == 1                          # replica 1 now counts a pending waiting: 7
    assert c.route(10) == 0                          # 4 -> 8
    assert c.route(10) == 2                          # 5 -> 9
    assert c.pending == [1, 1, 1]
    c.update_stats(1, stats(waiting=0, running=4))   # the report replaces the pending guess: 4
    assert c.pending == [1, 0, 1] and c.route(10) == 1


def test_least_loaded_ties_go_to_the_lowest_index():
    c = DPCoordinator(4, "least_loaded")
    assert [c.route(1) for _ in range(5)] == [0, 1, 2, 3, 0], "pending counts spread a burst before any report"


def test_kv_aware_projects_waiting_prompts_onto_used_blocks():
    c = DPCoordinator(3, "kv_aware", block_size=16)
    c.update_stats(0, stats(free=20))                          # 0.80
    c.update_stats(1, stats(free=50, waiting_tokens=40 * 16))  # (50 + 40) / 100 = 0.90
    c.update_stats(2, stats(free=30, running=9))               # 0.70
    assert c.route(100 * 16) == 2                              # + 100 pending blocks -> 1.70
    assert c.route(16) == 0                                    # 0.80 -> 0.81
    assert c.route(16) == 0                                    # 0.81 < 0.90
    c.update_stats(0, stats(free=5))
    assert c.route(16) == 1


def test_kv_aware_breaks_ties_by_load():
    c = DPCoordinator(2, "kv_aware")
    c.update_stats(0, stats(free=50, running=7))
    c.update_stats(1, stats(free=50, running=2))
    assert c.route(0) == 1


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica():
    bs = 4
    c = DPCoordinator(3, "prefix_affinity", block_size=bs)
    system = list(range(100, 112))
    a = prompt_block_hashes(system + [1, 2, 3, 4], bs)
    b = prompt_block_hashes(system + [5, 6, 7, 8], bs)
    other = prompt_block_hashes([9] * 16, bs)
    first = c.route(16, a)
    assert first == 0
    assert c.route(16, other) == 1, "no shared prefix: least loaded"
    for _ in range(3):  # same system prompt: stays on replica 0 although it is the most loaded
        assert c.route(16, b) == first
    assert c.route(16, other) == 1
    assert c.route(16, ()) == 2, "no hashes: least loaded"


def test_prefix_affinity_prefers_the_longest_match_and_forgets_old_hashes():
    c = DPCoordinator(2, "prefix_affinity", block_size=4, affinity_capacity_blocks=3)
    h = prompt_block_hashes(list(range(16)), 4)      # 4 chained blocks
    assert c.route(16, h[:1]) == 0
    assert c.route(16, h[:2]) == 0
    c.update_stats(0, stats(running=50))
    assert c.route(16, h[:3]) == 0                   # 2 leading hits beat the load difference
    assert len(c.seen[0]) == 3
    c.route(16, [11, 12, 13])                        # unrelated; replica 1 is least loaded
    c.update_stats(1, stats(running=0))
    assert c.route(16, [21, 22, 23]) == 1            # capacity 3: replica 1 remembers only these
    assert list(c.seen[1]) == [21, 22, 23]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=40),
       st.sampled_from(["round_robin", "least_loaded", "kv_aware", "prefix_affinity"]))
def test_every_policy_returns_a_valid_replica_deterministically(events, policy):
    def replay():
        c = DPCoordinator(3, policy, block_size=4)
        picks = []
        for r, w, run in events:
            c.update_stats(r, stats(waiting=w, running=run, free=100 - w - run))
            picks.append(c.route(w + 1, list(range(run % 4))))
        return picks
    picks = replay()
    assert all(0 <= p < 3 for p in picks) and picks == replay()


def test_bad_arguments():
    with pytest.raises(ValueError, match="--data-parallel-size"):
        DPCoordinator(0)
    with pytest.raises(ValueError, match="--dp-policy"):
        DPCoordinator(2, "random")


def test_a_report_keeps_the_requests_it_does_not_include_pending():
    """num_added says which routed requests a report already counts; the rest stay pending, so a
    request in flight while the replica sampled its stats is counted exactly once."""
    c = DPCoordinator(2, "least_loaded", block_size=16)
    assert [c.route(32) for _ in range(4)] == [0, 1, 0, 1]
    c.update_stats(0, ReplicaStats(1, 0, 0.0, 100, 100, 32, num_added=1))  # saw the first of its two
    assert c.pending == [1, 2] and c.pending_tokens == [32, 64]
    assert c._load(0) == 4 * (1 + 1)
    c.update_stats(0, ReplicaStats(0, 2, 0.0, 96, 100, 0, num_added=2))
    assert c.pending == [0, 2] and c.pending_tokens[0] == 0
    c.update_stats(1, ReplicaStats(0, 0, 0.0, 100, 100, 0, num_added=0))   # an old report: both pending
    assert c.pending == [0, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=30), st.data())
def test_admitted_or_pending_a_request_weighs_the_same(prompts, data):
    """Whether a report shows a request waiting or it is still pending, every policy sees the same
    load and KV projection (so sim and real route alike whatever the admission timing)."""
    admitted = data.draw(st.integers(0, len(prompts)))
    a, b = DPCoordinator(1, "kv_aware", block_size=16), DPCoordinator(1, "kv_aware", block_size=16)
    for n in prompts:
        a.route(n)
        b.route(n)
    seen = prompts[:admitted]
    a.update_stats(0, ReplicaStats(len(seen), 0, 0.0, 100, 100, sum(seen), num_added=admitted))
    b.update_stats(0, ReplicaStats(0, 0, 0.0, 100, 100, 0, num_added=0))
    assert a._load(0) == b._load(0) and a._kv(0) == b._kv(0)


def test_dead_replicas_get_nothing():
    for policy in ("round_robin", "least_loaded", "kv_aware", "prefix_affinity"):
        c = DPCoordinator(3, policy)
        c.set_alive(1, False)
        assert 1 not in [c.route(16, [5]) for _ in range(6)]
        c.set_alive(0, False)
        c.set_alive(2, False)
        with pytest.raises(ValueError, match="no live"):
            c.route(16)


def test_stats_publisher_reports_changes_at_most_once_per_interval():
    from testbed.engine.coordinator import StatsPublisher
    p = StatsPublisher(0.1)
    assert p.after_update(0.0, changed=True, idle=False)
    assert not p.after_update(0.05, changed=True, idle=False)   # too soon: kept for later
    assert not p.after_update(0.08, changed=False, idle=False)
    assert p.after_update(0.11, changed=False, idle=False)      # the kept change, once due
    assert not p.after_update(0.3, changed=False, idle=False)   # nothing new
    assert not p.after_update(0.31, changed=False, idle=True)   # idle, but nothing to tell
    assert p.after_update(0.32, changed=True, idle=False)
    q = StatsPublisher(10.0)
    q.after_update(0.0, True, False)
    assert q.after_update(0.5, changed=True, idle=True), "becoming idle is reported at once"
    every = StatsPublisher(0.0)
    assert [every.after_update(t, c, False) for t, c in ((0, True), (0, False), (0, True))] == [True, False, True]
