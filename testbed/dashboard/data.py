"""Run discovery, the runs table and the comparison table; plain pandas, no Streamlit.

Every number in the comparison table is read from a run's summary.json (latencies scaled from
seconds to milliseconds, fractions to percent); nothing is recomputed, so the table always agrees
with what `testbed simulate` / `replay` / `bench serve` printed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.rundir import FILES, RunDirError, find_runs, read_run


@dataclass(frozen=True)
class RunMeta:
    """A readable run directory: its display label, manifest and summary."""

    path: str
    label: str
    manifest: dict
    summary: dict

    @property
    def mode(self) -> str:
        return str(self.manifest.get("mode", "?"))


def file_key(path: str | Path) -> tuple:
    """(mtime_ns, size) of the run's files: the cache key that changes whenever a file is rewritten."""
    p = Path(path)
    return tuple((s.st_mtime_ns, s.st_size) if (s := _stat(p / f)) else None for f in FILES)


def _stat(p: Path):
    try:
        return p.stat()
    except OSError:
        return None


def discover(roots: list[str]) -> tuple[list[Path], list[str]]:
    """Run directories under the given folders, and one message per folder that is missing or holds no run."""
    found: list[Path] = []
    problems: list[str] = []
    for root in roots:
        p = Path(root).expanduser()
        if not p.is_dir():
            problems.append(f"{p}: folder does not exist (check the path or run `testbed simulate ... -o {p}/NAME`)")
            continue
        runs = find_runs(p)
        if not runs:
            problems.append(f"{p}: no run directories found (none holds a manifest.json)")
        found.extend(r for r in runs if r not in found)
    return found, problems


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


def _name(x) -> str:
    if isinstance(x, dict):
        x = x.get("name")
    return Path(str(x)).name if x else "-"


def _get(summary: dict, key: str):
    cur = summary
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur if isinstance(cur, (int, float)) and not isinstance(cur, bool) else None


def _scaled(summary: dict, key: str, scale: float) -> float | None:
    v = _get(summary, key)
    return None if v is None else v * scale


def runs_table(runs: list[RunMeta]) -> pd.DataFrame:
    """One row per run: how it was made and its headline numbers (latencies in ms)."""
    rows = []
    for r in runs:
        m, s = r.manifest, r.summary
        cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
        trace = m.get("trace")
        dp = cfg.get("data_parallel_size", 1)
        policy = str(cfg.get("policy", "-")) + (f" / {cfg.get('dp_policy')}" if dp and dp > 1 else "")
        rows.append({
            "run": r.label, "mode": r.mode, "model": _name(m.get("model")),
            "GPU": _name(m.get("hardware") or m.get("gpu")),
            "trace": _name(trace.get("path") if isinstance(trace, dict) else trace),
            "policy": policy, "DP": dp, "TP": cfg.get("tensor_parallel_size", 1),
            "prefix caching": bool(cfg.get("enable_prefix_caching", False)),
            "date": str(m.get("created", ""))[:19].replace("T", " "),
            "requests": _get(s, "num_requests"), "req/s": _get(s, "request_throughput"),
            "output tok/s": _get(s, "output_throughput"), "TTFT p50 (ms)": _scaled(s, "ttft_s.p50", 1e3),
            "TTFT p99 (ms)": _scaled(s, "ttft_s.p99", 1e3), "TPOT p50 (ms)": _scaled(s, "tpot_s.p50", 1e3),
            "path": r.path,
        })
    return pd.DataFrame(rows, columns=["run", "mode", "model", "GPU", "req/s", "output tok/s", "TTFT p50 (ms)",
                                       "TTFT p99 (ms)", "TPOT p50 (ms)", "trace", "policy", "DP", "TP",
                                       "prefix caching", "requests", "date", "path"])


def filter_runs(table: pd.DataFrame, modes: list[str], models: list[str], text: str) -> pd.DataFrame:
    """Rows whose mode and model are among those chosen (empty = all) and that contain `text` anywhere."""
    keep = pd.Series(True, index=table.index)
    if modes:
        keep &= table["mode"].isin(modes)
    if models:
        keep &= table["model"].isin(models)
    if text.strip():
        needle = text.strip().lower()
        keep &= table.astype(str).apply(lambda row: needle in " ".join(row).lower(), axis=1)
    return table[keep]


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


def diff_column(run: RunMeta, baseline: RunMeta) -> str:
    """Header of a run's relative-difference column; 'sim-vs-real error' when exactly one side is real."""
    kind = "sim-vs-real error" if {run.mode, baseline.mode} == {"sim", "real"} else "rel. diff"
    return f"{run.label}: {kind} vs {baseline.label} (%)"


def compare_table(runs: list[RunMeta], baseline: RunMeta) -> pd.DataFrame:
    """Metrics as rows, one value column per run, plus (run - baseline) / baseline in percent for each other run."""
    out = pd.DataFrame({"metric": [m[0] for m in COMPARE_METRICS], "summary key": [m[1] for m in COMPARE_METRICS]})
    base = [_scaled(baseline.summary, key, scale) for _, key, scale in COMPARE_METRICS]
    for r in runs:
        out[f"{r.label} [{r.mode}]"] = pd.array([_scaled(r.summary, k, sc) for _, k, sc in COMPARE_METRICS],
                                                dtype="Float64")
    for r in runs:
        if r.path == baseline.path:
            continue
        vals = [_scaled(r.summary, k, sc) for _, k, sc in COMPARE_METRICS]
        out[diff_column(r, baseline)] = pd.array(
            [None if v is None or b is None or b == 0 else 100.0 * (v - b) / abs(b) for v, b in zip(vals, base)],
            dtype="Float64")
    return out
