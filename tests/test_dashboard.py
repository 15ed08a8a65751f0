"""Dashboard over real run directories written by `testbed simulate` (plus a real-mode copy), via AppTest."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("streamlit")
pytest.importorskip("matplotlib")
from streamlit.testing.v1 import AppTest  # noqa: E402

from testbed import cli  # noqa: E402
from testbed.runs import compare  # noqa: E402
from testbed.dashboard import data  # noqa: E402
from testbed.runs import series  # noqa: E402
from testbed.dashboard.launch import APP, SimSettings, dashboard_command, simulate_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "traces" / "azure_conv_10min.jsonl"


def make_real_copy(src: Path, dst: Path, seed: int = 1) -> Path:
    """A real-mode run made from a sim run: mode=real, step durations perturbed, TTFTs in the summary +10%."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["mode"] = "real"
    (dst / "manifest.json").write_text(json.dumps(manifest))
    steps = pq.read_table(dst / "steps.parquet")
    noisy = steps.column("duration").to_numpy() * np.random.default_rng(seed).lognormal(0.1, 0.2, steps.num_rows)
    steps = steps.set_column(steps.schema.get_field_index("duration"), "duration", pa.array(noisy))
    pq.write_table(steps, dst / "steps.parquet")
    summary = json.loads((dst / "summary.json").read_text())
    summary["ttft_s"] = {k: v * 1.1 for k, v in summary["ttft_s"].items()}
    (dst / "summary.json").write_text(json.dumps(summary))
    return dst


def make_runs(root: Path) -> Path:
    """root/sim_base, root/sim_dp2 (two DP replicas), root/real_base (real-mode copy of sim_base)."""
    for name, extra in (("sim_base", []), ("sim_dp2", ["--data-parallel-size", "2", "--model", "Llama-3.2-1B"])):
        rc = cli.main(["simulate", str(TRACE), "--limit", "300", "-o", str(root / name), "--no-progress", *extra])
        assert rc == 0
    make_real_copy(root / "sim_base", root / "real_base")
    return root


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return make_runs(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="session")
def bad_root(tmp_path_factory, runs_root) -> Path:
    """bad_json (manifest not JSON), no_steps (steps.parquet missing), bad_parquet (steps.parquet garbage),
    truncated (requests.parquet cut in half), no_column (steps.parquet without `duration`)."""
    root = tmp_path_factory.mktemp("bad")
    for name in ("bad_json", "no_steps", "bad_parquet", "truncated", "no_column"):
        shutil.copytree(runs_root / "sim_base", root / name)
    (root / "bad_json" / "manifest.json").write_text("{not json")
    (root / "no_steps" / "steps.parquet").unlink()
    (root / "bad_parquet" / "steps.parquet").write_bytes(b"this is not parquet")
    cut = root / "truncated" / "requests.parquet"
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    steps = pq.read_table(root / "no_column" / "steps.parquet")
    pq.write_table(steps.drop_columns(["duration"]), root / "no_column" / "steps.parquet")
    return root


def app(monkeypatch, *roots: Path | str) -> AppTest:
    monkeypatch.setenv("TESTBED_RUNS", os.pathsep.join(map(str, roots)))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def summary(runs_root: Path, name: str) -> dict:
    return json.loads((runs_root / name / "summary.json").read_text())


def test_runs_table_lists_runs_and_filters(monkeypatch, runs_root):
    at = app(monkeypatch, runs_root)
    assert at.title[0].value == "testbed experiment dashboard"
    table = at.dataframe[0].value
    assert sorted(table["run"]) == ["real_base", "sim_base", "sim_dp2"]
    row = table.set_index("run").loc["sim_dp2"]
    assert (row["mode"], row["model"], row["GPU"], row["DP"]) == ("sim", "Llama-3.2-1B", "H100-SXM", 2)
    assert row["req/s"] == summary(runs_root, "sim_dp2")["request_throughput"]
    assert row["TTFT p99 (ms)"] == summary(runs_root, "sim_dp2")["ttft_s"]["p99"] * 1e3
    at.multiselect(key="filter_mode").set_value(["real"]).run()
    assert list(at.dataframe[0].value["run"]) == ["real_base"]
    at.multiselect(key="filter_mode").set_value([]).run()
    at.text_input(key="filter_text").set_value("llama-3.2").run()
    assert list(at.dataframe[0].value["run"]) == ["sim_dp2"]
    assert any(b.label == "Download runs.csv as CSV" for b in at.download_button)


