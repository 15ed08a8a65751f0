"""The Streamlit script: `streamlit run testbed/dashboard/app.py -- --runs DIR [DIR ...]` (or `testbed dashboard`).

Run folders come from `--runs` after `--`, else from $TESTBED_RUNS (os.pathsep separated), else ./runs;
the sidebar can change them. Everything read from disk is cached by path and file mtimes, so a
rewritten run is re-read and an unchanged one costs nothing on the next rerun.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import streamlit as st

from testbed.runs import compare
from testbed.dashboard import data
from testbed.runs import plots, series
from testbed.dashboard.launch_form import launch_form
from testbed.runs.rundir import RunDirError

TITLE = "testbed experiment dashboard"
LOADERS = {"latency": series.latency_samples, "timeline": series.timeline, "replicas": series.replica_load,
           "steps": series.step_points}
FIGURES = [  # (key, loader, drawing function, file name)
    ("cdf", "latency", plots.latency_cdfs, "latency_cdfs.png"),
    ("throughput", "timeline", plots.throughput, "throughput.png"),
    ("kv", "timeline", plots.kv_utilisation, "kv_utilisation.png"),
    ("queues", "timeline", plots.queues, "queues.png"),
    ("replicas", "replicas", plots.replica_load, "replica_load.png"),
    ("steps", "steps", plots.step_scatter, "step_duration_vs_tokens.png"),
]
DRAW = {key: (loader, fn) for key, loader, fn, _ in FIGURES}


def initial_roots() -> list[str]:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--runs", nargs="*", default=None)
    args, _ = parser.parse_known_args(sys.argv[1:])
    env = [x for x in os.environ.get("TESTBED_RUNS", "").split(os.pathsep) if x]
    return args.runs or env or ["runs"]


@st.cache_data(show_spinner=False, max_entries=1024)
def cached_meta(path: str, key: tuple) -> tuple[dict, dict]:
    return compare.load_meta(path)


@st.cache_data(show_spinner=False, max_entries=256)
def cached_series(loader: str, path: str, key: tuple):
    return LOADERS[loader](path)


@st.cache_data(show_spinner="Drawing...", max_entries=128)
def figure_png(kind: str, runs: tuple[tuple[str, tuple, str, str, int], ...]) -> bytes:
    """`runs`: (path, file key, label, mode, colour index from plots.series_of over the whole selection)."""
    loader, draw = DRAW[kind]
    return plots.to_png(draw([(plots.Series(label, mode, colour), cached_series(loader, path, key))
                              for path, key, label, mode, colour in runs]))


def load_runs(roots: list[str]) -> tuple[list[compare.RunMeta], list[str], list[str]]:
    """Every run under the roots (a broken one with its problem, listed but never compared or plotted),
    a warning per folder without runs and an error per broken run."""
    paths, warnings = data.discover(roots)
    runs, errors = [], []
    for path, label in zip(paths, compare.unique_labels(paths)):
        try:
            manifest, summary = cached_meta(str(path), data.file_key(path))
            runs.append(compare.RunMeta(str(path), label, manifest, summary))
        except (RunDirError, OSError) as e:
            runs.append(compare.RunMeta(str(path), label, {}, {}, str(e)))
            errors.append(f"Broken run, left out of the comparison and plots: {e}")
    return runs, warnings, errors


def csv_button(df, name: str) -> None:
    st.download_button(f"Download {name} as CSV", df.to_csv(index=False).encode(), file_name=name,
                       mime="text/csv", key=f"csv-{name}")


def runs_view(runs: list[compare.RunMeta], warnings: list[str], errors: list[str]) -> None:
    for msg in warnings:
        st.warning(msg)
    for msg in errors:
        st.error(msg)
    if not runs:
        st.info("No runs to show. Write one with `testbed simulate TRACE -o FOLDER/NAME` or the "
                "'Launch a simulation' section above, and list its folder in the sidebar.")
        return
    table = data.runs_table(runs).sort_values(["date", "run"], ascending=[False, True])
    c1, c2, c3 = st.columns([1, 2, 2])
    modes = c1.multiselect("Mode", _options("filter_mode", table["mode"]), key="filter_mode")
    models = c2.multiselect("Model", _options("filter_model", table["model"]), key="filter_model")
    text = c3.text_input("Search (any column)", key="filter_text")
    shown = data.filter_runs(table, modes, models, text)
    st.caption(f"{len(shown)} of {len(table)} runs; click a column header to sort")
    st.dataframe(shown, hide_index=True, width="stretch", column_config={
        c: st.column_config.NumberColumn(format="%.2f") for c in
        ("req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)")})
    csv_button(shown, "runs.csv")


def _options(key: str, values) -> list[str]:
    """Sorted distinct values; drops stale choices from the widget's state (a run folder may have gone)."""
    opts = sorted(set(values))
    if key in st.session_state:
        st.session_state[key] = [x for x in st.session_state[key] if x in opts]
    return opts


