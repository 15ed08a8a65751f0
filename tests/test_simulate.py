"""Sim mode end to end: determinism, the run directory schema, summary vs records, DP policies,
prefix caching on Mooncake, rejections, and every trace format through `testbed simulate`."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.engine.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from testbed.runs.rundir import FILES, read_run
from testbed.sim.run import run_simulation
from testbed.workload.trace import load_trace

from conftest import REPO

SAMPLE = REPO / "traces" / "azure_conv_10min.jsonl"
FORMATS = REPO / "traces" / "formats"


def simulate(tmp_path, name="run", trace=SAMPLE, *, limit=200, model="Llama-3.1-8B", request_rate=None, **cfg):
    run_dir, summary = run_simulation(str(trace), EngineConfig(**cfg), model=model, limit=limit,
                                      request_rate=request_rate, output=tmp_path / name, progress=False)
    return run_dir, summary


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(["simulate", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def head(src, dst, n: int):
    with open(src) as f:
        dst.write_text("".join(next(f) for _ in range(n)))
    return dst


# ---- determinism and the run directory ----------------------------------------------------------------
def test_same_seed_gives_byte_identical_summary(tmp_path):
    kw = dict(limit=300, num_gpu_blocks=400, max_num_seqs=32, request_rate=8.0, seed=3)
    a, _ = simulate(tmp_path, "a", **kw)
    b, _ = simulate(tmp_path, "b", **kw)
    assert (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
    pd.testing.assert_frame_equal(read_run(a).requests(), read_run(b).requests())
    pd.testing.assert_frame_equal(read_run(a).steps(), read_run(b).steps())
    c, _ = simulate(tmp_path, "c", **{**kw, "seed": 4})  # the seed drives the re-timed arrivals
    assert (c / "summary.json").read_bytes() != (a / "summary.json").read_bytes()


def test_run_directory_has_the_documented_files_and_columns(tmp_path):
    run_dir, summary = simulate(tmp_path, limit=50, seed=7)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(FILES)
    run = read_run(run_dir)
    assert list(run.requests().columns) == list(REQUEST_COLUMNS)
    assert list(run.steps().columns) == list(STEP_COLUMNS)
    assert run.summary == json.loads(json.dumps(summary))
    m = run.manifest
    assert m["mode"] == "sim" and m["seed"] == 7 and m["config"]["seed"] == 7
    assert m["trace"]["num_requests"] == 50 and m["model"]["name"] == "Llama-3.1-8B" and m["num_gpu_blocks"] > 0


def test_summary_matches_the_parquet_records(tmp_path):
    run_dir, s = simulate(tmp_path, limit=300, num_gpu_blocks=250, max_num_seqs=32)
    req, steps = read_run(run_dir).requests(), read_run(run_dir).steps()
    trace = load_trace(SAMPLE, limit=300)
    assert len(req) == s["num_requests"] == len(trace) and set(req.request_id) == {t.id for t in trace}
    done = req[req.finish_reason.isin(["stop", "length"])]
    assert s["num_finished"] == len(done) and s["num_rejected"] == (req.finish_reason == "rejected").sum() > 0
    assert s["num_preemptions"] == steps.num_preempted.sum() == req.preemptions.sum() > 0
    assert s["ttft_s"]["mean"] == pytest.approx(np.mean(done.first_token - done.arrival), rel=1e-12)
    assert s["e2e_s"]["p50"] == pytest.approx(np.percentile(done.finish - done.arrival, 50), rel=1e-12)
    assert s["e2e_s"]["p99"] == pytest.approx(np.percentile(done.finish - done.arrival, 99), rel=1e-12)
    assert s["total_output_tokens"] == done.output_tokens.sum()
    assert s["makespan_s"] == pytest.approx(done.finish.max() - req.arrival.min())
    assert s["output_throughput"] == pytest.approx(done.output_tokens.sum() / s["makespan_s"])
    assert s["num_steps"] == len(steps) and s["busy_time_s"] == pytest.approx(steps.duration.sum())
    assert s["kv_util_max"] == pytest.approx((steps.kv_blocks_used / steps.kv_blocks_total).max())
    assert (steps.kv_blocks_used <= steps.kv_blocks_total).all() and (steps.kv_blocks_total == 250).all()
    by_id = {t.id: t for t in trace}
    for row in done.itertuples():
        t = by_id[row.request_id]
        assert (row.input_tokens, row.output_tokens) == (t.input_tokens, t.output_tokens)
        assert row.arrival == pytest.approx(t.arrival_s)
        assert row.arrival <= row.first_scheduled <= row.first_token <= row.finish


def test_async_scheduling_overlaps_steps_and_serves_the_same_requests(tmp_path):
    kw = dict(limit=300, num_gpu_blocks=250, max_num_seqs=32, request_rate=8.0, data_parallel_size=2)
    sync_dir, sync = simulate(tmp_path, "sync", **kw)
    async_dir, asyn = simulate(tmp_path, "async", **kw, async_scheduling=True)
    rs, ra = read_run(sync_dir).requests(), read_run(async_dir).requests()
    cols = ["request_id", "input_tokens", "output_tokens", "finish_reason"]
    key = "request_id"
    pd.testing.assert_frame_equal(rs[cols].sort_values(key, ignore_index=True),
                                  ra[cols].sort_values(key, ignore_index=True))
    assert asyn["num_preemptions"] > 0 and asyn["num_finished"] == sync["num_finished"]
    steps = read_run(async_dir).steps()
    for _, rep in steps.groupby("replica"):  # one step at a time per replica: records never overlap
        assert (rep.start.to_numpy()[1:] >= (rep.start + rep.duration).to_numpy()[:-1] - 1e-12).all()
    done = ra[ra.finish_reason == "length"]
    assert (done.arrival <= done.first_scheduled).all() and (done.first_token <= done.finish).all()


def test_recorded_timeline_replayed_under_other_scheduling_is_refused_with_the_way_out(tmp_path, capsys):
    """An async run replays only as an async simulation (its calls are an async loop's), a sync run only as a sync
    one; the error says which flag to add or drop. With the run's own flag it replays."""
    run_dir, _ = simulate(tmp_path, "async", limit=20, async_scheduling=True)
    rc, out, err = cli(capsys, SAMPLE, "--limit", "20", "--cost-model", f"recorded:{run_dir}", "-o", tmp_path / "x")
    assert rc == 2 and "that run was made with --async-scheduling, this simulation without it" in err, err
    assert "add the flag" in err and not (tmp_path / "x").exists()
    sync_dir, _ = simulate(tmp_path, "sync", limit=20)
    rc, out, err = cli(capsys, SAMPLE, "--limit", "20", "--async-scheduling", "--cost-model", f"recorded:{sync_dir}",
                       "-o", tmp_path / "y")
    assert rc == 2 and "made without --async-scheduling, this simulation with it" in err and "drop the flag" in err
    rc, out, err = cli(capsys, SAMPLE, "--limit", "20", "--async-scheduling", "--cost-model", f"recorded:{run_dir}",
                       "-o", tmp_path / "z")
    assert rc == 0, err

def test_requests_that_arrive_together_replay_in_the_order_they_were_queued(tmp_path, capsys):
    """A burst (every request at 0 s) writes its requests as they end, not as they were queued; read back with
    --like, the ties keep the order the engine received them (requests.parquet's seq), so the run's own recorded
    timeline replays the same batches instead of diverging."""
    trace = tmp_path / "burst.jsonl"
    with open(trace, "w") as f:
        for i in range(24):
            f.write(json.dumps({"id": f"b{i}", "arrival_s": 0.0, "input_tokens": 40 + 37 * (i % 5),
                                "output_tokens": 4 + 13 * ((i * 7) % 6)}) + "\n")
    run, again = tmp_path / "run", tmp_path / "again"
    rc, _, err = cli(capsys, trace, "--model", "Llama-3.2-1B", "--gpu", "H100", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "128", "-o", run)
    assert rc == 0, err
    rows = pd.read_parquet(run / "requests.parquet")
    assert rows["request_id"].tolist() != [f"b{i}" for i in range(24)]  # written as they ended
    assert sorted(rows["seq"]) == list(range(24)) and rows.set_index("request_id")["seq"]["b5"] == 5
    rc, _, err = cli(capsys, "--like", run, "--cost-model", f"recorded:{run}", "-o", again)
    assert rc == 0, err
    cols = ["num_reqs", "num_prefill_tokens", "num_decode_tokens", "sum_context_tokens", "num_waiting"]
    pd.testing.assert_frame_equal(pd.read_parquet(run / "steps.parquet")[cols],
                                  pd.read_parquet(again / "steps.parquet")[cols])



# ---- data parallelism, prefix caching, rejections --------------------------------------------------------
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware", "prefix_affinity"])
def test_data_parallel_policies_finish_every_request(tmp_path, dp, policy):
    run_dir, s = simulate(tmp_path, limit=200, data_parallel_size=dp, dp_policy=policy)
    req = read_run(run_dir).requests()
    assert s["num_requests"] == s["num_finished"] == len(req) == 200
    counts = req.replica.value_counts()
    assert set(counts.index) <= set(range(dp))
    if policy == "round_robin":
        assert counts.to_dict() == {r: 200 // dp for r in range(dp)}
    else:
        assert len(counts) >= 2, f"{policy} sent everything to one replica"


def test_data_parallel_runs_record_the_coordinators_routes_and_reports(tmp_path):
    """The sim mirrors real DP: a request reaches the coordinator one hop (half the routing delay)
    after it arrives and its replica one hop later; reports follow the stats interval and take one hop."""
    delay, interval = 0.004, 0.05
    run_dir, s = simulate(tmp_path, limit=120, request_rate=20.0, data_parallel_size=2, dp_policy="least_loaded",
                          dp_routing_delay=delay, dp_stats_interval=interval, max_num_seqs=8)
    run = read_run(run_dir)
    assert run.manifest["config"]["dp_routing_delay"] == delay
    assert run.manifest["config"]["dp_stats_interval"] == interval
    routes, pubs, req = run.dp_table("routes"), run.dp_table("publications"), run.requests()
    assert sorted(routes.request_id) == sorted(req.request_id)
    merged = routes.merge(req[["request_id", "replica", "arrival"]], on="request_id", suffixes=("", "_req"))
    assert (merged.replica == merged.replica_req).all() and np.allclose(merged.arrival, merged.arrival_req)
    assert np.allclose(routes.routed - routes.arrival, delay / 2) and np.allclose(routes.added - routes.routed, delay / 2)
    assert np.allclose(pubs.received - pubs.sampled, np.where(pubs.sampled > 0, delay / 2, 0.0))
    assert sorted(pubs.seq.tolist() + routes.seq.tolist()) == list(range(len(pubs) + len(routes)))
    for _, p in pubs[pubs.sampled > 0].groupby("replica"):
        gaps = np.diff(p.sampled.to_numpy())
        idle = (p.num_waiting + p.num_running).to_numpy()[1:] == 0
        assert (gaps[~idle] >= interval - 1e-12).all(), "a busy replica reported before its interval passed"
    steps = run.steps()
    for r, p in pubs.groupby("replica"):  # each report tells the state after that many of its steps
        assert p.steps.max() <= (steps.replica == r).sum()


def test_stale_stats_change_least_loaded_routing(tmp_path):
    kw = dict(limit=150, request_rate=30.0, data_parallel_size=3, dp_policy="least_loaded", max_num_seqs=8)
    _, fresh = simulate(tmp_path, "fresh", dp_stats_interval=0.0, **kw)
    stale_dir, stale = simulate(tmp_path, "stale", dp_stats_interval=5.0, **kw)
    fresh_dir = tmp_path / "fresh"
    a = read_run(fresh_dir).requests().sort_values("request_id").replica.tolist()
    b = read_run(stale_dir).requests().sort_values("request_id").replica.tolist()
    assert a != b and fresh["num_finished"] == stale["num_finished"] == 150


def test_prefix_caching_hits_on_the_mooncake_slice(tmp_path):
    path = FORMATS / "mooncake_synthetic_head300.jsonl"
    run_dir, s = simulate(tmp_path, "on", path, limit=200, model="Llama-3.2-1B", enable_prefix_caching=True)
    req = read_run(run_dir).requests()
    assert s["num_requests"] == s["num_finished"] == len(req) == 200
    assert s["prefix_cache_hit_rate"] > 0
    assert s["prefix_cache_hit_rate"] == pytest.approx(req.cached_tokens.sum() / req.input_tokens.sum())
    _, off = simulate(tmp_path, "off", path, limit=200, model="Llama-3.2-1B")
    assert off["prefix_cache_hit_rate"] == 0 and off["ttft_s"]["mean"] > s["ttft_s"]["mean"]


def test_requests_over_max_model_len_are_rejected_not_dropped(tmp_path):
    trace = load_trace(SAMPLE, limit=100)
    too_long = {t.id for t in trace if t.input_tokens + t.output_tokens > 1024}
    assert too_long
    run_dir, s = simulate(tmp_path, limit=100, max_model_len=1024)
    req = read_run(run_dir).requests()
    assert s["num_requests"] == len(req) == 100
    assert s["num_rejected"] == len(too_long) and set(req[req.finish_reason == "rejected"].request_id) == too_long
    assert s["num_finished"] == 100 - len(too_long)


def test_a_late_arrival_to_an_idle_cluster_is_served(tmp_path):
    trace = tmp_path / "late.jsonl"
    trace.write_text('{"id": "a", "arrival_s": 0.0, "input_tokens": 100, "output_tokens": 5}\n'
                     '{"id": "b", "arrival_s": 50.0, "input_tokens": 100, "output_tokens": 5}\n')
    run_dir, s = simulate(tmp_path, trace=trace)
    req = read_run(run_dir).requests().set_index("request_id")
    assert s["num_finished"] == 2, "the run ended before a request that arrived at an idle cluster was served"
    assert req.loc["b", "finish"] > 50.0


# ---- the CLI ------------------------------------------------------------------------------------------------
def test_cli_json_output_is_parseable(tmp_path, capsys):
    rc, out, _ = cli(capsys, SAMPLE, "--limit", 40, "--format", "json", "-o", tmp_path / "j")
    assert rc == 0
    d = json.loads(out)
    assert d["run_dir"] == str(tmp_path / "j") and d["num_requests"] == d["num_finished"] == 40
    assert d == {"run_dir": d["run_dir"], **read_run(tmp_path / "j").summary}


def test_cli_entry_point_keeps_stdout_pure_json_with_a_progress_bar(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "simulate", str(SAMPLE), "--limit", "30",
                           "--format", "json", "-o", str(tmp_path / "p")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["num_requests"] == 30
    # stderr is no terminal (a log file, a pipe): one plain line instead of a bar, nothing half-drawn
    assert proc.stderr.startswith("testbed simulate: simulating 30 requests over "), proc.stderr
    assert "\r" not in proc.stderr and "|" not in proc.stderr, proc.stderr


def test_in_a_terminal_the_progress_bar_is_left_showing_the_end(tmp_path):
    """On a terminal the bar stays when the simulation is done, drawn at its end: every request, all the
    simulated time (not the last periodic report before the end)."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    main_fd, term = pty.openpty()
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "simulate", str(SAMPLE), "--format", "json",
                             "-o", str(tmp_path / "t")], stdout=subprocess.PIPE, stderr=term, cwd=tmp_path)
    os.close(term)
    drawn = b""
    while chunk := _read(main_fd):
        drawn += chunk
    os.close(main_fd)
    assert proc.wait(timeout=120) == 0
    n = json.loads(proc.stdout.read())["num_requests"]  # the whole trace: its last requests end after its last arrival
    text = drawn.decode()
    assert text.endswith("\r\n"), repr(text[-300:])  # left in place: the line ends, nothing erases it
    last = text.rstrip().split("\r")[-1]
    done = re.fullmatch(r"simulating (\d+)/(\d+) sim-s \|[^|]+\| (\d+)/(\d+) requests \[.*\]", last.strip())
    assert done, last
    assert done[1] == done[2] and abs(int(done[1]) - read_run(tmp_path / "t").summary["makespan_s"]) <= 1, last
    assert int(done[3]) == int(done[4]) == n, last


def _read(fd: int) -> bytes:
    """What a pseudo-terminal's other end wrote, b"" once it is closed (Linux raises EIO then)."""
    import os
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def test_cli_table_output_names_the_run_directory(tmp_path, capsys):
    rc, out, _ = cli(capsys, SAMPLE, "--limit", 20, "-o", tmp_path / "t")
    assert rc == 0 and f"Run directory: {tmp_path / 't'}" in out


def test_cli_malformed_trace_line_fails_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0.0, "input_tokens": 10, "output_tokens": 2}\n'
                   '{"arrival_s": 0.5, "input_tokens": 10, "output_tokens": 2}\n'
                   '{"arrival_s": 1.0, "input_tokens": -3, "output_tokens": 2}\n')
    rc, out, err = cli(capsys, bad, "-o", tmp_path / "never")
    assert rc != 0 and f"{bad}:3:" in err and "input_tokens" in err and out == ""
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("args, needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--model", "GPT-5"], "GPT-5"),
    (["--trace-format", "lengths"], "--request-rate R"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--burstiness", "0"], "--burstiness must be"),
    (["--model", "Llama-3.2-1B", "-tp", "3"], "--tensor-parallel-size 3 cannot split Llama-3.2-1B"),
])
def test_cli_bad_flags_fail_with_a_clear_message(tmp_path, capsys, args, needle):
    rc, _, err = cli(capsys, SAMPLE, "--limit", 5, "-o", tmp_path / "x", *args)
    assert rc != 0 and needle in err


