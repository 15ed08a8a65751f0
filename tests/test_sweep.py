"""testbed.sweep: rows in the order of the configurations, the same table whatever the pool, every
configuration checked before the first simulation, and a failing one reported without losing the others."""
from __future__ import annotations

import multiprocessing

import pandas as pd
import pytest

from testbed import sweep
from testbed.runs.rundir import read_run
from testbed.sim.sweeps import SweepError, grid

from conftest import REPO

TRACE = REPO / "traces" / "azure_conv_10min.jsonl"
BASE = {"model": "Llama-3.2-1B", "gpu": "H100-SXM", "limit": 60, "num_gpu_blocks": 2000, "max_num_seqs": 16}


def configs() -> list[dict]:
    return [{**BASE, **c} for c in grid(max_num_batched_tokens=[256, 2048], request_rate=[4.0, 40.0])]


def test_grid_varies_the_last_axis_fastest():
    assert grid(a=[1, 2], b=["x", "y"]) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"},
                                            {"a": 2, "b": "y"}]
    with pytest.raises(ValueError, match="'b' has no values"):
        grid(a=[1], b=[])


def test_rows_follow_the_configurations_and_do_not_depend_on_the_pool(tmp_path):
    serial = sweep(configs(), TRACE)
    assert list(serial["max_num_batched_tokens"]) == [256, 256, 2048, 2048]
    assert list(serial["request_rate"]) == [4.0, 40.0, 4.0, 40.0]
    assert serial["error"].isna().all() and (serial["num_finished"] == 60).all()
    # the knobs matter (a table of identical rows would pass the comparisons below)
    assert serial.loc[1, "ttft_s.p99"] > serial.loc[3, "ttft_s.p99"]
    parallel = sweep(configs(), TRACE, jobs=2, output=tmp_path / "runs")
    assert list(parallel["run_dir"]) == [str(tmp_path / "runs" / f"{i:03d}") for i in range(4)]
    pd.testing.assert_frame_equal(parallel.drop(columns="run_dir"), serial.drop(columns="run_dir"))
    with multiprocessing.get_context("spawn").Pool(2) as pool:  # any pool with an ordered map (Ray's has one)
        pooled = sweep(configs(), TRACE, pool=pool)
    pd.testing.assert_frame_equal(pooled, serial)
    summary = read_run(tmp_path / "runs" / "002").summary
    assert summary["ttft_s"]["p99"] == parallel.loc[2, "ttft_s.p99"]


@pytest.mark.timeout(300)
def test_a_sweep_runs_on_a_ray_cluster(ray_cluster):
    """Ray's multiprocessing pool on a real (local) cluster: the same table as in this process."""
    import ray
    from ray.util.multiprocessing import Pool
    try:
        with Pool(processes=2, ray_address=ray_cluster) as pool:
            on_ray = sweep(configs(), TRACE, pool=pool)
    finally:
        ray.shutdown()
    pd.testing.assert_frame_equal(on_ray, sweep(configs(), TRACE))


def test_settings_columns_hold_the_values_used_and_like_takes_a_runs_cache(tmp_path):
    first = sweep([{**BASE, "name": "src", "request_rate": 5.0}], TRACE, output=tmp_path)
    table = sweep([{**BASE, "num_gpu_blocks": None, "like": str(tmp_path / "src"), "name": "copy"},
                   {"model": "Llama-3.2-1B", "limit": 30, "policy": "priority", "name": "other"}], TRACE)
    assert list(table["policy"]) == ["fcfs", "priority"]  # the default where a configuration left it out
    assert list(table["limit"]) == [60, 30] and table["like"].isna().tolist() == [False, True]
    copied = read_run(tmp_path / "src").summary
    assert table.loc[0, "num_finished"] == copied["num_finished"]
    assert table.loc[0, "ttft_s.p99"] != table.loc[1, "ttft_s.p99"]
    assert first.loc[0, "name"] == "src"


def test_bad_configurations_fail_before_any_simulation(tmp_path):
    out = tmp_path / "runs"
    cases = [([{**BASE, "max_batched_tokens": 4}], "unknown setting.*'max_batched_tokens'"),
             ([{**BASE, "max_num_seqs": 0}], r"configs\[0\]: --max-num-seqs"),
             ([{**BASE, "slo_ttft": -1.0}], r"configs\[0\]: --slo-ttft"),
             ([{**BASE, "trace": str(tmp_path / "missing.jsonl")}], "does not exist"),
             ([{**BASE, "name": "a/b"}], "plain folder name"),
             ([{**BASE, "name": "x"}, {**BASE, "name": "x"}], "share the name"),
             ([BASE, {**BASE, "like": str(tmp_path / "nope")}], r"configs\[1\]: like=.* is not a run directory")]
    for cfgs, message in cases:
        with pytest.raises(ValueError, match=message):
            sweep(cfgs, TRACE, output=out)
        assert not out.exists()  # nothing ran
    with pytest.raises(ValueError, match="no trace"):
        sweep([BASE])
    with pytest.raises(ValueError, match="jobs must be"):
        sweep([BASE], TRACE, jobs=0)


def test_a_failing_configuration_keeps_the_others(tmp_path):
    bad = {**BASE, "cost_model": str(tmp_path / "no-such-profile.json"), "name": "bad"}
    with pytest.raises(SweepError, match=r"1 of 2 configurations failed; the first, 'bad': ValueError: --cost-model") as e:
        sweep([{**BASE, "name": "good"}, bad], TRACE, jobs=2, output=tmp_path / "runs")
    rows = e.value.results
    assert list(rows["name"]) == ["good", "bad"]
    assert pd.isna(rows.loc[0, "error"]) and rows.loc[0, "num_finished"] == 60
    assert read_run(rows.loc[0, "run_dir"]).summary["num_finished"] == 60
    assert not (tmp_path / "runs" / "bad").exists()


def test_simulator_warnings_land_in_their_row(tmp_path):
    table = sweep([{**BASE, "max_model_len": 512}, BASE], TRACE)
    assert "requests were rejected" in table.loc[0, "warnings"] and table.loc[0, "num_rejected"] > 0
    assert table.loc[1, "warnings"] == ""
