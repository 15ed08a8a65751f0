"""Kernel tests: Triton (via TRITON_INTERPRET on CPU) vs torch references, and references vs dense attention."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel modules

import pytest
import torch
import triton
import triton.language as tl

from testbed.kernels import (paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention,
                             paged_prefill_attention_ref, rope_store_kvcache, rope_store_kvcache_ref, silu_and_mul,
                             silu_and_mul_ref, store_kvcache, store_kvcache_ref, use_triton)
from testbed.kernels.reference import rope_ref
from testbed.kernels.decode_attention import (MAX_BT_WIDTH, choose_num_splits, paged_decode_attention_triton,
                                              split_bt_width)
from testbed.kernels.prefill_attention import paged_prefill_attention_triton

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 32, 4, 48


@triton.jit
def _loop_probe(N, Out):
    acc = 0.0
    for _ in range(0, tl.load(N)):
        acc += 1.0
    tl.store(Out, acc)


def _interpreter_runs_loaded_loop_bounds() -> bool:
    out = torch.zeros(1)
    try:
        _loop_probe[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:
        return False
    return out.item() == 3.0


needs_loops = pytest.mark.skipif(
    not _interpreter_runs_loaded_loop_bounds(),
    reason=f"triton {triton.__version__}'s interpreter cannot loop to a bound loaded at run time (seen with 3.6 and "
           "NumPy >= 2.4); run these with triton >= 3.9, and the GPU check in benchmarks/kernels.py")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

os.environ.pop("TRITON_INTERPRET")  # set again only while this module's tests run (fixture below): other
# modules, and the servers they spawn, must keep the fast batched torch attention on CPU


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    os.environ.pop("TRITON_INTERPRET", None)


def make_paged(seq_lens, shared=((0, 3, 2),), head_dim=HEAD_DIM, dtype=torch.float32, seed=0,
               block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS):
    """Random contiguous K/V per sequence plus the same data in a paged cache with shuffled block ids.

    shared: (seq_a, seq_b, n_blocks): seq_b's first n_blocks are seq_a's (same ids, same data).
    Returns k_cache, v_cache, block_tables (padded with -1), dense [(k, v)] per sequence.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)  # garbage outside the sequences' slots
    v_cache = torch.randn(shape, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    dense = []
    for i, n in enumerate(seq_lens):
        n_blocks = -(-n // block_size)
        ids = [free.pop() for _ in range(n_blocks)]
        k = torch.randn(n, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
        v = torch.randn(n, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
        for a, b, n_shared in shared:
            if b == i:
                ids[:n_shared] = tables[a, :n_shared].tolist()
                k[:n_shared * block_size] = dense[a][0][:n_shared * block_size]
                v[:n_shared * block_size] = dense[a][1][:n_shared * block_size]
        tables[i, :n_blocks] = torch.tensor(ids, dtype=torch.int32)
        for p in range(n):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def new_kv(dense, q_lens):
    """This step's keys/values: the last q_lens[i] positions of each sequence's dense k/v, concatenated."""
    k = torch.cat([dk[len(dk) - n:] for (dk, _), n in zip(dense, q_lens)])
    v = torch.cat([dv[len(dv) - n:] for (_, dv), n in zip(dense, q_lens)])
    return k, v


def dense_causal(q, k, v, scale):
    """Naive float64 causal attention of q [n, H, D] (the last n positions) over contiguous k/v [L, Hkv, D]."""
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        s = q[:, h].double() @ k[:, h // group].double().T * scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        out[:, h] = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, h // group].double()
    return out


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- store

@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kvcache_skips_padding_and_matches_ref(slot_dtype):
    k_cache, v_cache, _, _ = make_paged([4])
    fused = torch.randn(6, 3, NUM_KV_HEADS, HEAD_DIM)  # key/value as strided views of a fused tensor
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.tensor([5, -1, 0, 191, -1, 42], dtype=slot_dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // BLOCK_SIZE, s % BLOCK_SIZE] = key[t]
            expect_v[s // BLOCK_SIZE, s % BLOCK_SIZE] = value[t]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, ref_k, ref_v, slots)
    assert torch.equal(ref_k, expect_k) and torch.equal(ref_v, expect_v)
    tri_k, tri_v = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, tri_k, tri_v, slots)
    assert torch.equal(tri_k, expect_k) and torch.equal(tri_v, expect_v)


def test_store_kvcache_casts_to_cache_dtype_and_rejects_bad_shapes():
    k_cache = torch.zeros(2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    store_kvcache(key, key, k_cache, v_cache, torch.tensor([1, 6]))
    assert torch.equal(k_cache[1, 2], key[1].half()) and torch.equal(v_cache[0, 1], key[0].half())
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, k_cache, v_cache, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="out of range"):
        store_kvcache_ref(key, key, k_cache, v_cache, torch.tensor([1, 8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_rope_store_kvcache_rotates_in_place_and_stores_rotated_keys(dtype, group):
    """The fused kernel equals rope_ref + store_kvcache_ref on strided views of a fused QKV output,
    rotates every token (padding too) and stores only real slots."""
    from testbed.worker.layers import RotaryEmbedding
    heads = NUM_KV_HEADS * group
    cos_sin = RotaryEmbedding(HEAD_DIM, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}).cos_sin_cache
    n = 5
    qkv = torch.randn(n, (heads + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, :heads * HEAD_DIM].view(n, heads, HEAD_DIM)
    k = qkv[:, heads * HEAD_DIM:(heads + NUM_KV_HEADS) * HEAD_DIM].view(n, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (heads + NUM_KV_HEADS) * HEAD_DIM:].view(n, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.tensor([0, 7, 300, 31, 511])
    slots = torch.tensor([3, -1, 17, 190, 64])
    k_cache, v_cache, _, _ = make_paged([4])
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    exp_q, exp_k = rope_store_kvcache_ref(positions, q, k, v, cos_sin, ref_k, ref_v, slots)
    assert torch.equal(exp_k, rope_ref(positions, q, k, cos_sin)[1])
    assert not torch.equal(exp_q[1:], q[1:])  # position 0 is the identity rotation
    v_before = v.clone()
    got_q, got_k = rope_store_kvcache(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    close(got_q, exp_q, dtype)
    close(got_k, exp_k, dtype)
    close(k_cache, ref_k, dtype)
    assert torch.equal(v_cache, ref_v) and torch.equal(v, v_before)


def test_rope_store_kvcache_rejects_bad_shapes():
    k_cache, v_cache, _, _ = make_paged([4])
    q, kv = torch.randn(2, NUM_KV_HEADS, HEAD_DIM), torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="positions"):
        rope_store_kvcache(torch.tensor([0, 1, 2]), q, kv, kv.clone(), torch.zeros(8, HEAD_DIM), k_cache, v_cache,
                           torch.tensor([0, 1]))


# ---------------------------------------------------------------- references vs dense

@pytest.mark.parametrize("group", [1, 3, 4])
def test_references_match_dense_attention(group):
    seq_lens = [13, 30, 1, 17]
    k_cache, v_cache, tables, dense = make_paged(seq_lens)
    num_heads, scale = NUM_KV_HEADS * group, 0.2
    q_lens = [13, 9, 1, 1]  # full prefill, chunked prefill (prefix cached), decode rows (one shares a prefix)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_new, v_new = new_kv(dense, q_lens)
    out = paged_prefill_attention_ref(q, k_new, v_new, k_cache, v_cache, cu, lens, tables, scale)
    for i, (k, v) in enumerate(dense):
        close(out[cu[i]:cu[i + 1]], dense_causal(q[cu[i]:cu[i + 1]], k, v, scale), torch.float32)
    q_dec = torch.randn(len(seq_lens), num_heads, HEAD_DIM)
    out = paged_decode_attention_ref(q_dec, k_cache, v_cache, tables, lens, scale)
    for i, (k, v) in enumerate(dense):
        close(out[i:i + 1], dense_causal(q_dec[i:i + 1], k, v, scale), torch.float32)


def test_reference_errors_are_clear():
    k_cache, v_cache, tables, _ = make_paged([5])
    q = torch.randn(1, 3, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor([5], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="q_len"):
        kv = torch.randn(7, NUM_KV_HEADS, HEAD_DIM)
        paged_prefill_attention_ref(torch.randn(7, 2, HEAD_DIM), kv, kv, k_cache, v_cache,
                                    torch.tensor([0, 7], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                                    tables, 1.0)
    with pytest.raises(ValueError, match="k/v"):
        paged_prefill_attention_ref(torch.randn(5, 2, HEAD_DIM), torch.randn(4, NUM_KV_HEADS, HEAD_DIM),
                                    torch.randn(5, NUM_KV_HEADS, HEAD_DIM), k_cache, v_cache,
                                    torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                                    tables, 1.0)


# ---------------------------------------------------------------- silu and mul

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_ref(dtype):
    x = torch.randn(3, 5, 2 * 1100).to(dtype)  # 1,100 columns: two programs per row, the second one masked
    out = silu_and_mul(x)
    assert out.shape == (3, 5, 1100) and out.dtype == dtype
    close(out, silu_and_mul_ref(x.float()), dtype)
    strided = torch.randn(4, 2 * 2 * 24)[:, ::2]  # last dim not contiguous
    close(silu_and_mul(strided), silu_and_mul_ref(strided), torch.float32)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7))


# ---------------------------------------------------------------- Triton decode

@needs_loops
@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (3, torch.float16), (4, torch.float32),
                                         (4, torch.bfloat16)])
def test_decode_triton_matches_ref_for_any_num_splits(group, dtype):
    seq_lens = [13, 30, 1, 17]
    k_cache, v_cache, tables, _ = make_paged(seq_lens, dtype=dtype)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    one = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.3, 1, block_n=16)
    assert one.dtype == dtype
    close(one, ref, dtype)
    many = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.3, 3, block_n=16)
    close(many, one, dtype)  # splits > tiles for short sequences: empty splits must not perturb the result


@needs_loops
def test_decode_dispatch_default_tiles_odd_head_dim_and_empty_rows():
    seq_lens = [29, 0, 6]
    k_cache, v_cache, tables, _ = make_paged(seq_lens, shared=(), head_dim=24)
    q = torch.randn(3, NUM_KV_HEADS * 3, 24)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    assert use_triton(q)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)  # auto num_splits, block_n 64
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@needs_loops
def test_decode_reduce_over_many_splits_and_head_dim_slices():
    """Over 64 splits (the reduce then takes two warps) and head_dim 80 (the split-launch defaults for head_dim
    over 64, and the reduce's slices of 32 of head_dim, the last one partly masked)."""
    seq_lens = [70, 5]
    k_cache, v_cache, tables, _ = make_paged(seq_lens, shared=(), head_dim=80)
    q = torch.randn(2, NUM_KV_HEADS * 4, 80)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.1)
    for splits in (2, 100):
        close(paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.1, splits), ref, torch.float32)


def test_split_bt_width_covers_splits_that_start_inside_a_block():
    assert split_bt_width(2048, 16, 16, 64) == 32  # 1 x 32768: 32 whole blocks per split
    assert split_bt_width(5, 64, 16, 3) == 4  # 7 tiles = 112 keys, from key 112: blocks 1..3, 3 entries


@needs_loops
@pytest.mark.parametrize("page,table_width,splits", [
    (64, 6, 3),  # block ids in registers; split 1 starts inside a block and spans 3 of them
    (4, 600, 2),  # a wide table: a split could span 512 entries > MAX_BT_WIDTH, so they are loaded per tile
])
def test_decode_split_block_ids_in_registers_or_per_tile(page, table_width, splits):
    seq_lens = [320, 45, 1]
    k_cache, v_cache, tables, _ = make_paged(seq_lens, shared=(), head_dim=16, block_size=page, num_blocks=100)
    tables = torch.nn.functional.pad(tables, (0, table_width - tables.shape[1]), value=-1)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * 2, 16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    assert (split_bt_width(table_width, page, 16, splits) <= MAX_BT_WIDTH) == (page == 64)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    close(paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2, splits, block_n=16), ref,
          torch.float32)


def test_choose_num_splits_fills_the_machine_only_when_needed():
    cpu = torch.device("cpu")  # 4 "SMs" -> target 8 programs
    assert choose_num_splits(64, 8, 4096, 64, cpu) == 1
    assert choose_num_splits(1, 2, 4096, 64, cpu) == 4
    assert choose_num_splits(1, 1, 100, 64, cpu) == 2  # never more splits than tiles (rounded to a power of 2)


# ---------------------------------------------------------------- Triton prefill

@needs_loops
@pytest.mark.parametrize("group,dtype", [(1, torch.float16), (3, torch.float32), (4, torch.float16)])
def test_prefill_triton_matches_ref(group, dtype):
    seq_lens = [13, 30, 1, 17]
    q_lens = [13, 9, 1, 1]  # full, chunked (last 9 of 30), a 1-token sequence, a decode row sharing a prefix
    k_cache, v_cache, tables, dense = make_paged(seq_lens, dtype=dtype)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k, v = new_kv(dense, q_lens)
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    out = paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, block_m=16, block_n=16)
    assert out.dtype == dtype
    close(out, ref, dtype)


@needs_loops
def test_prefill_dispatch_default_tiles_odd_head_dim_and_empty_chunks():
    seq_lens, q_lens = [40, 7, 21], [40, 0, 5]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, shared=((0, 2, 3),), head_dim=24)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * 4, 24)
    cu = torch.tensor([0, 40, 40, 45], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k, v = new_kv(dense, q_lens)
    out = paged_prefill_attention(q, k, v, k_cache, v_cache, cu, lens, tables, 0.25)  # defaults; pointer loads
    close(out, paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.25), torch.float32)


