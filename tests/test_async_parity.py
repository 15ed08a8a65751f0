"""Decision parity for `--async-scheduling`: a run's recorded schedule and update times (steps.parquet's `scheduled`,
`start`, `duration`) replayed call for call (sim/async_timeline.py) reproduce every batch, every request's outcome
and, for data parallelism, every routing and stats report.

Real async runs: the bundled SmolLM2 replayed on the CPU, and the committed runs of Llama-3.2-1B on two H200s (one
engine, and two replicas behind the coordinator, 3b145d3). An async run recorded before `scheduled` existed, and a
replay that departs from its record, are errors that say so.
"""
from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from test_dp_parity import assert_same_decisions, simulated_and_replayed
from test_parity import FLAGS, REQUEST_OUTCOMES, STEP_DECISIONS, write_trace
from testbed.cli import main
from testbed.runs.rundir import read_run

from conftest import REPO

H200_ASYNC = REPO / "benchmarks" / "results" / "dp" / "2026-11-28_3b145d3_h200x2_llama-3.2-1b_async" / "runs"
H200_ASYNC_8B = REPO / "benchmarks" / "results" / "dp" / "2026-11-28_b6e7de0_h200x2_llama-3.1-8b_async" / "runs"
BEFORE = REPO / "benchmarks" / "results" / "fidelity" / "2026-11-28_db46770_h200g_llama-3.2-1b" / "azure-80-async"


def _replay_like(run, out, capsys, *flags) -> int:
    rc = main(["simulate", "--like", str(run), "--cost-model", f"recorded:{run}", "--no-progress", "--format", "json",
               "-o", str(out), *flags])
    capsys.readouterr()
    return rc


def assert_same_calls(real, sim) -> None:
    """Every step formed alike, scheduled and updated when the run's were; every request ended alike (a served one
    at the same times)."""
    rs, ss = read_run(real).steps(), read_run(sim).steps()
    key = ["replica", "scheduled"]
    rs, ss = rs.sort_values(key, ignore_index=True), ss.sort_values(key, ignore_index=True)
    pd.testing.assert_frame_equal(rs[["replica", *STEP_DECISIONS]], ss[["replica", *STEP_DECISIONS]])
    for c in ("scheduled", "start", "duration"):
        assert ss[c].tolist() == pytest.approx(rs[c].tolist(), abs=1e-9), c
    rr = read_run(real).requests().sort_values("request_id", ignore_index=True)
    sr = read_run(sim).requests().sort_values("request_id", ignore_index=True)
    pd.testing.assert_frame_equal(rr[["replica", *REQUEST_OUTCOMES]], sr[["replica", *REQUEST_OUTCOMES]])
    served = rr["finish_reason"] != "rejected"  # a rejection ends when a loop takes the request in: not replayed
    for c in ("first_scheduled", "first_token", "finish"):
        assert sr[c][served].tolist() == pytest.approx(rr[c][served].tolist(), abs=1e-9), c


@pytest.mark.smollm2
@pytest.mark.timeout(300)
def test_a_real_async_run_replays_call_for_call(tmp_path, capsys):
    """SmolLM2 on the CPU with one step in flight: grammars compiling off the loop, prefix hits, preemptions from a
    tiny cache, the 300-token prompt rejected; the recorded replay makes the same calls at the same times."""
    from testbed.worker.smollm2 import default_model_dir
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    real, sim = tmp_path / "real", tmp_path / "sim"
    flags = [*FLAGS, "--async-scheduling"]
    assert main(["replay", str(trace), "--model", str(default_model_dir()), "-o", str(real), *flags]) == 0
    real_summary = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(trace), "--model", "SmolLM2-135M", "--cost-model", f"recorded:{real}",
                 "-o", str(sim), "--no-progress", *flags]) == 0
    sim_summary = json.loads(capsys.readouterr().out)
    assert_same_calls(real, sim)
    steps = read_run(real).steps()
    assert (steps["scheduled"] < steps["start"]).sum() > len(steps) // 2  # most were scheduled while one ran
    assert steps["num_preempted"].sum() > 0 and read_run(real).requests()["cached_tokens"].sum() > 0
    assert real_summary["num_rejected"] == sim_summary["num_rejected"] == 1
    assert sim_summary["num_finished"] == real_summary["num_finished"] == 7
    rg, sg = (read_run(d).dp_table("grammars").sort_values("request_id", ignore_index=True) for d in (real, sim))
    assert rg["request_id"].tolist() == sg["request_id"].tolist() == ["r1", "r4", "r7"]
    assert sg["ready"].tolist() == pytest.approx(rg["ready"].tolist(), abs=1e-9)


