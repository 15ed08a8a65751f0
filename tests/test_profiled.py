"""The profiled cost model: its tables interpolate what was measured, its terms compose as documented, its
validation and loading errors; the non-negative fit it uses for host work."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from testbed.profiling.profile_file import ProfileError
from testbed.sim.profiled import ProfiledCostModel, fit_nonnegative, nnls
from testbed.profiling.synthetic_steps import StepFactory, decode_rows
from testbed.sim.environment import landing
from testbed.sim.tables import RowPieces, Table1D, Table2D

BS = 16
CONTEXTS = [16, 128, 1024, 8192]
BATCHES = [1, 2, 3, 4, 5, 8, 9, 16]
CHUNKS = [16, 64, 256, 1024]
CHUNK_CTX = [0, 1024, 8192]
ROWS = [1, 4, 16]


# A made-up GPU whose every measured quantity is a known function of the step: the profile below is what
# `testbed profile` would record on it, so the model's predictions can be checked exactly.
def dec_fwd(b, c): return 1e-3 + 2e-5 * b + 1e-9 * b * c
def dec_sample(b): return 5e-5 + 1e-6 * b
def prep(rows, tokens, blocks): return 2e-5 + 3e-6 * rows + 1e-7 * tokens + 2e-8 * blocks
def linear(t): return 8e-4 + 3e-6 * t
def chunk_attn(n, c): return 1e-5 + 4e-12 * n * (c + n / 2)
def rows_attn(b, c): return 1e-5 + 2e-9 * b * c
LAUNCH, OUT_S, GAP = 3e-4, 2e-5, 1e-5


def fake_profile(with_async: bool = True) -> dict:
    def timing(prepare, gpu_fwd, sample, launch=LAUNCH):
        return {"prepare_s": prepare, "launch_s": launch, "wait_s": 0.0, "output_s": OUT_S, "forward_s": gpu_fwd,
                "sample_s": sample, "wall_s": prepare + max(launch, gpu_fwd + sample) + OUT_S + GAP}

    def grid(rows, cols, fn, keys):
        out = {k: [[None] * len(cols) for _ in rows] for k in keys}
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                for k, v in fn(r, c).items():
                    out[k][i][j] = v
        return out

    keys = ("prepare_s", "launch_s", "wait_s", "output_s", "forward_s", "sample_s", "wall_s")

    def dec(b, c):
        t = timing(prep(b, b, b * -(-(c + 1) // BS)), dec_fwd(b, c), dec_sample(b), launch=1e-4)
        t["async_cycle_s"] = max(t["forward_s"] + t["sample_s"], t["prepare_s"] + 1e-4 + OUT_S) if with_async else None
        return t

    def chunk(n, c):
        t = timing(prep(1, n, -(-(n + c) // BS)), linear(n) + chunk_attn(n, c), dec_sample(1))
        return {**t, "attention_s": chunk_attn(n, c)}

    def rows(b, c):
        att = rows_attn(b, c) + chunk_attn(16, 0)
        t = timing(prep(b + 1, b + 16, b * -(-(c + 1) // BS) + 1), linear(b + 16) + att, dec_sample(b + 1))
        return {**t, "attention_s": att}

    return {
        "format": "testbed-profile", "version": 1, "model": {"name": "Llama-3.2-1B"}, "gpu": "H200",
        "tensor_parallel_size": 1, "engine": {"block_size": BS, "max_num_seqs": 16},
        "decode": {"batch": BATCHES, "context": CONTEXTS, **grid(BATCHES, CONTEXTS, dec, keys + ("async_cycle_s",))},
        "chunk": {"tokens": CHUNKS, "context": CHUNK_CTX, **grid(CHUNKS, CHUNK_CTX, chunk, keys + ("attention_s",))},
        "decode_rows": {"batch": ROWS, "context": CONTEXTS, "chunk": 16,
                        **grid(ROWS, CONTEXTS, rows, keys + ("attention_s",))},
        "engine_host": {"decode_batch": [1, 8, 16], "decode_step_s": [1e-5, 8e-5, 1.6e-4],
                        "admit_tokens": [16, 1024], "admit_step_s": {"plain": [1e-5 + 1e-6, 1e-5 + 6.4e-5],
                                                                     "prefix_caching": [1e-5 + 2e-6, 1e-5 + 1.28e-4]}},
        "validation": [],
    }


F = StepFactory(1 << 20, BS, 32000)


def test_decode_steps_are_the_measured_steps_at_grid_points_and_interpolate_between():
    cm = ProfiledCostModel(fake_profile())
    for b in BATCHES:
        for c in CONTEXTS:
            so = F.step(decode_rows(b, c))
            want = cm.engine_step(b) + fake_profile()["decode"]["wall_s"][BATCHES.index(b)][CONTEXTS.index(c)]
            assert cm.step_time(so) == pytest.approx(want, rel=1e-9)
    # linear in context between grid points: the decode forward is linear in b*c, so interpolation is exact
    so = F.step(decode_rows(4, 4608))
    lo, hi = cm.step_time(F.step(decode_rows(4, 1024))), cm.step_time(F.step(decode_rows(4, 8192)))
    assert cm.step_time(so) == pytest.approx(lo + (hi - lo) * (4608 - 1024) / (8192 - 1024), rel=1e-9)
    # a batch between two measured ones (same graph bucket) is interpolated along the batch
    mid = cm.step_time(F.step(decode_rows(12, 128)))
    assert cm.step_time(F.step(decode_rows(9, 128))) < mid < cm.step_time(F.step(decode_rows(16, 128)))


def test_a_step_with_a_chunk_pays_the_linear_work_of_the_mixed_graph_it_is_padded_to():
    """The runner pads a step with a prefill chunk to the smallest mixed capture size >= its tokens
    (engine/capture_sizes.py), so its linear layers do that size's work; the profile's points are read at the
    sizes they were padded to when measured. A profile that records no mixed graphs (--enforce-eager, or made
    before they were recorded) is not padded."""
    prof = fake_profile()
    sizes = [1, 2, 4, 8, 16, 17, 20, 32, 64, 256, 400, 1024]  # every measured step's tokens is one: no pad then
    graphed = ProfiledCostModel({**prof, "mixed_graph_sizes": sizes})
    plain = ProfiledCostModel(prof)
    so = F.step(decode_rows(3, 1024) + [(1024, 256, False), (0, 64, False)])  # 323 tokens: padded to 400
    assert graphed.linear(400) == pytest.approx(linear(400))
    assert graphed.explain(so)["linear layers"] == pytest.approx(linear(400))
    assert graphed.step_time(so) == pytest.approx(plain.step_time(so) + linear(400) - linear(323), rel=1e-9)
    # the simulated engine's own sizes replace the profiled engine's; a profile without any stays unpadded
    other = ProfiledCostModel({**prof, "mixed_graph_sizes": sizes}, mixed_graph_sizes=[16, 330, 1024])
    assert other.explain(so)["linear layers"] == pytest.approx(linear(330))
    assert ProfiledCostModel(prof, mixed_graph_sizes=[16, 330, 1024]).step_time(so) == plain.step_time(so)
    # a measured point padded when it ran is read at its padded size: the profile's 17- and 20-token mixed steps
    # (decode rows beside a 16-token chunk) ran in a 32-token graph of an engine without those two sizes
    coarse = ProfiledCostModel({**prof, "mixed_graph_sizes": [16, 32, 64, 256, 1024]})
    assert coarse.linear.xs[:3] == [16, 32, 64]


def test_async_decode_is_the_longer_of_device_and_host():
    cm = ProfiledCostModel(fake_profile(), async_scheduling=True)
    so = F.step(decode_rows(8, 1024))
    host = prep(8, 8, 8 * 65) + 1e-4 + OUT_S + cm.engine_step(8)
    device = dec_fwd(8, 1024) + dec_sample(8)
    assert cm.step_time(so) == pytest.approx(max(device, host), rel=1e-9)
    assert cm.step_time(so) < ProfiledCostModel(fake_profile()).step_time(so)  # overlap hides the host work


def test_eager_step_composes_linear_attention_sampler_and_host():
    cm = ProfiledCostModel(fake_profile())
    assert cm.prep_coef == pytest.approx([2e-5, 3e-6, 1e-7, 2e-8], rel=1e-6)
    assert cm.eager_launch == pytest.approx(LAUNCH) and cm.sync_gap == pytest.approx(GAP)
    # 3 decodes at context 1024 and two chunks: 256 new after 1024 cached, 64 new at 0 (both finish their prompt)
    so = F.step(decode_rows(3, 1024) + [(1024, 256, False), (0, 64, False)])
    T = 3 + 256 + 64
    # rows_attn in the table includes one 16-token chunk; each chunk adds its attention above that floor
    attn = (rows_attn(3, 1024) + chunk_attn(16, 0)) + (chunk_attn(256, 1024) - chunk_attn(16, 0)) \
        + (chunk_attn(64, 0) - chunk_attn(16, 0))
    device = linear(T) + attn + dec_sample(5)
    host = prep(5, T, so.sum_context_tokens / BS + 2.5)
    engine = cm.engine_step(5) + cm.admit["plain"](so.num_prefill_tokens)
    want = engine + host + max(LAUNCH, device) + OUT_S + GAP
    assert cm.step_time(so) == pytest.approx(want, rel=1e-6)
    terms = cm.explain(so)
    assert terms["kind"] == "eager" and terms["total"] == cm.step_time(so)
    assert terms["attention"] == pytest.approx(attn, rel=1e-6) and terms["linear layers"] == pytest.approx(linear(T))
    # prefix caching makes admission dearer, per the measured per-token cost
    cached = ProfiledCostModel(fake_profile(), enable_prefix_caching=True)
    assert cached.step_time(so) > cm.step_time(so)


def host_timed(prof: dict, floor: float = 5e-3) -> dict:
    """The profile as hooks that timed the host's issue would record it: every attention module timing at least
    `floor` (a graphed profile's 16-token chunk then spends "more than its forward" in attention)."""
    for tab in ("chunk", "decode_rows"):
        prof[tab]["attention_s"] = [[None if a is None else max(a, floor) for a in row] for row in prof[tab]["attention_s"]]
    return prof


def test_attention_the_host_timed_is_taken_from_the_forward():
    """Where the module timings exceed what the device spends (host issue), the attention comes from the
    forward: its growth with context, and its own slope for the part at the first context. On the made-up GPU
    the eager steps then cost what they cost with true timings, where the host-timed ones overprice them."""
    from testbed.sim import attention_split
    true, bogus = ProfiledCostModel(fake_profile()), host_timed(fake_profile())
    assert not attention_split.implausible(fake_profile()["chunk"], fake_profile()["decode_rows"])
    assert attention_split.implausible(bogus["chunk"], bogus["decode_rows"])
    chunk_attn_s, rows_attn_s = attention_split.from_forward(bogus["chunk"], bogus["decode_rows"])
    for tab, derived in (("chunk", chunk_attn_s), ("decode_rows", rows_attn_s)):
        for fwd_row, a_row in zip(fake_profile()[tab]["forward_s"], derived):
            assert all(0.0 <= a <= f for f, a in zip(fwd_row, a_row))
            assert [a - a_row[0] for a in a_row] == pytest.approx([f - fwd_row[0] for f in fwd_row], abs=1e-12)
    cm = ProfiledCostModel(bogus)
    assert cm.attention_source.startswith("the forward") and true.attention_source == "module timings"
    for rows in ([(0, 64, False)], [(1024, 256, False)], decode_rows(3, 1024) + [(1024, 256, False), (0, 64, False)],
                 decode_rows(12, 4096) + [(0, 16, False)], [(8192, 1024, False)]):
        so = F.step(rows)
        assert cm.step_time(so) == pytest.approx(true.step_time(so), rel=0.02), rows
    so = F.step(decode_rows(3, 1024) + [(0, 64, False)])
    assert ProfiledCostModel(host_timed(fake_profile(), 5e-2)).step_time(so) == pytest.approx(true.step_time(so), rel=0.02)


def test_longer_contexts_and_chunks_never_cost_less():
    cm = ProfiledCostModel(fake_profile())
    base = cm.step_time(F.step([(0, 512, False)]))
    assert cm.step_time(F.step([(4096, 512, False)])) > base
    assert cm.step_time(F.step([(0, 2048, False)])) > base
    assert cm.step_time(F.step([])) == 0.0


def test_validation_reports_composition_error():
    prof = fake_profile()
    cm = ProfiledCostModel(prof)
    rows = [[1024, 1, True]] * 3 + [[0, 300, False]]
    so = F.step([tuple(r) for r in rows])
    exact = cm.step_time(so, 0.0)
    prof["validation"] = [{"rows": rows, "wall_s": exact, "async_cycle_s": None},
                          {"rows": rows, "wall_s": exact / 1.1, "async_cycle_s": None}]
    v = ProfiledCostModel(prof).validate()
    assert v["sync_steps"] == 2 and v["sync_mape"] == pytest.approx(0.05, rel=1e-6)
    assert v["sync_worst"] == pytest.approx(0.1, rel=1e-6) and "async_mape" not in v


def test_bad_profiles_are_refused_with_the_file_name(tmp_path):
    with pytest.raises(ProfileError, match="not a testbed profile"):
        ProfiledCostModel({"format": "other"})
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match=f"{p}: not a JSON profile"):
        ProfiledCostModel.from_file(p)
    bad = fake_profile()
    del bad["chunk"]["attention_s"]
    p.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=f"{p}: malformed profile"):
        ProfiledCostModel.from_file(p)
    with pytest.raises(ProfileError, match="no such profile"):
        ProfiledCostModel.from_file(tmp_path / "missing.json")


