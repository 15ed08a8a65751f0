"""The comparison of runs that the dashboard shows and `testbed compare` prints: metrics as rows, one
value column per run, and each other run's relative difference against a baseline run (the sim-vs-real
error when one side is real and the other simulated).

Every number is read from a run's summary.json (latencies scaled from seconds to milliseconds, fractions
to percent); nothing is recomputed, so the table always agrees with what `testbed simulate` / `replay` /
`bench serve` printed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from testbed.runs.rundir import RunDirError, entry_name, read_run

if TYPE_CHECKING:  # pandas is imported where a table is built: the CLI starts without it
    import pandas as pd


@dataclass(frozen=True)
class RunMeta:
    """A run directory: its display label, manifest and summary, and why it is broken (None: usable)."""

    path: str
    label: str
    manifest: dict
    summary: dict
    problem: str | None = None

    @property
    def mode(self) -> str:
        """sim, real, or emulated (a `bench serve` run against `testbed serve --emulate`)."""
        if self.manifest.get("emulated"):
            return "emulated"
        return str(self.manifest.get("mode", "?"))


def load_meta(path: str) -> tuple[dict, dict]:
    """(manifest, summary) of a run directory; RunDirError names the missing or corrupt file."""
    run = read_run(path)
    if not isinstance(run.manifest, dict) or not isinstance(run.summary, dict):
        raise RunDirError(f"{path}: manifest.json and summary.json must each hold a JSON object")
    return run.manifest, run.summary


def unique_labels(paths: list[Path]) -> list[str]:
    """Short display names: the folder name, or parent/name (then the full path) where names clash."""
    labels = [p.name for p in paths]
    for depth in (2, None):
        clash = {x for x in labels if labels.count(x) > 1}
        labels = [(str(p) if depth is None else "/".join(p.parts[-depth:])) if x in clash else x
                  for p, x in zip(paths, labels)]
    return labels


def load_runs(paths: list[str]) -> list[RunMeta]:
    """RunMeta of each run directory, labelled as the dashboard labels them; RunDirError for an unreadable one."""
    dirs = [Path(p) for p in paths]
    if len({d.resolve() for d in dirs}) != len(dirs):
        raise ValueError(f"a run directory is given twice: {' '.join(paths)}")
    return [RunMeta(str(d), label, *load_meta(str(d))) for d, label in zip(dirs, unique_labels(dirs))]


def default_baseline(runs: list[RunMeta]) -> RunMeta:
    """The first real run (so differences read as sim-vs-real errors), else the first run."""
    return next((r for r in runs if r.mode == "real"), runs[0])


def pick_baseline(runs: list[RunMeta], name: str | None) -> RunMeta:
    """The run named by `name` (its label or its path), or the default baseline when `name` is None."""
    if name is None:
        return default_baseline(runs)
    for r in runs:
        if name == r.label or Path(name).resolve() == Path(r.path).resolve():
            return r
    raise ValueError(f"--baseline {name}: not one of the compared runs ({', '.join(r.label for r in runs)}); "
                     "give its label or path")


def metric(summary: dict, key: str) -> float | None:
    """The number at a dotted summary key ('ttft_s.p50'), or None where it is missing or not a number."""
    cur = summary
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur if isinstance(cur, (int, float)) and not isinstance(cur, bool) else None


def scaled(summary: dict, key: str, scale: float) -> float | None:
    v = metric(summary, key)
    return None if v is None else v * scale


# (row label, summary.json key, scale from the summary's unit to the row's unit)
COMPARE_METRICS: list[tuple[str, str, float]] = [
    *[(f"{name} {q} (ms)", f"{key}.{q}", 1e3) for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"),
                                                                   ("ITL", "itl_s"), ("E2E", "e2e_s"))
      for q in ("mean", "p50", "p90", "p99")],
    ("request throughput (req/s)", "request_throughput", 1.0),
    ("output throughput (tok/s)", "output_throughput", 1.0),
    ("total token throughput (tok/s)", "total_token_throughput", 1.0),
    ("goodput (req/s)", "goodput", 1.0),
    ("KV utilisation mean (%)", "kv_util_mean", 100.0),
    ("KV utilisation max (%)", "kv_util_max", 100.0),
    ("preemptions", "num_preemptions", 1.0),
    ("prefix-cache hit rate (%)", "prefix_cache_hit_rate", 100.0),
    ("mean batch size (requests/step)", "mean_batch_size", 1.0),
    ("requests finished", "num_finished", 1.0),
    ("makespan (s)", "makespan_s", 1.0),
]


def diff_kind(run: RunMeta, baseline: RunMeta) -> str:
    """'sim-vs-real error' when exactly one of the two runs is real, else 'rel. diff'."""
    return "sim-vs-real error" if {run.mode, baseline.mode} == {"sim", "real"} else "rel. diff"


def diff_column(run: RunMeta, baseline: RunMeta) -> str:
    """Header of a run's relative-difference column."""
    return f"{run.label}: {diff_kind(run, baseline)} vs {baseline.label} (%)"


