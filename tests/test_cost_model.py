"""Cost model: roofline sanity numbers, monotonicity, KV capacity, GPU presets."""
import math

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from testbed.engine.outputs import SchedulerOutput
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request
from testbed.specs.presets import MODEL_PRESETS, get_model_spec
from testbed.sim.cost_model import CALIBRATED, PHYSICAL, RooflineCostModel, num_gpu_blocks, rank_shape
from testbed.specs.hardware import GPU_PRESETS, GPUSpec, get_gpu_spec

L8B, L70B = get_model_spec("Llama-3.1-8B"), get_model_spec("Llama-3.1-70B")
H100 = get_gpu_spec("H100-SXM")
_REQS = [Request(f"r{i}", [1], SamplingParams(), 0.0) for i in range(1024)]


def step(prefill: list[tuple[int, int]] = (), decode: list[int] = ()) -> SchedulerOutput:
    """A step from (computed_before, new_tokens) prefill chunks and decode context lengths (KV before the token)."""
    so = SchedulerOutput()
    for before, new in prefill:
        so.num_prefill_tokens += new
        so.sum_context_tokens += before + new
        so.sum_attn_pairs += new * before + new * (new + 1) // 2
    for ctx in decode:
        so.num_decode_tokens += 1
        so.sum_context_tokens += ctx + 1
        so.sum_attn_pairs += ctx + 1
    n = len(prefill) + len(decode)
    so.requests = _REQS[:n]
    so.num_new_tokens = [new for _, new in prefill] + [1] * len(decode)
    so.total_num_scheduled_tokens = so.num_prefill_tokens + so.num_decode_tokens
    return so


# --- roofline against known numbers -------------------------------------------------------------

def test_batch1_decode_is_weight_bandwidth_bound():
    t = RooflineCostModel(L8B, H100, constants=PHYSICAL).step_time(step(decode=[1000]))
    assert 5e-3 < t < 6e-3  # ~16 GB over ~3.0 TB/s
    read = (L8B.num_params - L8B.vocab_size * L8B.hidden_size) * 2 + 1001 * L8B.kv_bytes_per_token()  # not the embedding
    assert t == pytest.approx(read / H100.mem_bandwidth, rel=1e-3)


def test_long_prefill_is_compute_bound():
    cm = RooflineCostModel(L8B, H100, constants=PHYSICAL)
    t = cm.step_time(step(prefill=[(0, 2048)]))
    assert 0.035 < t < 0.045  # ~2 * 8e9 * 2048 / 7.9e14
    matmul_params = L8B.num_params - 2 * L8B.vocab_size * L8B.hidden_size  # embedding lookup is no matmul
    assert t > 2 * matmul_params * 2048 / H100.matmul_flops > L8B.num_params * 2 / H100.mem_bandwidth


def test_decode_grows_with_batch_only_through_kv_until_compute_bound():
    cm = RooflineCostModel(L8B, H100, constants=PHYSICAL)
    t1 = cm.step_time(step(decode=[999]))
    kv_per_token_s = L8B.kv_bytes_per_token() / H100.mem_bandwidth
    for b in (2, 16, 64, 200):
        tb = cm.step_time(step(decode=[999] * b))
        assert tb - t1 == pytest.approx((b - 1) * 1000 * kv_per_token_s, rel=1e-9)
    # each request's one new KV position is all a small batch adds; a huge batch turns the linear layers compute-bound
    assert cm.step_time(step(decode=[0] * 128)) - cm.step_time(step(decode=[0])) == pytest.approx(127 * kv_per_token_s)
    big = cm.step_time(step(decode=[0] * 1024))
    assert big > 1.5 * cm.step_time(step(decode=[0]))