def test_tables_interpolate_fill_holes_and_extrapolate():
    t = Table1D([1, 2, 4], [1.0, 2.0, 4.0])
    assert t(3) == 3.0 and t(8) == 8.0 and t(0.5) == 0.5
    grid = Table2D([1, 4], [10, 20, 40], [[1.0, 2.0, None], [4.0, None, None]])
    assert grid(1, 40) == pytest.approx(4.0)  # hole extrapolated along the row (linear in context)
    assert grid(4, 20) == 4.0  # a row with one measured point is flat
    assert grid(2, 10) == pytest.approx(2.0)  # rows interpolated along the batch
    assert grid(7, 10) == pytest.approx(7.0)  # past the last row: the last two rows' slope
    with pytest.raises(ValueError, match="no measured point"):
        Table2D([1], [1, 2], [[None, None]])


def test_block_moves_are_charged_at_the_host_link_the_profile_measured():
    """Swap preemption's and copy-on-write's KV block moves: each swapped block crosses the host link at the
    bandwidth `testbed profile` measured (its host_device section), a copied one is read and written at the
    measured device bandwidth; a profile without that measurement prices them at its GPU preset's, and one that
    records no model shape refuses to price them."""
    from testbed.specs.hardware import get_gpu_spec
    prof = fake_profile()
    prof["model"].update(num_key_value_heads=8, num_hidden_layers=16, hidden_size=2048, num_attention_heads=32)
    prof["host_device"] = {"bandwidth": 5e9, "device_bandwidth": 2e12}
    block = BS * 2 * 16 * 8 * 64 * 2  # K and V of 16 tokens, 16 layers, 8 KV heads of 64, bf16
    so = F.step(decode_rows(4, 1024))
    plain = ProfiledCostModel(prof).step_time(so)
    so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy = [(0, 0), (1, 1)], [(2, 5)], [(3, 4)]
    assert ProfiledCostModel(prof).step_time(so) - plain == pytest.approx(3 * block / 5e9 + 2 * block / 2e12, rel=1e-9)
    del prof["host_device"]
    h200 = get_gpu_spec("H200")
    assert ProfiledCostModel(prof).step_time(so) - plain == pytest.approx(
        3 * block / h200.host_bandwidth + 2 * block / h200.mem_bandwidth, rel=1e-9)
    with pytest.raises(ProfileError, match="cannot be priced"):
        ProfiledCostModel(fake_profile()).step_time(so)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 40), st.integers(1, 6))