def test_cli_missing_trace_file(tmp_path, capsys):
    rc, _, err = cli(capsys, tmp_path / "nope.jsonl", "-o", tmp_path / "x")
    assert rc != 0 and "nope.jsonl" in err


def _one_error_line(err: str, *needles: str) -> None:
    """Besides warnings (e.g. no shipped cost profile), stderr is one error line holding the needles."""
    lines = [x for x in err.strip().splitlines() if not x.startswith("testbed simulate: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("testbed simulate: error: "), err
    assert all(n in lines[0] for n in needles), (needles, err)


@pytest.mark.parametrize("case", ["directory", "binary", "output_file", "output_folder", "cost_model_json",
                                  "recorded_missing", "slo_negative", "slo_nan", "slo_inf"])
def test_cli_errors_are_one_line_naming_the_file(tmp_path, capsys, case):
    binary, profile, a_file, folder = tmp_path / "trace.jsonl", tmp_path / "p.json", tmp_path / "f.txt", tmp_path / "d"
    binary.write_bytes(b'{"arrival_s": 0, "input_tokens": 3, "output_tokens": 1}\n\x89PNG\r\n\x1a\n\xff\xfe')
    profile.write_text("{not json")
    a_file.write_text("x")
    folder.mkdir()
    (folder / "notes.md").write_text("mine")
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"arrival_s": -1, "input_tokens": 3, "output_tokens": 1}\n')
    trace, args, needles = {
        "directory": (tmp_path, [], [str(tmp_path), "missing manifest.json"]),  # a folder is read as a run
        "binary": (binary, [], [f"{binary}:2:", "not UTF-8"]),
        # -o is checked before anything else: the trace's own error is never reached
        "output_file": (bad_trace, ["-o", a_file], ["--output", str(a_file), "not a directory"]),
        "output_folder": (bad_trace, ["-o", folder], [str(folder), "not a run directory", "notes.md"]),
        "cost_model_json": (SAMPLE, ["--cost-model", profile], [str(profile), "not a JSON profile"]),
        "recorded_missing": (SAMPLE, ["--cost-model", f"recorded:{tmp_path / 'gone'}"],
                             [str(tmp_path / "gone"), "missing manifest.json"]),
        "slo_negative": (SAMPLE, ["--slo-ttft", "-1"], ["--slo-ttft", "-1"]),
        "slo_nan": (SAMPLE, ["--slo-ttft", "nan"], ["--slo-ttft", "nan"]),
        "slo_inf": (SAMPLE, ["--slo-tpot", "inf"], ["--slo-tpot", "inf"]),
    }[case]
    if "-o" not in args:
        args = [*args, "-o", tmp_path / "out"]
    rc, out, err = cli(capsys, trace, "--limit", 5, *args)
    assert rc == 2 and out == ""
    _one_error_line(err, *needles)
    assert (folder / "notes.md").read_text() == "mine" and not (tmp_path / "out").exists()


def test_prompt_token_ids_outside_the_vocabulary_are_refused_before_simulating(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "output_tokens": 2, "prompt_token_ids": [1, 2]}\n'
                     '{"id": "oov", "arrival_s": 1, "output_tokens": 2, "prompt_token_ids": [5, 999999]}\n')
    rc, out, err = cli(capsys, trace, "--model", "Llama-3.2-1B", "-o", tmp_path / "out")
    assert rc == 2 and out == "" and not (tmp_path / "out").exists()
    _one_error_line(err, str(trace), "'oov'", "999999", "vocabulary")


