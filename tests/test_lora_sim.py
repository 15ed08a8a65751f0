"""LoRA in the simulator: the trace's `lora` field, the cost model's LoRA terms (compute per LoRA token, a read of
each adapter's slot, loads into slots), fast-forwarded decode stretches that keep slot decisions exact, the DP
coordinator's adapter-affinity routing, and decision parity with a real replay of a trace naming adapters."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import DPCoordinator
from testbed.engine.core import ReplicaStats
from testbed.engine.lora import LoRALoad, LoRARequest
from testbed.engine.outputs import SchedulerOutput
from testbed.sim.cluster import simulate
from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.lora_cost import LoRACost, WithLoRA
from testbed.specs.hardware import get_gpu_spec
from testbed.specs.presets import get_model_spec
from testbed.workload.trace import TraceError, TraceRequest, load_trace, write_jsonl

from test_parity import REQUEST_OUTCOMES, STEP_DECISIONS


def test_trace_field_lora_round_trips_and_bad_values_name_the_line(tmp_path):
    reqs = [TraceRequest("a", 0.0, 8, 4, lora="sql"), TraceRequest("b", 0.5, 9, 3)]
    write_jsonl(reqs, tmp_path / "t.jsonl")
    assert [r.lora for r in load_trace(tmp_path / "t.jsonl")] == ["sql", None]
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "input_tokens": 4, "output_tokens": 2}\n'
                                        '{"arrival_s": 1, "input_tokens": 4, "output_tokens": 2, "lora": 7}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: lora must be a non-empty string"):
        load_trace(tmp_path / "bad.jsonl")


def test_lora_terms_charge_adapter_tokens_and_loads_only():
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    lora = LoRACost(model, gpu, max_lora_rank=16)
    # one adapter of rank 16 on every projection of Llama-3.1-8B in bf16: 16 x (4096+4096 + 2(4096+1024) +
    # 2(4096+14336) + 4096+4096 + 14336+4096) x 2 bytes x 32 layers = 84 MB
    assert lora.adapter_bytes == 32 * 16 * (8192 + 2 * 5120 + 2 * 18432 + 8192 + 18432) * 2
    base = SchedulerOutput(total_num_scheduled_tokens=64, num_decode_tokens=64)
    assert lora.step_time(base) == 0.0
    with_tokens = SchedulerOutput(num_lora_tokens=64, num_loras=2)
    one_load = SchedulerOutput(num_lora_tokens=64, num_loras=2, lora_loads=[LoRALoad(0, LoRARequest("a", 1), False)])
    disk = SchedulerOutput(num_lora_tokens=64, num_loras=2, lora_loads=[LoRALoad(0, LoRARequest("a", 1), True)])
    assert 0 < lora.step_time(with_tokens) < lora.step_time(one_load) < lora.step_time(disk)
    assert lora.step_time(one_load) - lora.step_time(with_tokens) == pytest.approx(lora.adapter_bytes / gpu.host_bandwidth)


def test_simulate_refuses_adapters_without_enable_lora_and_more_slots_serve_faster(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_jsonl([TraceRequest(f"r{i}", 0.01 * i, 64, 24, lora=None if i % 5 == 0 else f"a{i % 4}")
                 for i in range(60)], trace)
    flags = ["--model", "Llama-3.2-1B", "--cost-model", "roofline", "--no-progress", "--format", "json"]
    assert main(["simulate", str(trace), *flags, "-o", str(tmp_path / "off")]) == 2
    err = capsys.readouterr().err
    assert "names LoRA adapter" in err and "pass --enable-lora" in err
    done = {}
    for n in (1, 4):
        assert main(["simulate", str(trace), *flags, "--enable-lora", "--max-loras", str(n), "-o",
                     str(tmp_path / f"m{n}")]) == 0
        done[n] = json.loads(capsys.readouterr().out)
    assert done[4]["output_throughput"] > 1.2 * done[1]["output_throughput"]  # one slot: the adapters take turns


@st.composite
def lora_traces(draw):
    t, out = 0.0, []
    for i in range(draw(st.integers(1, 20))):
        t += draw(st.floats(0, 0.05))
        adapter = draw(st.integers(0, 4))
        out.append(TraceRequest(f"q{i}", t, draw(st.integers(1, 200)), draw(st.integers(1, 120)),
                                lora=f"a{adapter}" if adapter else None))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lora_traces(), st.integers(1, 2), st.sampled_from(["least_loaded", "lora_affinity"]), st.integers(1, 3),
       st.integers(0, 2))
def test_fast_forwarded_lora_runs_give_the_same_records(trace, dp, dp_policy, max_loras, extra_cpu):
    cfg = EngineConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_loras + extra_cpu,
                       data_parallel_size=dp, dp_policy=dp_policy, max_num_batched_tokens=256, max_num_seqs=8)
    model, gpu = get_model_spec("Llama-3.2-1B"), get_gpu_spec("H100-SXM")
    cm = WithLoRA(RooflineCostModel(model, gpu), LoRACost(model, gpu, 16))
    runs = [simulate(trace, cfg, cm, 300, 4096, fast_forward_decodes=ff) for ff in (False, True)]
    stepped, skipped = ((r.records.steps, r.records.itl, r.records.requests, r.records.routes)
                        for r in runs)
    assert stepped == skipped
    loads = [(e.scheduler.lora.num_loads, e.scheduler.lora.num_disk_loads) for r in runs for e in r.engines]
    assert loads[:dp] == loads[dp:]


def test_lora_affinity_keeps_an_adapter_on_one_replica_until_it_is_too_loaded():
    c = DPCoordinator(2, "lora_affinity", lora_capacity=2)
    first = c.route(10, lora_id=7)
    assert [c.route(10, lora_id=7) for _ in range(2)] == [first] * 2  # 8 load units of slack: two more waiting
    assert c.route(10, lora_id=7) != first  # a third would cost more than the slack: the least loaded takes it
    c.update_stats(first, ReplicaStats(0, 0, 0.0, 1, 1, num_added=c.routed[first]))  # all of them done
    assert c.route(10, lora_id=7) == first
    assert c.route(10) == 0 and list(c.adapters[0]) == list(c.adapters[1]) == [7]  # base: least loaded, no record


@pytest.mark.smollm2
def test_simulation_replays_a_real_lora_runs_batches_exactly(tmp_path, capsys):
    """A real replay of a trace naming two adapters (one slot, so they take turns) on a tiny model, then the
    simulator on the recorded timeline: the same batches, the same outcomes."""
    from llm_helpers import save_peft_adapter, save_tiny_llama
    hf = save_tiny_llama(tmp_path / "base", 4, 2, seed=21)
    save_peft_adapter(tmp_path / "a", hf, 8, ["q_proj", "down_proj"], seed=22)
    save_peft_adapter(tmp_path / "b", hf, 8, ["v_proj", "up_proj"], seed=23)
    rows = [(0.0, 30, 6, "a"), (0.0, 20, 8, "b"), (0.0, 12, 5, None), (0.02, 40, 4, "a"), (0.05, 18, 7, "b"),
            (0.3, 25, 5, None), (0.31, 22, 6, "b")]
    write_jsonl([TraceRequest(f"r{i}", t, n, m, lora=a) for i, (t, n, m, a) in enumerate(rows)], tmp_path / "t.jsonl")
    flags = ["--max-model-len", "128", "--max-num-batched-tokens", "48", "--max-num-seqs", "4", "--num-gpu-blocks",
             "40", "--enable-lora", "--max-loras", "1", "--format", "json"]
    real, sim = tmp_path / "real", tmp_path / "sim"
    assert main(["replay", str(tmp_path / "t.jsonl"), "--model", str(tmp_path / "base"), "--dtype", "float32",
                 "--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "-o", str(real), *flags]) == 0
    capsys.readouterr()
    assert main(["simulate", str(tmp_path / "t.jsonl"), "--model", "SmolLM2-135M", "--cost-model",
                 f"recorded:{real}", "--no-progress", "-o", str(sim), *flags]) == 0
    rs, ss = pd.read_parquet(real / "steps.parquet"), pd.read_parquet(sim / "steps.parquet")
    pd.testing.assert_frame_equal(rs[STEP_DECISIONS], ss[STEP_DECISIONS])
    rr = pd.read_parquet(real / "requests.parquet").sort_values("request_id", ignore_index=True)
    sr = pd.read_parquet(sim / "requests.parquet").sort_values("request_id", ignore_index=True)
    pd.testing.assert_frame_equal(rr[REQUEST_OUTCOMES], sr[REQUEST_OUTCOMES])
    assert (rr["finish_reason"] == "length").all()
    assert rr["lora"].fillna("-").tolist() == sr["lora"].fillna("-").tolist() == ["a", "b", "-", "a", "b", "-", "b"]
    as_trace = {r.id: r.lora for r in load_trace(real)}  # a run read as a trace keeps each request's adapter
    assert [as_trace[f"r{i}"] for i in range(7)] == ["a", "b", None, "a", "b", None, "b"]


def test_the_profile_measures_lora_and_the_cost_model_charges_it(tmp_path):
    """`testbed profile --enable-lora`'s LoRA sweep on a tiny model on the CPU: the extra forward time of steps whose
    rows run an adapter, and an adapter's load from disk and from the host cache; MeasuredLoRACost charges them."""
    from llm_helpers import save_tiny_llama
    from testbed.profiling.lora_measure import measure_lora
    from testbed.profiling.step_measure import StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory
    from testbed.sim.lora_cost import MeasuredLoRACost
    from testbed.worker.executor import create_executor
    save_tiny_llama(tmp_path, 4, 2, seed=31)
    cfg = EngineConfig(enable_lora=True, max_lora_rank=8, num_gpu_blocks=64, max_model_len=128, max_num_seqs=8,
                       max_num_batched_tokens=128)
    ex = create_executor(str(tmp_path), cfg, dtype="float32")
    table = measure_lora(StepMeasurer(ex, 1, 1), StepFactory(64, 16, ex.vocab_size), ex.runner, [1, 4], [16, 48],
                         64 * 16, 1, lambda: None)
    ex.runner.record_timing = False
    assert table["max_lora_rank"] == 8 and table["load_disk_s"] > table["load_host_s"] > 0
    assert all(e is not None for kind in ("decode", "chunk") for e in table[kind]["extra_s"])
    cost = MeasuredLoRACost(table, max_lora_rank=16)  # twice the profile's rank: twice its costs
    step = SchedulerOutput(num_lora_tokens=48, num_loras=1, num_prefill_tokens=48)
    load = SchedulerOutput(lora_loads=[LoRALoad(0, LoRARequest("a", 1), True)])
    assert cost.step_time(SchedulerOutput()) == 0.0
    assert cost.step_time(step) == pytest.approx(2 * max(0.0, table["chunk"]["extra_s"][1]))
    assert cost.step_time(load) == pytest.approx(2 * table["load_disk_s"])