@pytest.mark.parametrize("run", [H200_ASYNC / "real-1x1-rate50", H200_ASYNC / "real-1x1-rate200",
                                 H200_ASYNC / "real-2x1-rate100", H200_ASYNC / "real-2x1-rate200",
                                 H200_ASYNC_8B / "real-1x1-rate60", H200_ASYNC_8B / "real-2x1-rate60"],
                         ids=lambda p: f"{p.parents[1].name.split('_')[3]}-{p.name}")
def test_committed_gpu_async_runs_replay_call_for_call(tmp_path, capsys, run):
    """One engine, and two replicas behind the coordinator (least_loaded), on two H200s (Llama-3.2-1B and
    Llama-3.1-8B): the replay routes every request, forms every batch and samples every report as the run did, at
    the run's times."""
    real = run
    assert _replay_like(real, tmp_path / "sim", capsys) == 0
    assert_same_calls(real, tmp_path / "sim")
    if "2x1" in run.name:
        assert_same_decisions(real, tmp_path / "sim")
    steps = read_run(real).steps()
    assert (steps["scheduled"] < steps["start"]).mean() > 0.5 and steps["num_prefill_tokens"].gt(0).sum() > 100


@pytest.mark.parametrize("dp", [1, 3])
def test_a_simulated_async_run_replays_itself(tmp_path, dp):
    a, b = simulated_and_replayed(tmp_path, async_scheduling=True, data_parallel_size=dp, max_num_seqs=6,
                                  num_gpu_blocks=200, enable_prefix_caching=True, dp_routing_delay=0.004)
    assert_same_calls(a, b)


def test_an_async_run_recorded_before_its_schedule_times_is_refused_with_the_way_out(tmp_path, capsys):
    assert "scheduled" not in read_run(BEFORE).step_column_names()
    assert main(["simulate", "--like", str(BEFORE), "--cost-model", f"recorded:{BEFORE}", "--no-progress",
                 "-o", str(tmp_path / "sim")]) != 0
    err = capsys.readouterr().err
    assert "this --async-scheduling run was recorded before steps.parquet held when each step was scheduled" in err
    assert "record it again with this version, or simulate it with a profile" in err
    assert not (tmp_path / "sim").exists()


@pytest.mark.parametrize("run", ["real-1x1-rate100", "real-2x1-rate100"])
def test_a_replay_that_departs_from_the_async_record_stops_with_a_divergence(tmp_path, capsys, run):
    """The record edited so that one step was scheduled after the step before it was updated (where the real loop
    would have found nothing to schedule): the replay says where it diverged rather than absorbing it."""
    real = tmp_path / "real"
    shutil.copytree(H200_ASYNC / run, real)
    steps = pd.read_parquet(real / "steps.parquet")
    k = int(steps.index[(steps["replica"] == 0) & (steps["scheduled"] < steps["start"])][10])
    steps.loc[k, "scheduled"] = steps.loc[k, "start"] + 1e-4  # after the update of the step before it
    steps.to_parquet(real / "steps.parquet", index=False)
    assert main(["simulate", "--like", str(real), "--cost-model", f"recorded:{real}", "--no-progress",
                 "-o", str(tmp_path / "sim")]) != 0
    assert "diverged" in capsys.readouterr().err


def test_calibrate_refuses_an_async_run_and_says_which_run_to_take(tmp_path, capsys):
    run = H200_ASYNC / "real-1x1-rate50"
    assert main(["calibrate", str(run), "-o", str(tmp_path / "cal.json")]) != 0
    err = capsys.readouterr().err
    assert "an --async-scheduling run" in err and "calibrate on a sync run of the same machine" in err
    assert not (tmp_path / "cal.json").exists()