@pytest.mark.parametrize("case", ["manifest_beside_sources", "foreign_manifest", "run_with_a_note"])
def test_output_never_replaces_a_folder_that_is_not_a_run(tmp_path, capsys, case):
    """-o replaces only a run this tool wrote: a manifest.json beside other files, a manifest of another
    schema, or a real run with a file of the user's added all end in exit 2 and one line, and nothing is deleted."""
    folder = tmp_path / "d"
    if case == "run_with_a_note":
        simulate(tmp_path, "d", limit=5)
        (folder / "NOTES.md").write_text("mine")
    else:
        (folder / "src").mkdir(parents=True)
        (folder / "manifest.json").write_text('{"name": "my-package", "version": "1.0"}')
        if case == "manifest_beside_sources":
            (folder / "src" / "a.py").write_text("x = 1\n")
            (folder / "NOTES.md").write_text("mine")
        else:
            (folder / "src").rmdir()
    before = sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))
    rc, out, err = cli(capsys, SAMPLE, "--limit", 5, "-o", folder)
    assert rc == 2 and out == ""
    _one_error_line(err, str(folder), "not a run directory" if case != "foreign_manifest" else "not a testbed run")
    assert sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary directory left either


def test_cli_warns_when_the_configuration_rejects_requests(tmp_path, capsys):
    rc, _, err = cli(capsys, SAMPLE, "--limit", 20, "--num-gpu-blocks", 1, "-o", tmp_path / "a")
    assert rc == 0 and "warning: 20 of 20 requests were rejected" in err and "the cache has 1" in err
    rc, _, err = cli(capsys, SAMPLE, "--limit", 20, "--max-model-len", 400, "-o", tmp_path / "b")
    n = read_run(tmp_path / "b").requests()["finish_reason"].eq("rejected").sum()
    assert rc == 0 and 0 < n < 20 and f"warning: {n} of 20 requests were rejected" in err
    assert "exceeds max_model_len (400)" in err and "rejected in the run" not in err
    # the run directory as the trace: its rejected requests are rejected again, and said to be, without the
    # output length a run directory's rejected request is read back with (more than any engine allows)
    rc, _, err = cli(capsys, tmp_path / "b", "--max-model-len", 400, "-o", tmp_path / "b2")
    assert rc == 0 and f"warning: {n} of 20 requests were rejected" in err, err
    assert f"{n} of them (the first, " in err and "were rejected in the run the trace was read from" in err, err
    assert "max_tokens" not in err and "the first other" not in err, err
    rc, _, err = cli(capsys, tmp_path / "b", "--max-model-len", 300, "-o", tmp_path / "b3")  # and new ones
    assert rc == 0 and f"{n} of them (the first, " in err and "; the first other, " in err, err
    assert "exceeds max_model_len (300)" in err and "1099511627776" not in err, err
    rc, _, err = cli(capsys, SAMPLE, "--limit", 20, "-o", tmp_path / "c")
    assert rc == 0 and "rejected" not in err