def test_dp_lora_affinity_replays_exactly_and_keeps_each_adapter_on_one_replica(tmp_path, capsys):
    """Two real replicas behind the coordinator with --dp-policy lora_affinity (one slot each), then the simulator on
    the recorded run: the same routes, batches and outcomes, and each adapter stayed on one replica."""
    from llm_helpers import save_peft_adapter, save_tiny_llama
    hf = save_tiny_llama(tmp_path / "base", 4, 2, seed=21)
    save_peft_adapter(tmp_path / "a", hf, 8, ["q_proj", "down_proj"], seed=22)
    save_peft_adapter(tmp_path / "b", hf, 8, ["v_proj", "up_proj"], seed=23)
    rows = [(0.0, 30, 6, "a"), (0.0, 20, 8, "b"), (0.0, 12, 5, None), (0.02, 40, 4, "a"), (0.05, 18, 7, "b"),
            (0.3, 25, 5, None), (0.31, 22, 6, "b"), (0.4, 10, 9, "a")]
    write_jsonl([TraceRequest(f"r{i}", t, n, m, lora=a) for i, (t, n, m, a) in enumerate(rows)], tmp_path / "t.jsonl")
    flags = ["--max-model-len", "128", "--max-num-batched-tokens", "48", "--max-num-seqs", "4", "--num-gpu-blocks",
             "40", "--enable-lora", "--max-loras", "1", "--format", "json", "-dp", "2", "--dp-policy", "lora_affinity"]
    real, sim = tmp_path / "real", tmp_path / "sim"
    assert main(["replay", str(tmp_path / "t.jsonl"), "--model", str(tmp_path / "base"), "--dtype", "float32",
                 "--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "-o", str(real), *flags]) == 0
    assert main(["simulate", str(tmp_path / "t.jsonl"), "--model", "SmolLM2-135M", "--cost-model", f"recorded:{real}",
                 "--no-progress", "-o", str(sim), *flags]) == 0
    capsys.readouterr()
    rs, ss = (pd.read_parquet(d / "steps.parquet").sort_values(["replica", "start"], ignore_index=True)
              for d in (real, sim))
    pd.testing.assert_frame_equal(rs[["replica", *STEP_DECISIONS]], ss[["replica", *STEP_DECISIONS]])
    rr, sr = (pd.read_parquet(d / "requests.parquet").sort_values("request_id", ignore_index=True) for d in (real, sim))
    pd.testing.assert_frame_equal(rr[["replica", *REQUEST_OUTCOMES]], sr[["replica", *REQUEST_OUTCOMES]])
    placed = rr.dropna(subset=["lora"]).groupby("lora")["replica"].nunique()
    assert (placed == 1).all() and rr.dropna(subset=["lora"])["replica"].nunique() == 2


def test_simulate_charges_the_lora_costs_a_profile_measured(tmp_path):
    """--enable-lora with a profile that carries `testbed profile --enable-lora`'s LoRA table: the simulator's cost
    model is the profile's plus those measurements (scaled to the run's --max-lora-rank), not the roofline terms;
    a profile without the table gets the roofline terms, said so in the description."""
    from test_profiled import F, fake_profile
    from testbed.profiling.synthetic_steps import decode_rows
    from testbed.sim.factory import load_cost_model
    from testbed.sim.profiled import ProfiledCostModel
    prof = fake_profile()
    prof["lora"] = {"max_lora_rank": 8, "decode": {"tokens": [1, 8], "extra_s": [1e-4, 3e-4]},
                    "chunk": {"tokens": [16, 64], "extra_s": [2e-4, 6e-4]}, "load_disk_s": 0.05, "load_host_s": 0.01}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    model, gpu = get_model_spec("Llama-3.2-1B"), get_gpu_spec("H200")
    cm, desc = load_cost_model(str(tmp_path / "p.json"), model, gpu, EngineConfig(enable_lora=True, max_lora_rank=16))
    assert "LoRA as the profile measured it (rank 8)" in desc
    base = ProfiledCostModel(prof)
    so = F.step(decode_rows(8, 128))
    assert cm.step_time(so) == base.step_time(so)  # base rows pay nothing
    so.num_lora_tokens, so.num_loras = 8, 2
    assert cm.step_time(so) - base.step_time(so) == pytest.approx(2 * 3e-4)  # rank 16: twice the rank-8 table
    so.lora_loads = [LoRALoad(0, LoRARequest("a", 1), True), LoRALoad(1, LoRARequest("b", 2), False)]
    assert cm.step_time(so) - base.step_time(so) == pytest.approx(2 * (3e-4 + 0.05 + 0.01))
    del prof["lora"]
    (tmp_path / "p.json").write_text(json.dumps(prof))
    cm, desc = load_cost_model(str(tmp_path / "p.json"), model, gpu, EngineConfig(enable_lora=True, max_lora_rank=16))
    assert "LoRA roofline terms (rank 16)" in desc and isinstance(cm.lora, LoRACost)
