"""`testbed compare`, `testbed simulate --like RUN_DIR` and `make demo`, on the committed real H200 run."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.runs.compare import COMPARE_METRICS, compare_table, load_runs, metric
from testbed.runs.rundir import read_run

from conftest import REPO

REAL = REPO / "benchmarks" / "results" / "real_runs" / "serve_h200_llama3.2-1b_azure_rate8"
SAMPLE = REPO / "traces" / "azure_conv_10min.jsonl"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def sim_like(tmp_path_factory) -> Path:
    """A simulation of the real run's workload (`--like`), as `make demo` makes it."""
    out = tmp_path_factory.mktemp("like") / "sim"
    assert main(["simulate", "--like", str(REAL), "--model", "Llama-3.2-1B", "--gpu", "H200", "-o", str(out),
                 "--no-progress", "--format", "json"]) == 0
    return out


def test_like_serves_the_runs_requests_on_its_cache(sim_like):
    sim, real = read_run(sim_like), read_run(REAL)
    assert sim.manifest["num_gpu_blocks"] == real.steps(columns=["kv_blocks_total"])["kv_blocks_total"].max()
    assert sim.manifest["max_model_len"] == real.manifest["server"]["model"]["max_model_len"] == 4096
    assert sim.manifest["trace"]["path"] == str(REAL)
    cols = ["request_id", "input_tokens", "output_tokens"]
    s, r = sim.requests(), real.requests()
    assert s[cols].sort_values("request_id", ignore_index=True).equals(r[cols].sort_values("request_id",
                                                                                          ignore_index=True))
    order = r.sort_values("arrival")
    expected = dict(zip(order.request_id, order.arrival - order.arrival.iloc[0]))
    assert s.set_index("request_id").arrival.to_dict() == pytest.approx(expected, abs=1e-9)
    assert sim.summary["num_finished"] == 200


def test_like_keeps_explicit_cache_flags_and_needs_a_cache_size(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "simulate", "--like", REAL, "--model", "Llama-3.2-1B", "--gpu", "H200",
                           "--num-gpu-blocks", 5000, "--max-model-len", 2048, "--limit", 20, "-o", tmp_path / "a",
                           "--no-progress", "--format", "json")
    assert rc == 0, err
    m = read_run(tmp_path / "a").manifest
    assert (m["num_gpu_blocks"], m["max_model_len"]) == (5000, 2048)
    blind = tmp_path / "no_cache"   # a `bench serve` run without --server-log-steps: no KV size anywhere
    shutil.copytree(REAL, blind)
    steps = read_run(blind).steps().iloc[:0]
    steps.to_parquet(blind / "steps.parquet")
    rc, _, err = run_cli(capsys, "simulate", "--like", blind, "-o", tmp_path / "b", "--no-progress")
    assert rc == 2 and "no_cache" in err and "--num-gpu-blocks" in err
    rc, _, err = run_cli(capsys, "simulate", "-o", tmp_path / "c", "--no-progress")
    assert rc == 2 and "--like RUN_DIR" in err


def test_compare_prints_the_dashboards_table_with_the_sim_vs_real_error(sim_like, tmp_path, capsys):
    png = tmp_path / "fig" / "cdfs.png"
    rc, out, err = run_cli(capsys, "compare", sim_like, REAL, "--png", png)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"Baseline: {REAL.name} [real]")  # the real run by default, as in the dashboard
    assert "sim-vs-real error (%)" in lines[2]
    sim, real = read_run(sim_like).summary, read_run(REAL).summary
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip())
                                               for line in lines[4:4 + len(COMPARE_METRICS)])}
    assert len(rows) == len(COMPARE_METRICS)
    assert lines[4 + len(COMPARE_METRICS)].startswith("* inside the expected error")  # the band's footnote
    assert lines[5 + len(COMPARE_METRICS)].startswith("Settings")  # then the settings that differ, if any
    for label, key, scale in COMPARE_METRICS:
        s, r = metric(sim, key), metric(real, key)
        cells = rows[label]
        assert cells[:2] == [f"{s * scale:.4g}", f"{r * scale:.4g}"], label
        assert cells[2].rstrip("*") == ("-" if r == 0 else f"{100 * (s - r) / abs(r):+.1f}"), label
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and lines[-1] == f"Latency CDFs: {png}"
    # the dashboard's colours: the real run is C0 whatever the order given (here the simulation came first), so
    # the simulation's solid lines are C1's exact colour and nothing is C0's exact colour (real lines are translucent)
    from matplotlib.image import imread
    img = (imread(png)[..., :3] * 255).round().astype(int)
    exact = lambda rgb: int((img == rgb).all(axis=2).sum())  # noqa: E731
    assert exact((255, 127, 14)) > 50 and exact((31, 119, 180)) == 0