def test_tp2_halves_weight_time_and_adds_allreduce():
    one = RooflineCostModel(L8B, H100, constants=PHYSICAL).step_time(step(decode=[0]))
    two_free = RooflineCostModel(L8B, H100, 2, allreduce_latency_s=0, allreduce_bandwidth=1e30, constants=PHYSICAL)
    assert two_free.step_time(step(decode=[0])) == pytest.approx(one / 2, rel=1e-6)
    two = RooflineCostModel(L8B, H100, 2, constants=PHYSICAL)
    expected_ar = 2 * L8B.num_hidden_layers * (0.5 * 2 * L8B.hidden_size * 2 / H100.interconnect_bandwidth
                                               + H100.allreduce_latency_s)
    assert two.step_time(step(decode=[0])) == pytest.approx(one / 2 + expected_ar, rel=1e-6)


def test_empty_step_costs_nothing_and_overhead_is_added():
    cm = RooflineCostModel(L8B, H100, step_overhead_s=1e-3, constants=PHYSICAL)
    assert cm.step_time(SchedulerOutput()) == 0.0
    base = RooflineCostModel(L8B, H100, constants=PHYSICAL).step_time(step(decode=[5]))
    assert cm.step_time(step(decode=[5])) == pytest.approx(base + 1e-3)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["Llama-3.1-8B", "Qwen3-0.6B", "Llama-3.1-70B"]), st.sampled_from([1, 2, 8]),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 2048)), max_size=4),
       st.lists(st.integers(0, 30000), max_size=64),
       st.integers(0, 3), st.integers(1, 512), st.integers(0, 5000))
def test_more_tokens_or_context_is_never_faster(name, tp, prefill, decode, which, extra_new, extra_ctx):
    cm = RooflineCostModel(get_model_spec(name), H100, tp)
    base = step(prefill, decode)
    t = cm.step_time(base)
    if prefill and which == 0:  # a longer chunk
        more = step([(prefill[0][0], prefill[0][1] + extra_new)] + prefill[1:], decode)
    elif prefill and which == 1:  # the same chunk later in the prompt (more context)
        more = step([(prefill[0][0] + extra_ctx, prefill[0][1])] + prefill[1:], decode)
    elif decode and which == 2:  # a longer decode context
        more = step(prefill, [decode[0] + extra_ctx] + decode[1:])
    else:  # one more request
        more = step(prefill, decode + [extra_ctx])
    assert cm.step_time(more) >= t
    assert cm.step_time(more) > 0 and (t > 0) == (base.total_num_scheduled_tokens > 0)


# --- KV capacity ----------------------------------------------------------------------------------

def test_rank_shape_matches_param_count_and_splits():
    for spec in MODEL_PRESETS.values():
        assert rank_shape(spec).weight_params == spec.num_params
    r4 = rank_shape(L70B, 4)
    assert (r4.num_heads, r4.num_kv_heads) == (16, 2)
    assert rank_shape(L8B, 16).num_kv_heads == 1  # tp > kv heads: replicated
    with pytest.raises(ValueError, match="cannot split"):
        rank_shape(L8B, 3)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        rank_shape(L8B, 0)


def test_num_gpu_blocks_llama8b_h100():
    n = num_gpu_blocks(L8B, H100, 16)
    expected = (80e9 * 0.9 - L8B.num_params * 2 - 4e9) // (16 * L8B.kv_bytes_per_token())
    assert n == expected and 20_000 < n < 30_000
    assert num_gpu_blocks(L8B, H100, 16, tensor_parallel_size=2) > 2 * n  # half the KV heads, half the weights
    assert num_gpu_blocks(L8B, H100, 16, activation_reserve_bytes=0) > n
    assert num_gpu_blocks(L8B, H100, 32) == pytest.approx(n / 2, abs=1)


def test_llama70b_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"does not fit H100-SXM at tp=1.*weights 141\.1 GB"):
        num_gpu_blocks(L70B, H100, 16)
    assert num_gpu_blocks(L70B, H100, 16, tensor_parallel_size=4) > 10_000
    with pytest.raises(ValueError, match="does not fit L4"):
        num_gpu_blocks(L70B, get_gpu_spec("l4"), 16)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_gpu_blocks(L8B, H100, 16, gpu_memory_utilization=1.5)


# --- GPU presets ----------------------------------------------------------------------------------

