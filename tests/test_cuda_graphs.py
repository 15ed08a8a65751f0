"""The CUDA-graph layout of worker/cuda_graphs.py, on the CPU: capture sizes and the bucket a step takes,
the static buffers a step is padded into (whatever earlier steps left there), and the padded step itself
run through the model, which must give the unpadded step's hidden rows and KV cache exactly: padded
tokens store nothing and no real row attends over them. (The graphs themselves need a GPU:
benchmarks/graphs.py captures and checks them there.)"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.engine.config import ConfigError, EngineConfig
from testbed.worker.context import reset_context, set_context
from testbed.engine.capture_sizes import default_capture_sizes, padded_tokens, split_sizes
from testbed.worker.cuda_graphs import CudaGraphs, StaticInputs, pad_into
from testbed.worker.loader import build_model, init_dummy_weights
from testbed.worker.model_runner import StepInputs

BS = 4  # block size


@given(st.integers(1, 512), st.integers(1, 4), st.integers(0, 3))
def test_every_step_up_to_the_largest_size_has_a_bucket_with_bounded_padding(max_num_seqs, tokens_mult, extra):
    max_tokens = max(max_num_seqs, 256 * tokens_mult + extra * 1000)
    sizes = default_capture_sizes(max_num_seqs, max_tokens)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens)
    decode, mixed = split_sizes(config)
    assert decode[-1] == min(max_num_seqs, 512) and mixed[-1] == max_tokens and sorted(sizes) == sizes
    for t in range(1, max_tokens + 1, 7):
        bucket = padded_tokens(mixed, t)  # the graph the runner replays and the size the simulator prices
        assert bucket in mixed and (bucket - t < 32 or bucket - t <= t / 8), (t, bucket)
    assert padded_tokens(mixed, max_tokens + 1) == max_tokens + 1  # past the largest: eager, unpadded
    for b in range(1, decode[-1] + 1):
        assert next(s for s in decode if s >= b) - b < 16


def test_capture_sizes_follow_the_flag_and_bad_ones_are_refused():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, cuda_graph_sizes=[48, 4, 4, 16, 1000])
    assert config.cuda_graph_sizes == [4, 16, 48, 1000]
    assert split_sizes(config) == ([4], [4, 16, 48])
    for bad in ([], [0], [2, -1], ["8"], [True]):
        with pytest.raises(ConfigError, match="--cuda-graph-sizes"):
            EngineConfig(cuda_graph_sizes=bad)


def make_step(rng: random.Random, tables: dict, lens: dict, q_lens: list[int], width: int) -> StepInputs:
    """A flat step appending q_lens[i] tokens to sequence i (blocks taken from a shuffled pool)."""
    ids, pos, slots, cu, seq_lens, rows = [], [], [], [0], [], []
    for i, n in enumerate(q_lens):
        start = lens.get(i, 0)
        table = tables.setdefault(i, [])
        for p in range(start, start + n):
            if p // BS >= len(table):
                table.append(tables["free"].pop())
            slots.append(table[p // BS] * BS + p % BS)
            pos.append(p)
            ids.append(rng.randrange(1, 250))
        lens[i] = start + n
        cu.append(len(ids))
        seq_lens.append(lens[i])
        rows.append(table + [0] * (width - len(table)))
    i64 = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return StepInputs(i64(ids), i64(pos), i64(slots), i32(rows), i32(seq_lens), i32(cu), i64([]),
                      all(n == 1 for n in q_lens))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 60), st.integers(0, 3))
def test_a_step_is_laid_out_in_the_static_buffers_with_its_padding(q_lens, pad, junk_seed):
    T, B = sum(q_lens), len(q_lens)
    width = 32
    num_tokens, num_seqs = T + pad, B + 1 + junk_seed
    buf = StaticInputs(6 * 40 + 60, 12, width, torch.device("cpu"))  # the largest drawn step and padding fit
    g = torch.Generator().manual_seed(junk_seed)
    for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.block_tables, buf.seq_lens, buf.cu_seqlens_q):
        t.copy_(torch.randint(0, 1000, t.shape, generator=g))  # what earlier, larger steps left
    tables = {"free": list(range(400))}
    random.Random(junk_seed).shuffle(tables["free"])
    x = make_step(random.Random(0), tables, {}, q_lens, 11)
    pad_into(buf, x, num_tokens, num_seqs)
    assert torch.equal(buf.input_ids[:T], x.input_ids) and torch.equal(buf.positions[:T], x.positions)
    assert torch.equal(buf.slot_mapping[:T], x.slot_mapping) and (buf.slot_mapping[T:num_tokens] == -1).all()
    assert torch.equal(buf.block_tables[:B, :11], x.block_tables)
    assert buf.cu_seqlens_q[:num_seqs + 1].tolist() == x.cu_seqlens_q.tolist() + [num_tokens] * (num_seqs - B)
    assert buf.seq_lens[:num_seqs].tolist() == x.seq_lens.tolist() + [pad] + [0] * (num_seqs - B - 1)
    with pytest.raises(ValueError, match="does not fit"):
        pad_into(buf, x, T - 1 if T > 1 else 0, num_seqs)
    with pytest.raises(ValueError, match="does not fit"):
        pad_into(buf, x, num_tokens, B)  # no room for the padding's owner


TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0)


def attach_cache(model, num_blocks: int) -> list[torch.Tensor]:
    caches = []
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(num_blocks, BS, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
        caches += [attn.k_cache, attn.v_cache]
    return caches


@torch.inference_mode()
def test_a_padded_mixed_step_equals_the_unpadded_one_and_stores_nothing_else():
    """Three steps (prompts, then a mix of chunks with prefix hits, decodes and a fresh prompt, then
    decodes): each run eagerly on one cache and padded into a graph's buffers on another copy, as
    CudaGraphs.replay lays it out (the bucket it picks); hidden rows and stored tokens must match, and no other
    cache slot may change."""
    model = build_model(TINY, torch.float32, "cpu")
    init_dummy_weights(model, 0)
    cache = attach_cache(model, 96)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, block_size=BS)
    graphs = CudaGraphs(model, config, 256, torch.device("cpu"))
    rng, tables, lens = random.Random(1), {"free": list(range(96))}, {}
    random.Random(2).shuffle(tables["free"])
    for q_lens in ([13, 6, 1], [9, 1, 1, 22], [1, 1, 1, 1]):
        x = make_step(rng, tables, lens, q_lens, 64)
        before = [c.clone() for c in cache]
        set_context(x.is_decode, x.slot_mapping, x.block_tables, x.seq_lens, x.cu_seqlens_q)
        try:
            eager = model(x.input_ids, x.positions)
        finally:
            reset_context()
        after_eager = [c.clone() for c in cache]
        for c, b in zip(cache, before):
            c.copy_(b)
        fit = graphs.size_for(x)
        assert fit is not None
        is_decode, n = fit
        seqs = n if is_decode else graphs.num_seqs(n)
        assert n > x.input_ids.numel() or is_decode  # these steps are padded
        pad_into(graphs.buf, x, n, seqs, is_decode)
        graphs.buf.set_context(is_decode, n, seqs)
        try:
            padded = model(graphs.buf.input_ids[:n], graphs.buf.positions[:n])
        finally:
            reset_context()
        T = x.input_ids.numel()
        assert torch.allclose(padded[:T], eager, atol=1e-5, rtol=1e-5), (q_lens, (padded[:T] - eager).abs().max())
        assert padded.isfinite().all()
        real = torch.zeros(cache[0].shape[0] * BS, dtype=torch.bool)
        real[x.slot_mapping.long()] = True
        for c, e, b in zip(cache, after_eager, before):  # the real tokens' slots as eagerly (the CPU path's batched
            flat, want, old = (t.view(-1, *t.shape[2:]) for t in (c, e, b))  # sums differ in the last bits)
            assert torch.equal(flat[~real], old[~real]), "a padded token was stored"
            assert torch.allclose(flat[real], want[real], atol=1e-5, rtol=1e-5), "a real token was not stored"
    # more sequences than max_num_seqs (a synthetic step, never a scheduled one) fit no mixed graph: eager
    x = make_step(rng, tables, {}, [1] * 8 + [3], 64)
    assert graphs.size_for(x) is None