def test_comparison_equals_summaries_with_sim_vs_real_error(monkeypatch, runs_root):
    at = app(monkeypatch, runs_root)
    assert at.sidebar.multiselect(key="selected_runs").value == ["real_base", "sim_base"]  # one real, one sim
    assert at.sidebar.selectbox(key="baseline").value == "real_base"
    at.sidebar.multiselect(key="selected_runs").set_value(["real_base", "sim_base", "sim_dp2"]).run()
    shown = at.dataframe[1].value
    assert "summary key" not in shown.columns and "None" not in shown.to_string()  # no internal column, no None
    # metric labels are never cut: their column is Streamlit's "large" (400 px), room for 50 characters of its
    # 14 px font (about 8 px each), and the longest label is shorter
    assert json.loads(at.dataframe[1].proto.columns)["metric"]["width"] == "large"
    assert max(len(label) for label, _, _ in compare.COMPARE_METRICS) * 8 <= 400
    table = shown.set_index("metric")
    for name in ("real_base", "sim_base", "sim_dp2"):
        s, col = summary(runs_root, name), table[f"{name} [{'real' if name.startswith('real') else 'sim'}]"]
        for label, key, scale in compare.COMPARE_METRICS:
            value = s
            for part in key.split("."):
                value = value[part]
            assert col[label] == compare.format_value(label, value * scale), (name, label)
    err = table["sim_base: sim-vs-real error vs real_base (%)"]
    assert err["TTFT p50 (ms)"] == compare.format_pct(100 * (1 / 1.1 - 1)) == "-9.1%"
    # whether each error lies inside the simulation's expected error (its profile's band): yes, no or "-"
    runs = compare.load_runs([str(runs_root / n) for n in ("real_base", "sim_base", "sim_dp2")])
    inside = compare.compare_table(runs, runs[0]).set_index("metric")["sim_base: within expected error"]
    band = table["sim_base: within expected error"]
    assert list(band) == ["-" if v is pd.NA else "yes" if v else "no" for v in inside], list(band)
    assert band["TPOT p50 (ms)"] == "yes" and set(band) <= {"yes", "no", "-"}
    assert err["TPOT p50 (ms)"] == "+0.0%"
    assert "sim_dp2: sim-vs-real error vs real_base (%)" in table.columns
    at.sidebar.selectbox(key="baseline").set_value("sim_base").run()
    assert "sim_dp2: rel. diff vs sim_base (%)" in at.dataframe[1].value.columns


def test_plots_render_one_image_per_figure(monkeypatch, runs_root):
    at = app(monkeypatch, runs_root)
    assert len(at.image) == 5 and not at.error  # CDFs, throughput, KV, queues, step scatter; no DP run selected
    assert "none of the selected runs is data parallel" in at.info[0].value
    at.sidebar.multiselect(key="selected_runs").set_value(["real_base", "sim_dp2"]).run()
    assert not at.exception and len(at.image) == 6
    pngs = [b for b in at.download_button if b.label == "Download PNG"]
    assert len(pngs) == 6