@needs_loops
def test_prefill_of_single_tokens_equals_decode():
    seq_lens = [9, 22]
    k_cache, v_cache, tables, dense = make_paged(seq_lens, shared=())
    q = torch.randn(2, NUM_KV_HEADS * 3, HEAD_DIM)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    k, v = new_kv(dense, [1, 1])
    pre = paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.5, block_m=16, block_n=16)
    dec = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.5, 2, block_n=16)
    close(pre, dec, torch.float32)


# ---------------------------------------------------------------- Triton prefill: cached prefix + this step's k/v

def extend_case(seq_lens, q_lens, group, dtype=torch.float32, head_dim=HEAD_DIM, shared=((0, 3, 2),), seed=1):
    """One prefill step: q, k, v as views of one fused qkv tensor (like the model's qkv split), the prefixes in the
    paged cache. The cache slots of this step's tokens hold NaN (unless some prefix reads them): the kernel must
    take those keys from k/v, and the prefix from the cache."""
    k_cache, v_cache, tables, dense = make_paged(seq_lens, shared=shared, head_dim=head_dim, dtype=dtype, seed=seed)
    heads = NUM_KV_HEADS * group
    k_new, v_new = new_kv(dense, q_lens)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(sum(q_lens), heads + 2 * NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    qkv[:, heads:heads + NUM_KV_HEADS] = k_new
    qkv[:, heads + NUM_KV_HEADS:] = v_new
    q, k, v = qkv.split([heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)

    def slot(i, p):
        return int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE

    prefix = {slot(i, p) for i, (n, m) in enumerate(zip(seq_lens, q_lens)) for p in range(n - m)}
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        for p in range(n - m, n):
            if slot(i, p) not in prefix:
                k_cache.view(-1, NUM_KV_HEADS, head_dim)[slot(i, p)] = float("nan")
                v_cache.view(-1, NUM_KV_HEADS, head_dim)[slot(i, p)] = float("nan")
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, cu, lens, tables, dense


# prefix not a multiple of the page / key tile, q_len over several tiles, 1-token rows (fresh and with a prefix),
# a shared prefix, a full prefill, a short chunk with a prefix
EXTEND_SEQ_LENS, EXTEND_Q_LENS = [45, 1, 23, 30, 19, 9], [35, 1, 1, 20, 19, 3]


def test_extend_case_reference_matches_dense_attention():
    q, k, v, k_cache, v_cache, cu, lens, tables, dense = extend_case(EXTEND_SEQ_LENS, EXTEND_Q_LENS, 3)
    assert not k.is_contiguous() and not v.is_contiguous() and k_cache.isnan().any()
    out = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    for i, (dk, dv) in enumerate(dense):
        close(out[cu[i]:cu[i + 1]], dense_causal(q[cu[i]:cu[i + 1]], dk, dv, 0.3), torch.float32)


@needs_loops
@pytest.mark.parametrize("group,dtype,knobs", [
    (4, torch.float32, dict(block_m=16, block_n=16, use_tma=True)),
    (4, torch.float32, dict(block_m=16, block_n=16, use_tma=False)),
    (3, torch.float16, dict(block_m=32, block_n=16, pack_gqa=True, short_block_m=16)),  # padded group rows
    (1, torch.bfloat16, dict(block_m=16, block_n=32, short_q=0)),  # block_m < block_n, one launch for all
    (4, torch.bfloat16, dict(block_m=32, block_n=16, short_block_n=16, num_stages=2)),  # block_m > block_n
    (2, torch.float32, dict()),  # default tiles: every sequence in one tile
])
def test_prefill_extend_matches_ref(group, dtype, knobs):
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(EXTEND_SEQ_LENS, EXTEND_Q_LENS, group, dtype)
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    out = paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, **knobs)
    assert out.dtype == dtype and not out.isnan().any()
    close(out, ref, dtype)


@needs_loops
@pytest.mark.parametrize("seq_lens,q_lens", [([37], [30]), ([8, 12], [2, 3])])  # only long / only short launch
def test_prefill_extend_single_launch_shapes(seq_lens, q_lens):
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(seq_lens, q_lens, 4, shared=())
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    close(paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, block_m=16, block_n=16),
          ref, torch.float32)