def test_nnls_satisfies_kkt(seed, m, n):
    rng = np.random.default_rng(seed)
    A, b = rng.standard_normal((m, n)), rng.standard_normal(m)
    x = nnls(A, b)
    w = A.T @ (b - A @ x)  # minus the gradient
    assert (x >= 0).all() and (w <= 1e-8).all() and np.allclose(w[x > 0], 0, atol=1e-8)


def test_fit_nonnegative_recovers_a_nonnegative_model_and_clips_a_negative_one():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(50), rng.uniform(1, 100, 50), rng.uniform(1, 1e4, 50)])
    assert fit_nonnegative(X.tolist(), (X @ [1e-3, 2e-5, 3e-8]).tolist()) == pytest.approx([1e-3, 2e-5, 3e-8], rel=1e-6)
    coef = fit_nonnegative(X.tolist(), (X @ [1e-3, -2e-5, 3e-8]).tolist())
    assert min(coef) >= 0 and coef[1] == 0.0


def test_uneven_contexts_add_the_measured_tail():
    """A decode step whose longest row is `skew` tokens past the mean costs the even step plus the tail measured
    for that skew (one long row keeps attention busy after the rest are done)."""
    prof = fake_profile()
    tail = lambda b, d: 1e-8 * d  # noqa: E731 - the made-up GPU's tail: 10 ns per token of skew
    deltas, tb = [1024, 8192], [1, 4, 16]
    mean = lambda b, d: 256 + d / b  # noqa: E731
    wall = [[prof["decode"]["wall_s"][0][0]] * 2 for _ in tb]  # placeholders, replaced below
    cm0 = ProfiledCostModel(prof)
    for i, b in enumerate(tb):
        for j, d in enumerate(deltas):
            wall[i][j] = cm0.dec_wall(b, mean(b, d)) + tail(b, d)
    prof["decode_tail"] = {"batch": tb, "delta": deltas, "base": 256, "wall_s": wall,
                           "async_cycle_s": [[None] * 2 for _ in tb]}
    cm = ProfiledCostModel(prof)
    rows = decode_rows(7, 300) + decode_rows(1, 5000)
    so = F.step(rows)
    c = so.sum_context_tokens / 8 - 1
    skew = 5000 - c
    assert cm.step_time(so) == pytest.approx(cm.engine_step(8) + cm.dec_wall(8, c) + tail(8, skew), rel=1e-6)
    assert cm.explain(so)["uneven contexts"] == pytest.approx(tail(8, skew), rel=1e-6)
    even = F.step(decode_rows(8, round(c)))
    assert cm.step_time(even) < cm.step_time(so)


