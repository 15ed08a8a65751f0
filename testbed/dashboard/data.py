"""Run discovery and the runs table; plain pandas, no Streamlit. The comparison table is testbed.runs.compare's,
shared with `testbed compare`."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.runs.compare import RunMeta, metric, scaled
from testbed.runs.rundir import FILES, find_runs


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


def _name(x) -> str:
    if isinstance(x, dict):
        x = x.get("name")
    return Path(str(x)).name if x else "-"


def runs_table(runs: list[RunMeta]) -> pd.DataFrame:
    """One row per run: whether it is usable, how it was made and its headline numbers (latencies in ms)."""
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
            "requests": metric(s, "num_requests"), "req/s": metric(s, "request_throughput"),
            "output tok/s": metric(s, "output_throughput"), "TTFT p50 (ms)": scaled(s, "ttft_s.p50", 1e3),
            "TTFT p99 (ms)": scaled(s, "ttft_s.p99", 1e3), "TPOT p50 (ms)": scaled(s, "tpot_s.p50", 1e3),
            "status": "ok" if r.problem is None else f"broken: {r.problem}", "path": r.path,
        })
    return pd.DataFrame(rows, columns=["run", "status", "mode", "model", "GPU", "req/s", "output tok/s",
                                       "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "trace", "policy", "DP",
                                       "TP", "prefix caching", "requests", "date", "path"])


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