def _consistent(run_dir) -> int:
    """The number of requests of a run directory whose four files belong to one run."""
    run = read_run(run_dir)
    n = run.manifest["trace"]["num_requests"]
    assert len(run.requests()) == n == run.summary["num_requests"], run_dir
    return n


def test_rewriting_a_run_leaves_the_old_one_or_the_new_one(tmp_path):
    from testbed.engine.metrics import Recorder
    from testbed.runs.rundir import find_runs, write_run
    out = tmp_path / "run"
    simulate(tmp_path, "run", limit=20)
    before = {f: (out / f).read_bytes() for f in FILES}
    # a write that fails part way (after the parquet files): the old run stays whole, nothing is left over
    with pytest.raises(TypeError):
        write_run(out, {"mode": "sim"}, Recorder(), {"not JSON": object()})
    assert {f: (out / f).read_bytes() for f in FILES} == before and _consistent(out) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    simulate(tmp_path, "run", limit=30)  # a successful rewrite replaces it whole
    assert _consistent(out) == 30 and [p.name for p in tmp_path.iterdir()] == ["run"]
    # a leftover hidden directory (an interrupted write) is never listed as a run
    shutil.copytree(out, tmp_path / ".run.x.tmp")
    assert find_runs(tmp_path) == [out]


def test_sigint_while_rewriting_a_run_leaves_a_whole_run(tmp_path):
    """SIGINT during `testbed simulate -o DIR` over an existing run: DIR holds one whole run (the old one
    or the new one), no temporary directory is left, and the command exits 130 without a traceback."""
    out = tmp_path / "run"
    simulate(tmp_path, "run", limit=20)
    whole = len(load_trace(SAMPLE))  # the new run, when the signal comes after it was written
    cmd = [sys.executable, "-m", "testbed.cli", "simulate", str(SAMPLE), "--cost-model", "roofline", "-o", str(out)]
    seen = set()
    for delay in (0.0, 1.0):
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err, deadline = "", time.monotonic() + 60
        while "simulating" not in err and time.monotonic() < deadline:  # the progress bar: past startup
            err += p.stderr.read(1) or ""
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        err += p.communicate(timeout=120)[1]
        assert p.returncode in (0, 130), err
        assert "Traceback" not in err
        seen.add(_consistent(out))
        assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]
    assert seen <= {20, whole}