def test_runs_keep_their_colours_whatever_the_order():
    """plots.series_of is the one source of run colours (compare --png and the dashboard): real runs first, then by
    label, so the same runs get the same colours in any order."""
    from testbed.runs.plots import series_of
    runs = [("sim_b", "sim"), ("real_a", "real"), ("sim_a", "sim"), ("real_b", "real")]
    colours = {s.label: s.color for s in series_of(runs)}
    assert colours == {"real_a": "C0", "real_b": "C1", "sim_a": "C2", "sim_b": "C3"}
    assert {s.label: s.color for s in series_of(runs[::-1])} == colours
    assert [s.label for s in series_of(runs)] == [label for label, _ in runs]  # drawn in the order given


def test_compare_table_is_shared_with_the_dashboard(sim_like):
    runs = load_runs([str(sim_like), str(REAL)])
    table = compare_table(runs, runs[0]).set_index("summary key")
    err = table[f"{REAL.name}: sim-vs-real error vs sim (%)"]
    real, sim = read_run(REAL).summary, read_run(sim_like).summary
    assert err["ttft_s.p50"] == pytest.approx(100 * (real["ttft_s"]["p50"] / sim["ttft_s"]["p50"] - 1))


def test_compare_baseline_choice_and_bad_input(sim_like, tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "compare", REAL, sim_like, "--baseline", "sim")
    assert rc == 0 and out.startswith("Baseline: sim [sim]")
    other = tmp_path / "sim2"
    shutil.copytree(sim_like, other)
    rc, out, _ = run_cli(capsys, "compare", sim_like, other)
    assert rc == 0 and "rel. diff (%)" in out.splitlines()[2]   # two sim runs: a plain relative difference
    rc, _, err = run_cli(capsys, "compare", sim_like, REAL, "--baseline", "nope")
    assert rc == 2 and "--baseline nope" in err and REAL.name in err
    rc, _, err = run_cli(capsys, "compare", sim_like, tmp_path / "missing")
    assert rc == 2 and "missing" in err and "manifest.json" in err
    rc, _, err = run_cli(capsys, "compare", sim_like, sim_like)
    assert rc == 2 and "given twice" in err