def compare_table(runs: list[RunMeta], baseline: RunMeta) -> pd.DataFrame:
    """Metrics as rows, one value column per run, plus (run - baseline) / baseline in percent for each other run."""
    import pandas as pd
    out = pd.DataFrame({"metric": [m[0] for m in COMPARE_METRICS], "summary key": [m[1] for m in COMPARE_METRICS]})
    base = [scaled(baseline.summary, key, scale) for _, key, scale in COMPARE_METRICS]
    for r in runs:
        out[f"{r.label} [{r.mode}]"] = pd.array([scaled(r.summary, k, sc) for _, k, sc in COMPARE_METRICS],
                                                dtype="Float64")
    for r in runs:
        if r.path == baseline.path:
            continue
        vals = [scaled(r.summary, k, sc) for _, k, sc in COMPARE_METRICS]
        out[diff_column(r, baseline)] = pd.array(
            [None if v is None or b is None or b == 0 else 100.0 * (v - b) / abs(b) for v, b in zip(vals, base)],
            dtype="Float64")
        band = expected_band(r, baseline)
        if band is not None:
            sim, real = (vals, base) if r.mode == "sim" else (base, vals)
            out[band_column(r)] = pd.array(
                [within(band, key, None if s is None or x is None or x == 0 else (s - x) / abs(x))
                 for (_, key, _), s, x in zip(COMPARE_METRICS, sim, real)], dtype="boolean")
    return out


def within(expected: dict | None, key: str, relative_error: float | None) -> bool | None:
    """Whether a sim-vs-real difference lies inside a simulation's expected-error band for that metric (None: no
    band for it). `expected` is the band a simulation states (sim/error_bands.py), as its summary records it."""
    bounds = (expected or {}).get("bounds") or {}
    if relative_error is None or key not in bounds:
        return None
    return abs(relative_error) <= bounds[key] + 1e-12


def expected_band(run: RunMeta, baseline: RunMeta) -> dict | None:
    """The simulated run's expected error (its summary states it) when the pair is one sim and one real run."""
    if {run.mode, baseline.mode} != {"sim", "real"}:
        return None
    sim = run if run.mode == "sim" else baseline
    band = sim.summary.get("expected_error") or sim.manifest.get("expected_error")
    return band if band and band.get("bounds") else None


def band_column(run: RunMeta) -> str:
    """Header of the column saying whether a run's sim-vs-real error lies inside the expected error."""
    return f"{run.label}: within expected error"


def format_table(table: pd.DataFrame, runs: list[RunMeta], baseline: RunMeta) -> str:
    """compare_table as fixed-width text for a terminal: values to 4 significant digits, differences as
    signed percent (a * where a sim-vs-real error lies inside the simulated run's expected error); each column
    is headed by its run's label over its mode or kind of difference."""
    import pandas as pd
    others = [r for r in runs if r.path != baseline.path]
    head = [("metric", ""), *((r.label, f"[{r.mode}]") for r in runs),
            *((r.label, f"{diff_kind(r, baseline)} (%)") for r in others)]
    marks = [table[band_column(r)] if band_column(r) in table else None for r in others]
    rows = [[row["metric"], *(_fmt(x) for x in row.iloc[2:2 + len(runs)]),
             *(_fmt(row[diff_column(r, baseline)], pct=True) + ("*" if m is not None and m.iloc[i] is not pd.NA
                                                                   and bool(m.iloc[i]) else "")
               for r, m in zip(others, marks))] for i, (_, row) in enumerate(table.iterrows())]
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    notes = [f"* inside the expected error of {r.label if r.mode == 'sim' else baseline.label}'s cost model "
             f"({expected_band(r, baseline)['basis']})" for r, m in zip(others, marks) if m is not None]
    return "\n".join([f"Baseline: {baseline.label} [{baseline.mode}] ({baseline.path}); differences are "
                      "(run - baseline) / baseline",
                      line([h[0] for h in head]), line([h[1] for h in head]), line(["-" * w for w in widths]),
                      *(line(r) for r in rows), *notes])