# ---- every loader format through `testbed simulate` -------------------------------------------------------------
def test_cli_azure_csv_slice(tmp_path, capsys):
    path = head(FORMATS / "azure_llm_2023_conv_head400.csv", tmp_path / "azure.csv", 121)
    rc, out, err = cli(capsys, path, "--format", "json", "-o", tmp_path / "az")
    assert rc == 0, err
    d = json.loads(out)
    assert d["num_requests"] == d["num_finished"] == 120
    assert read_run(tmp_path / "az").requests().request_id.str.startswith("azure-").all()


def test_cli_mooncake_slice(tmp_path, capsys):
    path = head(FORMATS / "mooncake_synthetic_head300.jsonl", tmp_path / "moon.jsonl", 60)
    rc, out, err = cli(capsys, path, "--model", "Llama-3.2-1B", "--enable-prefix-caching", "--format", "json",
                       "-o", tmp_path / "mc")
    assert rc == 0, err
    d = json.loads(out)
    assert d["num_requests"] == d["num_finished"] == 60 and d["prefix_cache_hit_rate"] > 0


def test_cli_lengths_csv_with_request_rate(tmp_path, capsys):
    path = head(FORMATS / "sharegpt_lengths_llama2_head300.csv", tmp_path / "lengths.csv", 81)
    rc, out, err = cli(capsys, path, "--request-rate", 4, "--seed", 1, "--format", "json", "-o", tmp_path / "ln")
    assert rc == 0, err
    d = json.loads(out)
    assert d["num_requests"] == d["num_finished"] == 80
    arrivals = read_run(tmp_path / "ln").requests().arrival.sort_values().to_numpy()
    assert arrivals[0] == 0.0 and 80 / 4 / 3 < arrivals[-1] < 80 / 4 * 3, "about 4 req/s"


