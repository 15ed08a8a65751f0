"""The prefix-reuse bound from hash_ids: counted by hand on a small trace, and met by the simulator with a
cache that never evicts and arrivals far enough apart (the prefix cache is right)."""
from __future__ import annotations

import pytest

from testbed.engine.config import EngineConfig
from testbed.workload.prefix_reuse import prefix_reuse
from testbed.sim.run import run_simulation
from testbed.workload.trace import TraceRequest, load_trace

from conftest import REPO

SLICE = REPO / "traces" / "mooncake_synthetic_tail500.jsonl"


def req(rid: str, ids: list[int], tokens: int) -> TraceRequest:
    return TraceRequest(rid, 0.0, tokens, 4, hash_ids=ids, hash_block_size=512)


def test_bound_counts_blocks_whose_whole_prefix_came_before():
    trace = [req("a", [1, 2, 3], 1500),
             req("b", [1, 2, 9], 1536),   # shares [1, 2]: 1024 tokens
             req("c", [7, 2, 3], 1536),   # 2 and 3 follow a different first block: nothing
             req("d", [1, 2, 3], 1200),   # all three blocks came before (a): its 1200 tokens
             req("e", [1], 100)]          # a partial first block: its 100 tokens
    r = prefix_reuse(trace)
    assert (r.prompt_tokens, r.reusable_tokens) == (1500 + 1536 + 1536 + 1200 + 100, 1024 + 1200 + 100)
    assert r.hit_rate == pytest.approx(2324 / 5872)
    assert prefix_reuse([]).hit_rate == 0.0
    with pytest.raises(ValueError, match="request x has no hash_ids"):
        prefix_reuse([TraceRequest("x", 0.0, 10, 1)])


def test_the_simulator_meets_the_bound_with_an_unlimited_cache():
    trace = load_trace(SLICE, limit=150)
    trace = [r for r in trace if r.input_tokens + r.output_tokens <= 131072]
    bound = prefix_reuse(trace)
    assert bound.hit_rate > 0.3  # the slice really shares prefixes
    blocks = sum(-(-(r.input_tokens + r.output_tokens) // 16) for r in trace)
    _, s = run_simulation(str(SLICE), EngineConfig(enable_prefix_caching=True, num_gpu_blocks=blocks),
                          model="Llama-3.1-8B", gpu="H100-SXM", request_rate=0.05, limit=150, progress=False)
    hits = s["prefix_cache_hit_rate"] * bound.prompt_tokens
    assert s["prefix_cache_hit_rate"] <= bound.hit_rate
    # only the rounding of prompts whose last, partial hash block is shared: under 16 tokens per request
    assert bound.reusable_tokens - hits < 16 * len(trace)
