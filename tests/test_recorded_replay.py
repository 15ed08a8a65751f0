"""`--cost-model recorded:RUN` holds every replayed batch to the one the run recorded, starts where the run started,
and is told the requests a run directory cannot give back.

A simulated run stands in for a real one here (the same run directory schema and step records): its recorded
timeline is replayed, once as it was, once edited as a real engine's loop would have left it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from testbed.cli import main
from testbed.runs.rundir import RunDirError
from testbed.workload.trace import load_trace

MOONCAKE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_tail500.jsonl"
FLAGS = ["--model", "Llama-3.2-1B", "--gpu", "H100-SXM", "--max-model-len", "4096", "--no-progress", "--format", "json"]


def _write(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": t, "input_tokens": n_in, "output_tokens": n_out})
                            + "\n" for i, (t, n_in, n_out) in enumerate(rows)))
    return path


def _simulate(*argv) -> int:
    return main(["simulate", *map(str, argv), *FLAGS])


ROWS = [(0.0, 300, 40), (0.0, 120, 60), (0.05, 500, 30), (0.2, 80, 90), (0.21, 700, 20), (0.6, 64, 50)]


def test_a_replay_that_forms_another_batch_than_the_run_stops_there(tmp_path, capsys):
    run = tmp_path / "run"
    assert _simulate(_write(tmp_path / "t.jsonl", ROWS), "-o", run) == 0
    assert _simulate(tmp_path / "t.jsonl", "--like", run, "--cost-model", f"recorded:{run}", "-o", tmp_path / "ok") == 0
    other = _write(tmp_path / "other.jsonl", ROWS[:2] + [(0.05, 501, 30)] + ROWS[3:])  # one more prompt token
    capsys.readouterr()
    assert _simulate(other, "--like", run, "--cost-model", f"recorded:{run}", "-o", tmp_path / "no") != 0
    err = capsys.readouterr().err
    assert ("the simulation formed a batch of 3 requests, 501 prefill and 2 decode tokens, the recorded run 3 "
            "requests, 500 prefill and 2 decode tokens: its decisions diverged from the recorded run") in err
    assert not (tmp_path / "no").exists()


def test_a_replay_starts_its_first_step_where_the_run_did(tmp_path):
    """A real engine schedules its first step a moment after the first arrival; a request that came in between
    is in that step. The replay waits for the recorded start, so it forms that batch, and every later step
    starts where the run's did."""
    run = tmp_path / "run"
    assert _simulate(_write(tmp_path / "t.jsonl", ROWS), "-o", run) == 0
    real = tmp_path / "real"
    shutil.copytree(run, real)
    steps = pd.read_parquet(real / "steps.parquet")
    steps["start"] += 5e-6  # the loop's lag: request r1 (here 2 us after r0) is in the first step
    steps.to_parquet(real / "steps.parquet", index=False)
    late = _write(tmp_path / "late.jsonl", [ROWS[0], (2e-6, *ROWS[1][1:])] + ROWS[2:])
    assert _simulate(late, "--like", real, "--cost-model", f"recorded:{real}", "-o", tmp_path / "replay") == 0
    replay = pd.read_parquet(tmp_path / "replay" / "steps.parquet")
    assert replay["num_reqs"].iloc[0] == 2
    assert replay["start"].tolist() == pytest.approx(steps["start"].tolist(), abs=1e-12)
    # `testbed calibrate` replays the run the same way (its steps paired with a profile's terms)
    assert main(["calibrate", str(real), "--trace", str(late), "-o", str(tmp_path / "cal.json")]) == 0


def test_a_run_whose_requests_hit_the_prefix_cache_is_not_its_own_trace(tmp_path, capsys):
    """Its prompts are not in the run directory: read as a trace it is refused, naming the trace it served;
    `testbed calibrate` replays it with that trace (the manifest's), so the replay's batches are the run's."""
    run = tmp_path / "run"
    assert _simulate(MOONCAKE, "--limit", "60", "--request-rate", "6", "--enable-prefix-caching", "-o", run) == 0
    assert pd.read_parquet(run / "requests.parquet")["cached_tokens"].gt(0).any()
    with pytest.raises(RunDirError, match=f"hit the prefix cache.*its manifest names {MOONCAKE}"):
        load_trace(run)
    capsys.readouterr()
    assert main(["calibrate", str(run), "-o", str(tmp_path / "cal.json")]) == 0
    cal = json.loads((tmp_path / "cal.json").read_text())["calibration"]
    assert cal["trace"] == str(MOONCAKE) and cal["error_after"]["mape"] < 1e-6  # its own profile fits exactly