def test_a_mistyped_flag_gets_the_subcommands_one_line_error_with_a_suggestion(capsys):
    rc, out, err = cli(capsys, SAMPLE, "--enable-prefix-cache", "--limit", 5)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines == ["testbed simulate: error: unrecognized argument --enable-prefix-cache (did you mean "
                     "--enable-prefix-caching?); `testbed simulate --help` lists the flags"], err
    rc, _, err = cli(capsys, SAMPLE, "--zzz-unknown=3", "--limit", 5)
    assert rc == 2 and err.strip() == ("testbed simulate: error: unrecognized argument --zzz-unknown=3; "
                                       "`testbed simulate --help` lists the flags")
    for bad, error in ((["--max-num", "3"], "ambiguous option: --max-num could match --max-num-seqs, "
                                             "--max-num-batched-tokens, --max-num-waiting"),
                       (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'")):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", str(SAMPLE), *bad])
        assert exit_.value.code == 2 and capsys.readouterr().err == (
            f"testbed simulate: error: {error}; `testbed simulate --help` lists the flags\n")
    assert main(["bench", "serve", "--dataset", "random", "--num-promts", "3"]) == 2  # a nested subcommand's own
    assert capsys.readouterr().err.strip() == ("testbed bench serve: error: unrecognized argument --num-promts (did "
                                               "you mean --num-prompts?); `testbed bench serve --help` lists the flags")


def test_every_flag_has_help_and_help_shows_defaults(capsys):
    """--help as vLLM's: every flag of every subcommand says what it is, with its default."""
    import argparse

    from testbed.cli import build_parser

    def parsers(p):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield name, sp
                    yield from parsers(sp)
    missing = [f"{name} {a.option_strings or a.dest}" for name, sp in parsers(build_parser()) for a in sp._actions
               if not a.help and not isinstance(a, argparse._HelpAction)]
    assert not missing, missing
    # a flag with a default shows it, through the help formatter each subcommand's parser uses
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction, argparse._SubParsersAction)
    hidden = [f"{name} {a.option_strings}" for name, sp in parsers(build_parser()) for a in sp._actions
              if a.default not in (None, argparse.SUPPRESS) and not isinstance(a, flags)
              and "default" not in sp._get_formatter()._get_help_string(a)]
    assert not hidden, hidden
    for command, shown in ((["simulate"], ["most requests in one step (default: 256)", "(default: H100-SXM)"]),
                           (["serve"], ["port to listen on (default: 8000)", "address to bind (default: 127.0.0.1)",
                                        "most requests in one step (default: 256)", "(default: H100-SXM)"]),
                           (["bench", "serve"], ["gamma shape (1 = Poisson) (default: 1.0)"])):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(x in text for x in shown), (command, [x for x in shown if x not in text])


def test_the_summary_restates_the_setup_and_speed(tmp_path, capsys):
    rc, out, err = cli(capsys, SAMPLE, "--limit", 60, "-dp", 2, "--dp-policy", "round_robin", "--model", "Llama-3.2-1B",
                       "--gpu", "H200", "--enable-prefix-caching", "-o", tmp_path / "run")
    assert rc == 0, err
    assert "Setup: Llama-3.2-1B on H200, TP 1, DP 2 (round_robin), prefix caching on" in out
    assert "Cost model: profile Llama-3.2-1B_H200_tp1.json" in out and "x real time)" in out
    assert "Replica load (requests): 0: 30, 1: 30; imbalance (max / mean) 1.00" in out