def test_make_demo_prints_the_comparison_and_writes_the_figure(tmp_path):
    """The Makefile's demo commands, with the test's interpreter as the venv (its setup step is skipped)."""
    make = shutil.which("make")
    if make is None:
        pytest.fail("`make` is not installed; CI runs `make test`, so it must be there")
    stamp = tmp_path / "sim-installed"
    stamp.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([make, "-s", "demo", f"BIN={Path(sys.executable).parent}", f"SIM={stamp}",
                           f"DEMO_OUT={tmp_path / 'demo'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sim-vs-real error (%)" in proc.stdout and "TTFT p50 (ms)" in proc.stdout
    assert (tmp_path / "demo" / "latency_cdfs.png").stat().st_size > 10_000
    demo_real = re.search(r"^DEMO_REAL \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f'make dashboard RUNS="{tmp_path / "demo" / "sim"} {demo_real}"' in proc.stdout
    manifest = json.loads((tmp_path / "demo" / "sim" / "manifest.json").read_text())
    assert manifest["mode"] == "sim"
    real = read_run(REPO / demo_real).manifest  # the run's model and GPU, taken by --like
    assert manifest["model"]["name"] == real["model"]["name"] and manifest["hardware"]["name"] == "H200"
    assert manifest["trace"]["num_requests"] == read_run(REPO / demo_real).summary["num_requests"]


FIDELITY_RUN = REPO / "benchmarks" / "results" / "fidelity" / "2026-11-24_795c0af_h200_llama-3.2-1b" / "azure-80"


def test_like_takes_the_runs_model_gpu_and_engine_flags_unless_given(tmp_path, capsys):
    """--like without --model/--gpu simulates the run's model on the run's GPU (a replay of Llama-3.2-1B on an
    H200), saying so on one line; flags given (abbreviated too) win; a simulated run's engine flags come along."""
    rc, _, err = run_cli(capsys, "simulate", "--like", FIDELITY_RUN, "--limit", 20, "-o", tmp_path / "a", "--no-progress")
    assert rc == 0, err
    m = read_run(tmp_path / "a").manifest
    assert (m["model"]["name"], m["hardware"]["name"]) == ("Llama-3.2-1B", "H200")
    assert "note: from" in err and "--model Llama-3.2-1B" in err and "--gpu H200" in err
    rc, _, err = run_cli(capsys, "simulate", "--like", FIDELITY_RUN, "--limit", 20, "--model", "Llama-3.1-8B",
                         "--max-num-seq", 64, "-o", tmp_path / "b", "--no-progress")
    m = read_run(tmp_path / "b").manifest
    assert rc == 0 and (m["model"]["name"], m["hardware"]["name"]) == ("Llama-3.1-8B", "H200")
    assert m["config"]["max_num_seqs"] == 64 and "--model" not in err
    rc, _, err = run_cli(capsys, "simulate", SAMPLE, "--limit", 20, "--model", "Qwen3-0.6B", "--gpu", "H200",
                         "--max-num-seqs", 32, "--enable-prefix-caching", "-o", tmp_path / "c", "--no-progress")
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "simulate", "--like", tmp_path / "c", "-o", tmp_path / "d", "--no-progress")
    m = read_run(tmp_path / "d").manifest
    assert rc == 0 and m["model"]["name"] == "Qwen3-0.6B" and m["config"]["max_num_seqs"] == 32
    assert m["config"]["enable_prefix_caching"] is True and "--max-num-seqs 32" in err
    # a `bench serve` run knows its model, not the server's GPU or engine flags: the note says what stands in
    rc, _, err = run_cli(capsys, "simulate", "--like", REAL, "--limit", 20, "-o", tmp_path / "e", "--no-progress")
    assert rc == 0 and err.strip() == (
        f"testbed simulate: note: from {REAL}: --model Llama-3.2-1B (flags given here override); the run records no "
        "GPU and no engine flags: simulating with --gpu H100-SXM and the engine flags given here or their defaults "
        "(give the run's own to match it)"), err


def test_compare_as_json_and_csv_with_the_settings_that_differ(sim_like, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "simulate", "--like", REAL, "--model", "Llama-3.2-1B", "--gpu", "H200",
                         "--max-num-seqs", 64, "--limit", 30, "-o", tmp_path / "narrow", "--no-progress")
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, "compare", sim_like, tmp_path / "narrow", REAL, "--format", "json")
    data = json.loads(out)
    assert rc == 0 and data["baseline"] == REAL.name and [r["mode"] for r in data["runs"]] == ["sim", "sim", "real"]
    ttft = next(m for m in data["metrics"] if m["metric"] == "TTFT mean (ms)")
    assert ttft[f"{REAL.name} [real]"] > 0
    assert data["settings_that_differ"]["max_num_seqs"] == {"sim": 256, "narrow": 64, REAL.name: None}
    rc, out, _ = run_cli(capsys, "compare", sim_like, REAL, "--format", "csv")
    assert rc == 0 and out.splitlines()[0].startswith("metric,summary key,sim [sim],")
    rc, out, _ = run_cli(capsys, "compare", sim_like, tmp_path / "narrow")
    assert "Settings that differ:" in out and "max_num_seqs: sim 256, narrow 64" in out


def test_compare_piped_into_head_exits_quietly(sim_like):
    proc = subprocess.run(f"{sys.executable} -m testbed.cli compare {sim_like} {REAL} | head -1", shell=True,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("Baseline:") and proc.stderr == "", proc.stderr


def test_a_simulation_on_the_real_curve_leaves_both_visible():
    """Notebook 1's and the dashboard's CDFs (plots.latency_cdfs): a recorded timeline lies on the real curve, and
    neither hides the other: the real run dashed and translucent on top, the simulation solid through its gaps."""
    import numpy as np
    from matplotlib.image import imread

    from testbed.runs.plots import latency_cdfs, series_of, to_png
    samples = {k: np.random.default_rng(0).lognormal(-3, 0.5, 400) for k in ("ttft", "tpot", "e2e")}
    fig = latency_cdfs([(s, samples) for s in series_of([("real", "real"), ("recorded", "sim")])])
    img = (imread(io.BytesIO(to_png(fig)))[..., :3] * 255).round().astype(int)
    near = lambda rgb: int((abs(img - rgb).max(axis=2) <= 3).sum())  # noqa: E731
    sim, real = np.array((255, 127, 14)), np.array((31, 119, 180))  # C1, C0
    assert near(sim) > 100, "the simulation is hidden under the real curve"  # 189 here; 0 under a solid real line
    assert near(0.75 * real + 0.25 * sim) > 100, "the real curve does not lie on top of the simulation"  # 432 here