@needs_loops
@pytest.mark.parametrize("short_q", [None, 0, 4])
def test_prefill_mixes_fresh_and_cached_sequences_in_one_launch(short_q):
    # Fresh prompts (seq_len == q_len) skip the cached-prefix loops at run time; sequences with a prefix and
    # decode-like rows in the same launch still take them. None packs group 4, so one launch takes every row;
    # 4 sends rows of <= 4 queries to the short launch.
    seq_lens, q_lens = [19, 23, 33, 9, 40], [19, 1, 33, 3, 17]
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(seq_lens, q_lens, 4, shared=())
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    out = paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, block_m=32, block_n=16,
                                         short_q=short_q)
    close(out, ref, torch.float32)


def _pad_graph_layout(q, k, v, cu, lens, tables, pad_tokens: int, pad_seqs: int):
    """The layout a mixed CUDA graph runs a step in (worker/cuda_graphs.py): pad_tokens tokens after the
    step's, owned by one extra sequence with no cached token, then pad_seqs - 1 sequences with no query and
    no cached token. The padding tokens hold large finite values: a real row reading one would show."""
    g = torch.Generator().manual_seed(7)

    def more(t, n):
        return torch.cat([t, 1e3 * torch.randn((n, *t.shape[1:]), generator=g).to(t.dtype)])
    qkv_pad = [more(t.contiguous(), pad_tokens) for t in (q, k, v)]
    total = q.shape[0] + pad_tokens
    cu_pad = torch.cat([cu, torch.full((pad_seqs,), total, dtype=cu.dtype)])
    lens_pad = torch.cat([lens, torch.tensor([pad_tokens] + [0] * (pad_seqs - 1), dtype=lens.dtype)])
    tables_pad = torch.cat([tables, torch.full((pad_seqs, tables.shape[1]), 7, dtype=tables.dtype)])
    return (*qkv_pad, cu_pad, lens_pad, tables_pad)


