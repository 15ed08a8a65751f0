"""The CPU path's batched paged attention (kernels/batched.py) against the per-sequence torch references.

Random steps from hypothesis: block sizes, GQA groupings (SmolLM2's 9 query / 3 KV heads and its TP=3 shard of
3 / 1 among them), decode batches with empty padding rows, and prefill steps that mix decodes, fresh prompts,
chunks after a cached prefix (prefix-cache hits) and sequences without queries.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kernels import (decode_plan, paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention,
                             paged_prefill_attention_ref, prefill_plan, rope_store_batched, rope_store_kvcache_ref,
                             step_plan)
from testbed.kernels.batched import paged_attention_batched

HEADS = [(3, 3), (1, 3), (2, 1), (1, 1), (2, 4)]  # (num_kv_heads, query heads per KV head)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the dispatching entry points take the torch path


def paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random k/v caches (every slot filled, owned or not) and block tables of shuffled block ids, padded with -1
    and one spare column."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(need, default=0) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, tables


@st.composite
def decode_steps(draw):
    return (draw(st.lists(st.integers(0, 70), min_size=1, max_size=9)), draw(st.sampled_from([1, 2, 4, 16])),
            draw(st.sampled_from(HEADS)), draw(st.sampled_from([4, 16])), draw(st.integers(0, 2 ** 16)))


@st.composite
def prefill_steps(draw):
    """(cached prefix, query length) per sequence: decodes (q_len 1), fresh prompts (ctx 0), chunks after a cached
    prefix and sequences without queries, in any order."""
    seqs = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 24)), min_size=1, max_size=7))
    if all(q == 0 for _, q in seqs):
        seqs[0] = (seqs[0][0], 1)
    return (seqs, draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from(HEADS)), draw(st.sampled_from([8, 16])),
            draw(st.integers(0, 2 ** 16)))


@settings(max_examples=60, deadline=None)
@given(decode_steps(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_batched_decode_matches_reference(step, dtype):
    seq_lens, block_size, (kv_heads, group), head_dim, seed = step
    k_cache, v_cache, tables = paged_cache(seq_lens, block_size, kv_heads, head_dim, seed, dtype)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not out[lens == 0].any(), "a padding row (seq_len 0) must give zeros"


@settings(max_examples=60, deadline=None)
@given(prefill_steps(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([1, 3, 7]))
def test_batched_prefill_matches_reference(step, dtype, query_tile):
    seqs, block_size, (kv_heads, group), head_dim, seed = step
    seq_lens = [c + q for c, q in seqs]
    k_cache, v_cache, tables = paged_cache(seq_lens, block_size, kv_heads, head_dim, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    total = sum(q for _, q in seqs)
    q = torch.randn(total, kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.25)
    out = paged_prefill_attention(q, k, v, k_cache, v_cache, cu, lens, tables, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    plan = prefill_plan(cu, tables, lens, block_size, group)  # long chunks in several query tiles
    tiled = paged_attention_batched(plan, q, k_cache, v_cache, 0.25, k, v, query_tile=query_tile)
    torch.testing.assert_close(tiled.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_one_plan_serves_every_layer_of_a_step():
    """The plan depends on the step only: built once, it gives each layer's (cache's) reference result."""
    seq_lens = [5, 33, 17]
    tables = paged_cache(seq_lens, 4, 3, 8, 0)[2]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plan = decode_plan(tables, lens, 4, 3)
    for layer in range(3):
        k_cache, v_cache, _ = paged_cache(seq_lens, 4, 3, 8, layer + 1)
        q = torch.randn(3, 9, 8)
        torch.testing.assert_close(paged_attention_batched(plan, q, k_cache, v_cache, 0.5),
                                   paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.5))


def test_batched_errors_are_clear():
    k_cache, v_cache, tables = paged_cache([9, 4], 4, 3, 8, 0)
    lens = torch.tensor([9, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="more blocks than the block table"):
        decode_plan(tables[:, :2], lens, 4, 3)
    with pytest.raises(ValueError, match="does not fit the plan"):
        paged_attention_batched(decode_plan(tables, lens, 4, 3), torch.randn(2, 6, 8), k_cache, v_cache, 1.0)
    with pytest.raises(ValueError, match="query lengths"):
        prefill_plan(torch.tensor([0, 5, 9], dtype=torch.int32), tables, torch.tensor([4, 4], dtype=torch.int32), 4, 3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=12), st.sampled_from(HEADS),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2 ** 16))
def test_step_plan_rotates_and_stores_as_the_reference(positions, heads, dtype, seed):
    """Rotary embedding and KV store through the step plan equal rope_store_kvcache_ref bit for bit, padding
    tokens (slot -1) skipped."""
    kv_heads, group = heads
    g = torch.Generator().manual_seed(seed)
    T, head_dim, block_size = len(positions), 16, 4
    cos_sin = torch.randn(256, head_dim, generator=g)
    q = torch.randn(T, kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(8 * block_size, generator=g)[:T].int()
    slots[torch.rand(T, generator=g) < 0.2] = -1
    caches = [torch.zeros(8, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    pos = torch.tensor(positions)
    lens = pos + 1
    tables = torch.arange(64, dtype=torch.int32).view(1, 64).expand(T, 64) % 8
    plan = step_plan(True, pos, slots, tables, lens.int(), None, cos_sin, caches[0], kv_heads * group, dtype)
    got = rope_store_batched(plan, q, k, v, caches[0], caches[1])
    want = rope_store_kvcache_ref(pos, q, k, v, cos_sin, caches[2], caches[3], slots)
    assert all(torch.equal(a, b) for a, b in zip([*got, *caches[:2]], [*want, *caches[2:]]))
    with pytest.raises(ValueError, match="slot_mapping"):
        step_plan(True, pos, slots + 1000, tables, lens.int(), None, cos_sin, caches[0], kv_heads * group, dtype)