def test_gpu_presets_and_aliases():
    assert {"H100-SXM", "H200", "A100-80GB", "L4"} <= set(GPU_PRESETS)
    for alias in ("h100", "H100-80GB", "NVIDIA H100 80GB HBM3", "h100_sxm"):
        assert get_gpu_spec(alias).name == "H100-SXM"
    assert get_gpu_spec("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert get_gpu_spec("nvidia l4").name == "L4"
    h200 = get_gpu_spec("h200")
    assert (h200.mem_bandwidth, h200.matmul_flops, h200.memory_bytes) == (4.28e12, 789e12, 141e9)
    assert H100.mem_bandwidth == pytest.approx(3.35e12 * 4.28 / 4.8) and "3.35 TB/s x 0.89" in H100.source
    for spec in GPU_PRESETS.values():
        assert spec.mem_bandwidth / spec.memory_bytes < 100 and spec.source
    with pytest.raises(ValueError, match="unknown GPU 'B200'.*H100-SXM"):
        get_gpu_spec("B200")
    with pytest.raises(ValueError, match="mem_bandwidth must be > 0"):
        GPUSpec("bad", 1, 0.0, 1.0, 1.0, 0.0)
    assert math.isclose(get_gpu_spec("L4").interconnect_bandwidth, 32e9)


def test_tp2_all_reduce_term_comes_from_the_measured_nccl_fit():
    """`simulate --tensor-parallel-size 2` on H200 charges 2 all-reduces per layer at the measured
    7.44 us + bytes / 244.8 GB/s (the engine's all-reduce inside CUDA graphs, benchmarks/tp.py), on top of half
    the TP=1 work."""
    from testbed.specs.hardware import MEASURED_ALLREDUCE_BW, MEASURED_ALLREDUCE_LATENCY_S
    m, g = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H200")
    assert (g.interconnect_bandwidth, g.allreduce_latency_s) == (MEASURED_ALLREDUCE_BW, MEASURED_ALLREDUCE_LATENCY_S)
    so = SchedulerOutput(total_num_scheduled_tokens=64, num_decode_tokens=64, sum_context_tokens=64 * 1024,
                         sum_attn_pairs=64 * 1024, requests=[None] * 64)
    tp1 = RooflineCostModel(m, g, 1, constants=PHYSICAL).step_time(so)
    tp2 = RooflineCostModel(m, g, 2, constants=PHYSICAL).step_time(so)
    per_ar = MEASURED_ALLREDUCE_LATENCY_S + 64 * m.hidden_size * 2 / MEASURED_ALLREDUCE_BW
    assert tp2 == pytest.approx(tp1 / 2 + 2 * m.num_hidden_layers * per_ar, rel=1e-9)


def test_calibrated_constants_are_the_shipped_profiles_medians_and_an_eager_step_pays_at_least_its_issue_time():
    from testbed.sim.calibrate import roofline_constants
    got = roofline_constants()
    for f in ("step_overhead_s", "eager_overhead_per_layer_s", "bandwidth_efficiency", "matmul_efficiency"):
        assert getattr(CALIBRATED, f) == pytest.approx(getattr(got, f), rel=2e-3), f
    cm = RooflineCostModel(L8B, H100)
    decode, tiny_prefill = cm.step_time(step(decode=[16])), cm.step_time(step(prefill=[(0, 16)]))
    # the shipped profiles' engine graphs its mixed steps: issuing the 8B's layers costs less than reading its weights
    assert CALIBRATED.eager_overhead_per_layer_s * L8B.num_hidden_layers < tiny_prefill - CALIBRATED.step_overhead_s
    slow_host = RooflineCostModel(L8B, H100, constants=replace(CALIBRATED, eager_overhead_per_layer_s=1e-3))
    assert slow_host.step_time(step(prefill=[(0, 16)])) == pytest.approx(1e-3 * L8B.num_hidden_layers
                                                                         + CALIBRATED.step_overhead_s)
    assert slow_host.step_time(step(decode=[16])) == pytest.approx(decode)  # a decode step issues no layers from the host
