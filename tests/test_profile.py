"""`testbed profile` on the CPU (a smoke sweep of the bundled model: every sweep runs; then `--quick`, which rescales
that profile from anchor steps measured here), and `testbed simulate` choosing its cost model: a profile file, the shipped profile for (model, GPU, TP), or the roofline with a warning."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.profiling.profile_file import PROFILES_DIR
from testbed.sim.profiled import ProfiledCostModel
from testbed.kernels.decode_attention import num_splits_for, split_edges
from testbed.profiling.sweep import default_grid

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces/azure_conv_10min.jsonl"
SMALL = ["--max-model-len", "256", "--num-gpu-blocks", "96", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]


@pytest.mark.timeout(900)
def test_smoke_profile_on_cpu_loads_and_drives_simulate_and_quick_rescales_it(tmp_path, capsys):
    (tmp_path / "profiles").mkdir()  # a folder: the profile takes the shipped name (model, GPU, TP)
    assert main(["profile", "--load-format", "dummy", "--model", "SmolLM2-135M", *SMALL, "--smoke", "--no-progress",
                 "-o", str(tmp_path / "profiles")]) == 0
    out = tmp_path / "prof.json"
    (tmp_path / "profiles" / "SmolLM2-135M_cpu_tp1.json").rename(out)
    prof = json.loads(out.read_text())
    assert prof["format"] == "testbed-profile" and prof["model"]["name"] == "SmolLM2-135M" and prof["gpu"] == "cpu"
    assert prof["engine"]["num_gpu_blocks"] == 96 and prof["git_sha"] and prof["versions"]["torch"]
    d = prof["decode"]
    assert all(v is not None and v > 0 for row in d["wall_s"] for v in row)  # 4 x 65 tokens fit 96 blocks
    assert all(t > 0 for t in prof["engine_host"]["decode_step_s"]) and len(prof["validation"]) == 2
    assert prof["engine_host"]["method"] == "cycle"  # timed in a real stepper loop on the executor
    assert prof["async_timing"] == "steady"  # its async cycles timed in steady state (`--quick` times its anchors so)
    cm = ProfiledCostModel.from_file(out)
    assert set(cm.validate()) >= {"sync_mape", "sync_worst", "sync_steps"}
    hd = prof["host_device"]  # swap traffic: measured on this machine, and what the cost model prices it at
    assert hd["blocks"] == 48 and hd["bandwidth"] > 0 and hd["swap_out_s"] > 0 and hd["device_bandwidth"] > 0
    assert cm.moves.host_bandwidth == hd["bandwidth"] and cm.moves.block_bytes == hd["block_bytes"]
    capsys.readouterr()
    assert main(["simulate", str(SAMPLE), "--limit", "8", "--model", "SmolLM2-135M", "--gpu", "H200", *SMALL,
                 "--cost-model", str(out), "--format", "json", "--no-progress", "-o", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["cost_model"].startswith("profile prof.json (cpu")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["cost_model"] == summary["cost_model"]

    # --quick: the profile above rescaled from anchor steps measured on this machine
    quick = tmp_path / "quick.json"
    assert main(["profile", "--load-format", "dummy", "--model", "SmolLM2-135M", *SMALL, "--quick", "--cost-model",
                 str(out), "--reps", "2", "--no-progress", "-o", str(quick)]) == 0
    printed = capsys.readouterr().out
    assert "anchor measurements" in printed and "scales: host" in printed
    q = json.loads(quick.read_text())
    cal = q["calibration"]
    assert cal["method"] == "quick" and cal["base_profile"] == str(out) and cal["machine"]["device_name"]
    assert cal["machine"]["sync_anchors"] == "alone"
    assert q["decode"] == prof["decode"] and q["chunk"] == prof["chunk"]  # only the scales change
    kinds = {a["anchor"].split()[0] for a in cal["anchors"]}
    assert kinds >= {"decode", "chunk", "mixed", "engine"} and all(a["measured_s"] > 0 for a in cal["anchors"])
    for a in cal["anchors"]:  # a sync anchor keeps its StepTiming medians: which part moved on this machine
        assert ("timing" in a) == (a["mode"] == "sync")
        if a["mode"] == "sync":
            assert a["timing"]["wall_s"] == pytest.approx(a["measured_s"], abs=1e-8) and a["timing"]["prepare_s"] > 0
    sse = lambda key: sum((a[key] - a["measured_s"]) ** 2 for a in cal["anchors"])  # noqa: E731
    assert sse("predicted_after_s") <= sse("predicted_before_s")  # the fit starts from the base: never worse
    assert all(abs(a["moved"] - (a["measured_s"] / a["predicted_before_s"] - 1)) < 1e-12 for a in cal["anchors"])
    assert ProfiledCostModel.from_file(quick).scales.to_dict() == q["scales"]
    # the anchors keep their rows: fitted again on a CPU under the same cost model, the same scales and errors
    from testbed.sim.quick_rescale import refit_quick
    again, _, after = refit_quick(q)
    assert again["scales"] == q["scales"] and after == cal["error_after"]
    assert [a["predicted_after_s"] for a in again["calibration"]["anchors"]] == \
        [a["predicted_after_s"] for a in cal["anchors"]]
    with pytest.raises(ValueError, match="no rows"):
        refit_quick({**q, "calibration": {**cal, "anchors": [{k: v for k, v in a.items() if k not in
                                                              ("rows", "batch", "admit_tokens")} for a in cal["anchors"]]}})
    with pytest.raises(ValueError, match="not a `testbed profile --quick` result"):
        refit_quick(prof)
    assert main(["simulate", str(SAMPLE), "--limit", "4", "--model", "SmolLM2-135M", "--gpu", "H200", *SMALL,
                 "--cost-model", str(quick), "--format", "json", "--no-progress", "-o", str(tmp_path / "run2")]) == 0


def test_quick_rescale_refuses_a_profile_of_another_model_or_flags(tmp_path, capsys):
    from test_profiled import fake_profile  # a profile of Llama-3.2-1B
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(fake_profile()))
    base = ["profile", "--load-format", "dummy", "--model", "SmolLM2-135M", *SMALL, "--no-progress", "-o",
            str(tmp_path / "q.json")]
    assert main([*base, "--quick", "--cost-model", str(prof)]) == 2
    assert "a profile of Llama-3.2-1B, not of SmolLM2-135M" in capsys.readouterr().err
    assert main([*base, "--quick", "--smoke"]) == 2 and "give one" in capsys.readouterr().err
    assert main([*base, "--cost-model", str(prof)]) == 2 and "only --quick (the profile it rescales) and --dp-replica-host" in capsys.readouterr().err
    assert main([*base, "--quick", "--cost-model", str(tmp_path / "none.json")]) == 2
    assert "not a readable profile" in capsys.readouterr().err
    assert not (tmp_path / "q.json").exists()


def test_simulate_without_a_shipped_profile_warns_and_uses_the_roofline(tmp_path, capsys):
    assert not (PROFILES_DIR / "Llama-3.1-70B_L4_tp8.json").exists()
    assert main(["simulate", str(SAMPLE), "--limit", "5", "--model", "Llama-3.1-8B", "--gpu", "A100-80GB",
                 "--no-progress", "--format", "json", "-o", str(tmp_path / "run")]) == 0
    cap = capsys.readouterr()
    assert "warning: no profile ships for Llama-3.1-8B on A100-80GB at TP=1" in cap.err
    assert json.loads(cap.out)["cost_model"] == "roofline"


def test_profile_for_another_model_or_block_size_is_refused(tmp_path, capsys):
    from test_profiled import fake_profile  # a profile of Llama-3.2-1B with block size 16
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(fake_profile()))
    code = main(["simulate", str(SAMPLE), "--limit", "5", "--model", "Llama-3.1-8B", "--cost-model", str(prof),
                 "--no-progress", "-o", str(tmp_path / "run")])
    assert code == 2 and "profile is for Llama-3.2-1B" in capsys.readouterr().err
    code = main(["simulate", str(SAMPLE), "--limit", "5", "--model", "Llama-3.2-1B", "--block-size", "32",
                 "--cost-model", str(prof), "--no-progress", "-o", str(tmp_path / "run")])
    assert code == 2 and "--block-size 16" in capsys.readouterr().err
    code = main(["simulate", str(SAMPLE), "--limit", "5", "--cost-model", str(tmp_path / "nope.json"),
                 "--no-progress", "-o", str(tmp_path / "run")])
    assert code == 2 and "not 'auto', 'roofline', 'recorded:RUN_DIR' or an existing profile" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_smoke_profile_of_a_tensor_parallel_engine_times_its_broadcast_and_all_reduce(tmp_path, capsys):
    """TP=3 over gloo (SmolLM2 has 3 KV heads): rank 0 times the whole step, so the profile includes the
    inputs' broadcast and the row-parallel all-reduces; simulate uses it at the same TP."""
    out = tmp_path / "tp3.json"
    assert main(["profile", "--load-format", "dummy", "--model", "SmolLM2-135M", *SMALL, "--smoke", "--no-progress",
                 "-tp", "3", "-o", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["tensor_parallel_size"] == 3
    assert all(v is not None and v > 0 for row in prof["decode"]["async_cycle_s"] for v in row)  # TP pipelines steps too
    capsys.readouterr()
    assert main(["simulate", str(SAMPLE), "--limit", "4", "--model", "SmolLM2-135M", "--gpu", "H200", *SMALL, "-tp", "3",
                 "--cost-model", str(out), "--format", "json", "--no-progress", "-o", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out)  # the sample's long prompts do not fit max_model_len 256
    assert summary["num_finished"] >= 1 and summary["num_finished"] + summary["num_rejected"] == 4


@settings(max_examples=200, deadline=None)
@given(max_model_len=st.integers(512, 262144), mnbt=st.integers(1024, 65536), max_num_seqs=st.integers(1, 1024))
def test_every_row_of_the_full_sweep_has_a_point_within_max_model_len(max_model_len, mnbt, max_num_seqs):
    """A row whose every point is past max_model_len would leave a profile that cannot load (a --max-model-len
    4096 profile once swept chunks of 6144 and 8192 tokens): no chunk is longer than one sequence may be, and
    every decode context, tail and chunk fits at the row's smallest other coordinate."""
    cfg = EngineConfig(max_num_batched_tokens=mnbt, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    grid = default_grid(cfg, max_model_len, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    assert max(grid.chunk_tokens) == min(mnbt, max_model_len)
    assert all(n + min(grid.chunk_contexts) <= max_model_len for n in grid.chunk_tokens)
    assert all(c + 1 <= max_model_len for c in grid.contexts)
    assert all(0 < d and grid.tail_base + d + 1 <= max_model_len for d in grid.tail_deltas)


@settings(max_examples=200, deadline=None)
@given(kv_heads=st.integers(1, 16), sms=st.integers(1, 200), max_num_seqs=st.integers(1, 512))
def test_the_uneven_context_table_is_measured_at_both_ends_of_every_split(kv_heads, sms, max_num_seqs):
    """The extra time of one long row changes where the decode kernel's split does (2 splits at 17-32 rows of 8 KV
    heads on 132 SMs: an H200 run's async steps there were priced 6-10% long from the tail interpolated between 16
    and 33 rows): every batch size whose split differs from the next one's is a point, and so is the next one."""
    edges = split_edges(kv_heads, sms, max_num_seqs)
    splits = [num_splits_for(b, kv_heads, 1 << 20, 64, sms) for b in range(1, max_num_seqs + 1)]
    assert edges[0] == 1 and edges[-1] == max_num_seqs and edges == sorted(set(edges))
    for b in range(1, max_num_seqs):
        if splits[b - 1] != splits[b]:
            assert b in edges and b + 1 in edges
    cfg = EngineConfig(max_num_seqs=max_num_seqs)
    grid = default_grid(cfg, 8192, [1, 2, 4, 8, 16, 32, 64, 128, 256], split_batches=edges)
    assert set(grid.tail_batches) >= set(edges) and max(grid.tail_batches) == max_num_seqs


def test_engine_host_costs_in_a_real_loop_and_their_bound_on_the_kv_cache(tmp_path):
    """The engine's host work per decode step timed in a real loop on the executor: by default the stepper's cycle
    outside the runner (what a profile records from now on), or schedule + update between real steps (in_loop, as
    older profiles and their --quick anchors time it); the executor serving on afterwards, its timing switch as it
    was, whatever the number of steps timed; a batch the executor's KV cache cannot hold is refused, naming what
    to change, and so is a method that does not go with the executor given."""
    from llm_helpers import save_tiny_llama
    from testbed.engine.config import EngineConfig
    from testbed.profiling.host_costs import engine_host_costs
    from testbed.profiling.synthetic_steps import StepFactory, decode_rows
    from testbed.worker.executor import create_executor
    save_tiny_llama(tmp_path, 4, 2, seed=3)
    cfg = EngineConfig(num_gpu_blocks=64, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)
    ex = create_executor(str(tmp_path), cfg, dtype="float32")
    host = engine_host_costs(cfg, 128, [1, 4], [16], ex)
    assert host["method"] == "cycle" and host["decode_batch"] == [1, 4]
    assert len(host["decode_step_s"]) == 2 and all(t > 0 for t in host["decode_step_s"])
    assert ex.runner.record_timing is False
    assert engine_host_costs(cfg, 128, [4], [16], ex, method="in_loop")["method"] == "in_loop"
    for method in ("cycle", "in_loop"):  # more steps than a 64-token request lives (profile --quick --reps 11)
        assert len(engine_host_costs(cfg, 128, [4], [16], ex, decode_steps=70, method=method)["decode_step_s"]) == 1
    assert engine_host_costs(cfg, 128, [4], [16])["method"] == "isolated"
    for method, executor in (("isolated", ex), ("cycle", None), ("wall", ex)):
        with pytest.raises(ValueError, match="cycle and in_loop time steps on an executor, isolated without one"):
            engine_host_costs(cfg, 128, [4], [16], executor, method=method)
    out = ex.execute(StepFactory(64, 16, ex.vocab_size).step(decode_rows(2, 20)))
    assert len(out.sampled_token_ids) == 2
    with pytest.raises(ValueError, match="needs .* KV blocks, the executor has 64"):
        engine_host_costs(cfg, 128, [16], [16], ex)


def test_sync_each_times_the_steps_in_turn_after_each_ones_warm_up(tmp_path):
    """StepMeasurer.sync_each (quick_anchors.py's interleaved way of timing `--quick`'s sync anchors): every step's
    warm-up first, then rounds of one run of each step in order; each step's medians are those of its own timed runs."""
    import statistics

    from llm_helpers import save_tiny_llama
    from testbed.profiling.step_measure import TIMING_FIELDS, StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory, decode_rows
    from testbed.worker.executor import create_executor
    save_tiny_llama(tmp_path, 4, 2, seed=5)
    ex = create_executor(str(tmp_path), EngineConfig(num_gpu_blocks=64, max_model_len=128), dtype="float32")
    f = StepFactory(64, 16, ex.vocab_size)
    steps = [f.step(decode_rows(1, 20)), f.step([(0, 24, False)]), f.step(decode_rows(3, 40))]
    seen: list[tuple[str, dict]] = []
    execute = ex.execute

    def observed(so):  # the real step, its order and timing noted
        out = execute(so)
        seen.append((so.requests[0].request_id, out.timing.to_dict()))
        return out
    ex.execute = observed
    m = StepMeasurer(ex, reps=3, warmup=2)
    medians = m.sync_each(steps)
    ex.runner.record_timing = False
    first = [so.requests[0].request_id for so in steps]
    assert [rid for rid, _ in seen] == [first[0]] * 2 + [first[1]] * 2 + [first[2]] * 2 + first * 3
    timed = seen[6:]
    for i, med in enumerate(medians):
        assert set(med) == set(TIMING_FIELDS) and med["wall_s"] > 0
        own = [t for rid, t in timed if rid == first[i]]
        assert med == {k: statistics.median(t[k] for t in own) for k in TIMING_FIELDS}


def test_async_cycle_is_the_median_interval_between_completions_once_the_pipeline_is_full(tmp_path):
    """StepMeasurer.async_cycle: ASYNC_FILL completions untimed, then n + 1 completion times (one launch always in
    flight, the last one drained after them); the cycle is the median of their n intervals, so one slow step in the
    burst does not move it."""
    import statistics

    from llm_helpers import save_tiny_llama
    from testbed.profiling.step_measure import ASYNC_FILL, StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory, decode_rows
    from testbed.worker.executor import create_executor
    save_tiny_llama(tmp_path, 4, 2, seed=5)
    ex = create_executor(str(tmp_path), EngineConfig(num_gpu_blocks=64, max_model_len=128), dtype="float32")
    so = StepFactory(64, 16, ex.vocab_size).step(decode_rows(2, 20))
    launched, waited = [], []
    execute_async = ex.execute_async

    def observed(step):  # the real launch; its wait noted in order (the 9th waited for is slow)
        launched.append(len(waited))
        wait = execute_async(step)

        def done():
            wait()
            if len(waited) == ASYNC_FILL + 5:
                time.sleep(0.5)
            waited.append(len(launched))
        return done
    ex.execute_async = observed
    m = StepMeasurer(ex, reps=1, warmup=1)
    done = m.async_completions(so, n=8)
    assert len(done) == 9 and done == sorted(done)
    assert len(launched) == ASYNC_FILL + 8 + 2 and len(waited) == len(launched)  # every launch waited for
    assert waited[:-1] == list(range(2, len(launched) + 1))  # each wait after the next launch: one in flight
    assert m.runner.record_timing  # back on for the sync timings
    launched.clear()
    waited.clear()
    cycle = m.async_cycle(so)
    assert len(launched) == ASYNC_FILL + 20 + 2  # max(20, 4 * reps) intervals
    typical = statistics.median(b - a for a, b in zip(done, done[1:]))  # the first burst's, the slow one in it
    assert typical < 0.5 / 20 / 2 and cycle < 2 * typical  # the mean of the 20 would be over 0.5 / 20
    launched.clear()
    assert m.async_cycle(so, "burst") > 0 and len(launched) == 1 + 4  # profiles before: one warm, max(4, 2 * reps)
    with pytest.raises(ValueError, match="unknown async cycle timing 'mean'"):
        m.async_cycle(so, "mean")
