"""Synthetic steps with scattered KV blocks (benchmarks/kv_layout.py's second layout): the same shapes and block
counts as contiguous ones, every block distinct until the cache wraps, in no consecutive order; and the benchmark
times both layouts through the profiler's own measurement on a tiny model on the CPU."""
from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings, strategies as st

from testbed.engine.config import EngineConfig
from testbed.profiling.synthetic_steps import StepFactory, decode_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 400), seed=st.integers(0, 1000),
       rows=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40), st.booleans()), min_size=1, max_size=12))
def test_scattered_blocks_are_the_contiguous_ones_permuted_with_the_same_shapes(num_blocks, seed, rows):
    rows = [(max(c, 1), 1, True) if d else (c, n, False) for c, n, d in rows]
    plain = StepFactory(num_blocks, 16, 32000, seed).step(rows)
    scat = StepFactory(num_blocks, 16, 32000, seed, scattered=True).step(rows)
    assert [len(b) for b in plain.block_ids] == [len(b) for b in scat.block_ids]
    assert (plain.sum_context_tokens, plain.num_decode_tokens) == (scat.sum_context_tokens, scat.num_decode_tokens)
    ids = [i for b in scat.block_ids for i in b]
    assert all(0 <= i < num_blocks for i in ids)
    if len(ids) <= num_blocks:  # distinct until the cache wraps around, as the contiguous runs are
        assert len(set(ids)) == len(ids)
    if len(ids) == num_blocks:  # the whole cache, each block once
        assert sorted(ids) == list(range(num_blocks))


def test_scattered_rows_are_not_runs_of_consecutive_ids():
    so = StepFactory(10_000, 16, 32000, 0, scattered=True).step(decode_rows(8, 1024))
    steps = [b - a for row in so.block_ids for a, b in zip(row, row[1:])]
    assert sum(d == 1 for d in steps) < len(steps) // 10


def test_the_benchmark_times_both_layouts_on_a_tiny_model(tmp_path):
    from kv_layout import measure
    from llm_helpers import save_tiny_llama
    from testbed.worker.executor import create_executor
    save_tiny_llama(tmp_path, 4, 2, seed=5)
    cfg = EngineConfig(num_gpu_blocks=256, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    ex = create_executor(str(tmp_path), cfg, dtype="float32")
    rows = measure(ex, cfg.block_size, [(4, 64), (8, 128)], rounds=2, reps=1, warmup=1)
    assert [(r["batch"], r["context"]) for r in rows] == [(4, 64), (8, 128)]
    assert all(r["contiguous_s"] > 0 and r["scattered_s"] > 0 and r["ratio"] == r["scattered_s"] / r["contiguous_s"]
               for r in rows)