def pick_runs(runs: list[compare.RunMeta]) -> tuple[list[compare.RunMeta], compare.RunMeta | None]:
    """The runs-to-compare multiselect and the baseline choice (a real run by default)."""
    by_label = {r.label: r for r in runs}
    state = st.session_state
    if "selected_runs" not in state:
        real = [r.label for r in runs if r.mode == "real"]
        sim = [r.label for r in runs if r.mode != "real"]
        state["selected_runs"] = (real[:1] + sim[:1]) if real and sim else [r.label for r in runs[:2]]
    if (new := state.pop("launched_path", None)) is not None:
        state["selected_runs"] += [r.label for r in runs
                                   if Path(r.path).resolve() == Path(new) and r.label not in state["selected_runs"]]
    state["selected_runs"] = [x for x in state["selected_runs"] if x in by_label]
    chosen = [by_label[x] for x in st.multiselect("Runs to compare and plot", list(by_label), key="selected_runs")]
    if not chosen:
        return [], None
    labels = [r.label for r in chosen]
    if state.get("baseline") not in labels:
        state["baseline"] = compare.default_baseline(chosen).label
    return chosen, by_label[st.selectbox("Baseline (differences are relative to it)", labels, key="baseline")]


def compare_view(chosen: list[compare.RunMeta], baseline: compare.RunMeta | None) -> None:
    if baseline is None:
        st.info("Select runs in the sidebar's 'Runs to compare and plot' box.")
        return
    if len(chosen) < 2:
        st.info("Select two or more runs to see differences against the baseline.")
    table = compare.compare_table(chosen, baseline).drop(columns=["summary key"])  # the summary's JSON path: internal
    bands = [c for c in map(compare.band_column, chosen) if c in table.columns]
    values = list(table.columns[1:1 + len(chosen)])
    diffs = [c for c in table.columns[1 + len(chosen):] if c not in bands]
    shown, text = table.copy(), values + diffs + bands
    shown[text] = shown[text].astype(object)  # text: one precision per unit, "-" for none
    for c in values:
        shown[c] = [compare.format_value(m, v) for m, v in zip(table["metric"], table[c])]
    for c in diffs:
        shown[c] = [compare.format_pct(v) for v in table[c]]
    for c in bands:
        shown[c] = [compare.format_within(v) for v in table[c]]
    st.dataframe(shown, hide_index=True, width="stretch", height=35 * (len(table) + 1) + 3,
                 column_config={"metric": st.column_config.TextColumn(width="large")})
    csv_button(table, "comparison.csv")


def plots_view(chosen: list[compare.RunMeta]) -> None:
    if not chosen:
        st.info("Select runs to plot.")
        return
    styles = plots.series_of([(r.label, r.mode) for r in chosen])  # the colours `testbed compare --png` draws
    keyed = [(r.path, data.file_key(r.path), r.label, r.mode, s.index) for r, s in zip(chosen, styles)]
    failed: set[str] = set()
    for kind, loader, _, fname in FIGURES:
        ok = []
        for r, k in zip(chosen, keyed):
            if kind == "replicas" and int(_dp(r)) <= 1:
                continue
            try:
                if k[0] not in failed:
                    cached_series(loader, k[0], k[1])
                    ok.append(k)
            except Exception as e:  # noqa: BLE001 - any unreadable parquet: name the run, keep the page alive
                failed.add(k[0])
                st.error(f"{k[0]}: cannot read its records, left out of the plots ({type(e).__name__}: {e})")
        if not ok:
            if kind == "replicas":
                st.info("Per-replica load: none of the selected runs is data parallel (--data-parallel-size > 1).")
            continue
        png = figure_png(kind, tuple(ok))
        st.image(png, width="stretch")
        st.download_button("Download PNG", png, file_name=fname, mime="image/png", key=f"png-{kind}")


def _dp(r: compare.RunMeta) -> int:
    cfg = r.manifest.get("config")
    return cfg.get("data_parallel_size", 1) if isinstance(cfg, dict) else 1


def main() -> None:
    st.set_page_config(page_title="testbed dashboard", layout="wide")
    st.title(TITLE)
    text = st.sidebar.text_area("Run folders (one per line)", "\n".join(initial_roots()), key="roots")
    roots = [x.strip() for x in text.splitlines() if x.strip()]
    st.sidebar.caption("Sim runs: solid lines / dots. Real runs: dashed lines / crosses.")
    with st.expander("Launch a simulation"):  # filled first, so a run launched now is already in the table
        launch_form(initial_roots())  # the folders it was started with: a browser cannot widen what it reads
    runs, warnings, errors = load_runs(roots)
    usable = [r for r in runs if r.problem is None]
    with st.sidebar:
        chosen, baseline = pick_runs(usable) if usable else ([], None)
    st.header("Runs")
    runs_view(runs, warnings, errors)
    st.header("Comparison")
    compare_view(chosen, baseline)
    st.header("Plots")
    plots_view(chosen)


if __name__ == "__main__":  # `streamlit run` (and AppTest) execute the script as __main__
    main()