def test_corrupt_and_missing_runs_are_named_and_the_rest_works(monkeypatch, runs_root, bad_root, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    at = app(monkeypatch, runs_root, bad_root, empty, tmp_path / "nope")
    errors, warnings = [e.value for e in at.error], [w.value for w in at.warning]
    assert any("bad_json" in e and "corrupt JSON" in e for e in errors), errors
    assert any("no_steps" in e and "missing steps.parquet" in e for e in errors), errors
    assert any("bad_parquet" in e and "steps.parquet is not a readable parquet file" in e for e in errors), errors
    assert any("truncated" in e and "requests.parquet is not a readable parquet file" in e for e in errors), errors
    assert any("no_column" in e and "steps.parquet lacks the columns duration" in e for e in errors), errors
    assert any(str(empty) in w and "no run directories" in w for w in warnings), warnings
    assert any("nope" in w and "does not exist" in w for w in warnings), warnings
    table = at.dataframe[0].value.set_index("run")  # every run is listed, the broken ones flagged
    broken = ["bad_json", "bad_parquet", "no_column", "no_steps", "truncated"]
    assert sorted(table.index) == sorted(broken + ["real_base", "sim_base", "sim_dp2"])
    assert all(table.loc[b, "status"].startswith("broken: ") for b in broken)
    assert (table.loc[["real_base", "sim_base", "sim_dp2"], "status"] == "ok").all()
    assert sorted(at.sidebar.multiselect(key="selected_runs").options) == ["real_base", "sim_base", "sim_dp2"]
    assert len(at.image) == 5 and not at.exception


def test_launch_simulation_adds_a_run(monkeypatch, runs_root, tmp_path):
    out = tmp_path / "launched"
    out.mkdir()
    at = app(monkeypatch, out)
    assert "no run directories" in at.warning[0].value
    at.radio(key="launch_source").set_value("bundled trace")
    at.selectbox(key="launch_bundled").set_value(TRACE.name)
    at.selectbox(key="launch_model").set_value("Llama-3.2-1B")
    at.number_input(key="launch_limit").set_value(40)
    at.number_input(key="launch_dp").set_value(2)
    at.number_input(key="launch_tp").set_value(2)
    at.text_input(key="launch_cost_model").set_value("roofline")
    at.number_input(key="launch_burstiness").set_value(0.5)
    at.number_input(key="launch_slo_ttft").set_value(200.0)
    at.number_input(key="launch_blocks").set_value(3000)
    at.checkbox(key="launch_async").check()
    at.button(key="launch_submit").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.progress and at.progress[-1].value == 100  # percent
    assert "New run written" in at.success[0].value
    (new,) = data.find_runs(out)
    assert list(at.dataframe[0].value["run"]) == [new.name]
    assert at.sidebar.multiselect(key="selected_runs").value == [new.name]
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["config"]["data_parallel_size"] == 2 and manifest["trace"]["limit"] == 40
    assert manifest["config"]["tensor_parallel_size"] == 2 and manifest["cost_model"].startswith("roofline")
    assert manifest["trace"]["burstiness"] == 0.5 and manifest["config"]["async_scheduling"] is True
    assert manifest["num_gpu_blocks"] == 3000 and json.loads((new / "summary.json").read_text())["slo"]["ttft_s"] == 0.2
    assert len(at.image) == 6  # a DP run: per-replica load drawn too


def test_launch_from_upload_and_bad_path(monkeypatch, tmp_path):
    out = tmp_path / "up"
    at = app(monkeypatch, out)
    lines = "".join(json.dumps({"arrival_s": i * 0.01, "input_tokens": 100 + i, "output_tokens": 20}) + "\n"
                    for i in range(20))
    at.radio(key="launch_source").set_value("upload")
    at.file_uploader(key="launch_upload").set_value(("my trace.jsonl", lines.encode(), "application/json"))
    at.button(key="launch_submit").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert (out / "uploads" / "my_trace.jsonl").read_text() == lines
    (new,) = data.find_runs(out)
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["trace"]["num_requests"] == 20 and manifest["trace"]["path"].endswith("my_trace.jsonl")
    assert json.loads((new / "summary.json").read_text())["num_finished"] == 20
    at.radio(key="launch_source").set_value("path")
    at.text_input(key="launch_path").set_value(str(out / "missing.jsonl"))
    at.button(key="launch_submit").click().run()
    assert any("missing.jsonl is not a file" in e.value for e in at.error)


def test_launch_form_reads_no_file_outside_the_run_folders(monkeypatch, tmp_path):
    """A path outside the folders the dashboard was started with (and traces/) is refused before it is
    read, so no error shows a byte of it; widening the folders in the sidebar does not widen that; runs
    are written only inside those folders."""
    out, secret = tmp_path / "runs", tmp_path / "elsewhere" / "secret.env"
    secret.parent.mkdir()
    secret.write_text("API_KEY=sk-do-not-show-me\n")
    at = app(monkeypatch, out)
    at.sidebar.text_area(key="roots").set_value(f"{out}\n{secret.parent}").run()
    for path in (str(secret), "/etc/passwd", f"{out}/../elsewhere/secret.env"):
        at.radio(key="launch_source").set_value("path")
        at.text_input(key="launch_path").set_value(path)
        at.button(key="launch_submit").click().run()
        assert not at.exception
        shown = " ".join(e.value for e in at.error)
        assert "outside the run folders" in shown and "sk-do-not" not in shown and "root:" not in shown, shown
    at.radio(key="launch_source").set_value("bundled trace")
    at.text_input(key="launch_folder").set_value(str(secret.parent))
    at.button(key="launch_submit").click().run()
    assert any("not one of the run folders" in e.value for e in at.error)
    assert sorted(p.name for p in secret.parent.iterdir()) == ["secret.env"]


def test_simulate_run_reports_progress(tmp_path):
    calls = []
    out = simulate_run(SimSettings(str(TRACE), limit=600), tmp_path / "run", lambda t, h: calls.append((t, h)))
    assert compare.load_meta(str(out))[0]["trace"]["limit"] == 600
    assert calls and all(0 <= t <= h + 1 for t, h in calls) and all(h > 0 for _, h in calls)
    assert [t for t, _ in calls] == sorted(t for t, _ in calls)


def test_timeline_agrees_with_summary(runs_root):
    s = summary(runs_root, "sim_dp2")
    tl = series.timeline(str(runs_root / "sim_dp2"), max_bins=200)
    width = tl["t"].iloc[1] - tl["t"].iloc[0]
    assert len(tl) <= 200
    assert (tl["output_tok_s"].sum() * width) == pytest.approx(s["total_output_tokens"])
    lat = series.latency_samples(str(runs_root / "sim_dp2"))
    assert np.percentile(lat["ttft"], 99) == pytest.approx(s["ttft_s"]["p99"])
    assert np.mean(lat["tpot"]) == pytest.approx(s["tpot_s"]["mean"])
    load = series.replica_load(str(runs_root / "sim_dp2"))
    assert sorted(load["replica"].unique()) == [0, 1]


def test_time_average_and_cdf():
    edges = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    # value 4 on [0.5, 1.5), value 2 on [1.5, 3.5) (overlapping step clipped at the next start)
    avg = series.time_average(np.array([1.5, 0.5]), np.array([3.5, 2.0]), np.array([2, 4]), edges)
    assert avg.tolist() == [2.0, 3.0, 2.0, 1.0]
    xs, ys = series.cdf(np.arange(10_000)[::-1], max_points=100)
    assert len(xs) <= 100 and xs[0] == 0 and xs[-1] == 9999 and ys[-1] == 1.0 and np.all(np.diff(xs) > 0)


def test_dashboard_command_binds_localhost(tmp_path):
    cmd = dashboard_command([str(tmp_path)], 8599)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8599" and cmd[cmd.index("--server.headless") + 1] == "true"
    assert cmd[cmd.index("--runs") + 1:] == [str(tmp_path.resolve())] and cmd[4] == str(APP)