NEAR_PIECE_ENDS = [max(1, c + d) for c in CONTEXTS + [256, 512, 2048, 4096] for d in (-30, -3, -1, 0, 1)]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["fake", "shipped"]), st.integers(1, 300), st.integers(0, 3),
       st.integers(1, 20_000) | st.sampled_from(NEAR_PIECE_ENDS), st.integers(0, 30_000) | st.sampled_from([0, 1, 7]),
       st.booleans(), st.sampled_from([1.0, 0.8, 1.3]), st.sampled_from([1.0, 1.2]))
def test_decode_steps_are_step_time_bit_for_bit(which, b, structured, ctx, skew, async_scheduling, host, decode):
    """decode_steps(B, structured) prices successive decode-only steps from the first one's (sum_context_tokens,
    max_context_tokens) alone (what a fast-forwarded stretch has): the same floats as step_time of each step, also
    where the contexts cross from one measured column to the next; or None where step_time takes another path."""
    prof = fake_profile() if which == "fake" else json.loads(
        open("testbed/profiling/profiles/Llama-3.2-1B_H100-SXM_tp1.json").read())
    prof["scales"] = {"host": host, "decode": decode}
    cm = ProfiledCostModel(prof, async_scheduling=async_scheduling)
    structured = min(structured, b)
    f = cm.decode_steps(b, structured)
    if f is None:
        assert b > cm.graph_max or (async_scheduling and not structured and cm.dec_async is not None)
        return
    times = ends = None
    end = 1234.5678  # given a start, the steps' ends where simulated time places them
    for k in range(40):
        rows = decode_rows(b - 1, ctx + k) + decode_rows(1, ctx + skew + k) if b > 1 else decode_rows(1, ctx + skew + k)
        so = F.step(rows)
        so.num_structured_reqs = structured
        if times is None:
            times, ends = f(so.sum_context_tokens, so.max_context_tokens), f(so.sum_context_tokens,
                                                                              so.max_context_tokens, end)
        assert next(times) == cm.step_time(so)
        end = landing(end, cm.step_time(so))
        assert next(ends) == end


@given(st.lists(st.floats(-100, 10_000, allow_nan=False), min_size=1, max_size=30), st.integers(1, 40))
def test_a_row_piece_is_the_table_lookup(cs, r):
    """RowPieces gives the linear piece a lookup interpolates on: the same value anywhere inside it."""
    t = Table2D([1, 4, 16], [0, 16, 128, 1024, 8192],
                [[1.0, 2.0, None, 5.0, 9.0], [2.0, None, 4.0, 8.0, 20.0], [3.0, 5.0, 9.0, None, 40.0]])
    pieces = RowPieces(t, r)
    for c in cs:
        lo, hi, y0, dy, x0, dx = pieces.piece(c)
        assert lo < c <= hi
        for x in (c, hi if hi < 1e9 else c + 1e5, (lo + c) / 2 if lo > -1e9 else c - 1e5):
            v = y0 + dy * (x - x0) / dx
            assert (v if v > 0.0 else 0.0) == t(r, x)