@needs_loops
@pytest.mark.parametrize("group,knobs", [(4, dict(block_m=16, block_n=16)), (3, dict(block_m=32, block_n=16)),
                                         (1, dict(block_m=16, block_n=16, short_q=0))])
def test_prefill_in_a_padded_graph_layout_equals_the_unpadded_step(group, knobs):
    """Mixed rows with prefix hits, run as a graph pads them: every real row equals the reference on the
    unpadded step, whatever the padding tokens hold."""
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(EXTEND_SEQ_LENS, EXTEND_Q_LENS, group)
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    T = q.shape[0]
    padded = _pad_graph_layout(q, k, v, cu, lens, tables, pad_tokens=21, pad_seqs=10)
    out = paged_prefill_attention_triton(*padded[:3], k_cache, v_cache, *padded[3:], 0.3, **knobs)
    close(out[:T], ref, torch.float32)
    assert out.isfinite().all()
    live = torch.tensor([len(EXTEND_SEQ_LENS) + 1], dtype=torch.int32)  # the step's sequences and the owner
    out_live = paged_prefill_attention_triton(*padded[:3], k_cache, v_cache, *padded[3:], 0.3, num_live=live, **knobs)
    close(out_live[:T], ref, torch.float32)
    close(out_live, out, torch.float32)  # the padding's owner is computed too
    close(paged_prefill_attention_ref(*padded[:3], k_cache, v_cache, *padded[3:], 0.3)[:T], ref, torch.float32)