def format_value(metric: str, x) -> str:
    """A metric's value with one precision per unit: milliseconds and seconds to 2 decimals, rates to 1,
    counts whole, fractions as percent; "-" where there is none."""
    import pandas as pd
    if x is None or pd.isna(x):
        return "-"
    if "(%)" in metric or "/s)" in metric:
        return f"{x:,.1f}"
    if "(ms)" in metric or "(s)" in metric:
        return f"{x:,.2f}"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def format_pct(x) -> str:
    import pandas as pd
    return "-" if x is None or pd.isna(x) else f"{x:+.1f}%"


def format_within(x) -> str:
    """A sim-vs-real error inside the simulation's expected error: "yes", "no", or "-" where no band covers it."""
    import pandas as pd
    return "-" if x is None or pd.isna(x) else ("yes" if x else "no")


def _fmt(x, pct: bool = False) -> str:
    import pandas as pd
    if pd.isna(x):
        return "-"
    return f"{x:+.1f}" if pct else f"{x:.4g}"


def add_compare_parser(subparsers) -> None:
    """Register `compare` on the CLI's subparsers."""
    p = subparsers.add_parser("compare", help="the dashboard's comparison table of runs, in the terminal",
                              description="Print the metrics of run directories side by side with each run's "
                                          "difference against a baseline (the sim-vs-real error where one is "
                                          "simulated and the other real); optionally write the latency CDFs.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by simulate / replay / bench")
    p.add_argument("--baseline", default=None, metavar="RUN",
                   help="label or path of the run to compare against (default: the first real run, else the first)")
    p.add_argument("--png", default=None, metavar="FILE", help="write the TTFT / TPOT / E2E CDF figure to FILE")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="table (default: the table, then the settings that differ), json (both) or csv (the table)")
    p.set_defaults(func=cmd_compare)


def setting(run: RunMeta, key: str):
    """A run's model, GPU, cost model or engine flag, as its manifest records it (None where it does not)."""
    m = run.manifest
    if key in ("model", "hardware"):
        name = entry_name(m.get(key))
        if key == "hardware" and name is not None:
            from testbed.specs.hardware import get_gpu_spec
            try:
                return get_gpu_spec(name).name  # "NVIDIA H200" and "H200" are one GPU
            except ValueError:
                return name
        return name
    if key == "cost_model":
        return m.get("cost_model")
    if key in ("num_gpu_blocks", "max_model_len") and m.get(key) is not None:
        return m[key]  # what the run had, where the flag was left to be decided
    return _config(run).get(key)


def _config(run: RunMeta) -> dict:
    config = run.manifest.get("config")
    return config if isinstance(config, dict) else {}


def differing_settings(runs: list[RunMeta]) -> dict[str, dict[str, object]]:
    """{setting: {run label: value}} for the model, GPU, cost model and engine flags whose recorded values differ."""
    keys = ["model", "hardware", "cost_model"]
    keys += sorted({k for r in runs for k in _config(r)})
    out = {}
    for k in keys:
        vals = {r.label: setting(r, k) for r in runs}
        known = [v for v in vals.values() if v is not None]  # a run that does not record it (an older manifest,
        if len({json.dumps(v, sort_keys=True, default=str) for v in known}) > 1:  # a real run's cost model) is no
            out[k] = vals  # difference
    return out


def format_settings(diff: dict[str, dict[str, object]]) -> str:
    if not diff:
        return "Settings: the same in every run (model, GPU, cost model, engine flags)"
    lines = ["Settings that differ:"]
    for k, vals in diff.items():
        lines.append(f"  {k}: " + ", ".join(f"{label} {v}" for label, v in vals.items()))
    return "\n".join(lines)


def cmd_compare(args) -> int:
    import pandas as pd
    runs = load_runs(args.runs)
    baseline = pick_baseline(runs, args.baseline)
    table = compare_table(runs, baseline)
    if args.format == "csv":
        print(table.to_csv(index=False), end="")
    elif args.format == "json":
        rows = [{k: (None if pd.isna(v) else v) for k, v in row.items()} for row in table.to_dict(orient="records")]
        print(json.dumps({"baseline": baseline.label, "runs": [{"label": r.label, "mode": r.mode, "path": r.path}
                                                               for r in runs],
                          "metrics": rows, "settings_that_differ": differing_settings(runs)}, indent=2, default=str))
    else:
        print(format_table(table, runs, baseline))
        print(format_settings(differing_settings(runs)))
    if args.png is not None:
        from testbed.runs import plots, series
        styles = plots.series_of([(r.label, r.mode) for r in runs])
        fig = plots.latency_cdfs([(st, series.latency_samples(r.path)) for st, r in zip(styles, runs)])
        out = Path(args.png)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(plots.to_png(fig))
        print(f"Latency CDFs: {out}")
    return 0
