"""LoRA in the engine: at most max_loras adapters per step (vLLM's rule), device slots and the host LRU
assigned by the scheduler (engine/lora.py), and LoRA refused when the engine has it off."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.engine.config import ConfigError, EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.lora import AdapterSlots, LoRARequest
from conftest import make_engine, make_request, run_engine


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_loras=st.integers(1, 3), extra_cpu=st.integers(0, 2), async_scheduling=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), max_num_seqs=st.integers(1, 6),
       reqs=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 5), st.integers(1, 30), st.integers(1, 12),
                               st.integers(0, 2)), min_size=1, max_size=14))
def test_max_loras_holds_and_everyone_finishes(max_loras, extra_cpu, async_scheduling, policy, max_num_seqs, reqs):
    """Random mixes of base rows and up to 5 adapters: every step runs at most max_loras adapters, each row in its
    adapter's slot (conftest.check_step), a slot is loaded exactly when its adapter arrives in it, and every
    request ends with all its tokens (nobody starves behind the adapter limit)."""
    engine = make_engine(num_gpu_blocks=64, max_model_len=128, enable_lora=True, max_loras=max_loras,
                         max_cpu_loras=max_loras + extra_cpu, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
                         async_scheduling=async_scheduling, policy=policy, block_size=4)
    arrivals = []
    for i, (step, adapter, prompt, out, prio) in enumerate(reqs):
        r = make_request(f"r{i}", prompt, out, arrival=float(step), priority=prio)
        r.lora_request = lora(adapter) if adapter else None
        arrivals.append((step, r))
    steps, outs = run_engine(engine, arrivals)
    held: dict[int, int] = {}  # slot -> adapter id, as the loads leave it
    host: list[int] = []
    for so in steps:
        for ld in so.lora_loads:
            held[ld.slot] = ld.lora.lora_int_id
            assert ld.from_disk or ld.lora.lora_int_id in host, "copied from the host cache, which lacks it"
            if ld.from_disk:
                host.append(ld.lora.lora_int_id)
        for d in so.lora_dropped:
            host.remove(d)
        assert len(host) <= max_loras + extra_cpu
        for r, slot in zip(so.requests, so.lora_slots):
            if r.lora_request is not None:
                assert held[slot] == r.lora_request.lora_int_id, "a row ran in a slot holding another adapter"
        assert len(set(i for r in so.requests if (i := r.lora_request and r.lora_request.lora_int_id))) <= max_loras
    for i, (_, _, _, out, _) in enumerate(reqs):
        assert sum(len(o.new_token_ids) for o in outs[f"r{i}"]) == out


def test_adapter_over_the_limit_waits_and_later_ones_pass():
    """max_loras=1: while adapter 1 runs, a request for adapter 2 waits and a base request behind it goes first."""
    engine = make_engine(enable_lora=True, max_loras=1)
    a, b, base = (make_request(n, 8, 6) for n in ("a", "b", "base"))
    a.lora_request, b.lora_request = lora(1), lora(2)
    for r in (a, b, base):
        engine.add_request(r, 0.0)
    so = engine.schedule(0.0)
    assert [r.request_id for r in so.requests] == ["a", "base"] and engine.scheduler.num_lora_deferred == 1
    assert so.lora_slots == [0, -1] and so.num_loras == 1 and so.num_lora_tokens == 8
    assert [(ld.slot, ld.lora.lora_int_id, ld.from_disk) for ld in so.lora_loads] == [(0, 1, True)]


def test_slots_and_host_lru():
    s = AdapterSlots(max_loras=2, max_cpu_loras=3)
    slots, loads, dropped = s.assign([lora(1), None, lora(2), lora(1)])
    assert slots == [0, -1, 1, 0] and [ld.slot for ld in loads] == [0, 1] and not dropped
    slots, loads, dropped = s.assign([lora(3)])  # evicts the least recently used slot (adapter 1's)
    assert slots == [0] and loads[0].from_disk and not dropped
    slots, loads, dropped = s.assign([lora(1), lora(3)])  # 1 comes back from the host cache into 2's slot
    assert slots == [1, 0] and not loads[0].from_disk
    s.assign([lora(4), lora(3)])  # a 4th adapter: the host drops its least recently used (2)
    assert list(s.host) == [1, 4, 3]
    with pytest.raises(ValueError, match="exceeds max_loras=2"):
        s.assign([lora(1), lora(3), lora(4)])


def test_lora_refused_when_off_and_bad_flags():
    engine = EngineCore(EngineConfig(), num_gpu_blocks=16, max_model_len=64)
    r = make_request("x")
    r.lora_request = lora(1)
    out = engine.add_request(r, 0.0)
    assert out.finish_reason == "rejected" and "--enable-lora" in out.stop_reason
    with pytest.raises(ConfigError, match="--max-lora-rank"):
        EngineConfig(max_lora_rank=7)
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/p")