@needs_loops
def test_prefill_falls_back_to_pointer_loads_for_odd_layouts():
    from testbed.kernels.prefill_attention import _tma_layout_ok
    seq_lens, q_lens = [21, 6], [13, 6]
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(seq_lens, q_lens, 2, head_dim=80, shared=())
    assert not _tma_layout_ok(k, 128)  # head_dim 80: the block (128) would cover the next head
    ref = paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3)
    close(paged_prefill_attention(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3), ref, torch.float32)
    with pytest.raises(ValueError, match="use_tma"):
        paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, use_tma=True)

    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case(seq_lens, q_lens, 2, shared=())
    assert _tma_layout_ok(k, HEAD_DIM) and _tma_layout_ok(v, HEAD_DIM)  # fused-qkv views qualify
    odd = torch.empty(k.numel() + 1)[1:].view(k.shape)  # base 4 bytes past a 16-byte boundary
    odd.copy_(k)
    assert not _tma_layout_ok(odd, HEAD_DIM)
    out = paged_prefill_attention_triton(q, odd, v, k_cache, v_cache, cu, lens, tables, 0.3, block_m=16, block_n=16)
    close(out, paged_prefill_attention_ref(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3), torch.float32)


def test_prefill_rejects_bad_new_kv_and_knobs():
    q, k, v, k_cache, v_cache, cu, lens, tables, _ = extend_case([9], [4], 2, shared=())
    with pytest.raises(ValueError, match="k/v"):
        paged_prefill_attention_triton(q, k[:3], v, k_cache, v_cache, cu, lens, tables, 0.3)
    with pytest.raises(ValueError, match="k/v"):
        paged_prefill_attention_triton(q, k.half(), v, k_cache, v_cache, cu, lens, tables, 0.3)
    with pytest.raises(ValueError, match="short_q"):
        paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, 0.3, short_block_m=16, short_q=9)
