"""Run directories: the one on-disk schema both modes write and the dashboard reads.

<dir>/manifest.json  mode, config, trace, model, hardware, git sha, versions, seed, wall time
<dir>/requests.parquet  one row per request (REQUEST_COLUMNS)
<dir>/steps.parquet     one row per engine step (STEP_COLUMNS)
<dir>/summary.json      headline metrics (testbed.engine.metrics.summarize); deterministic for a seed
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from testbed.engine.metrics import REQUEST_COLUMNS, STEP_COLUMNS, Recorder

FILES = ("manifest.json", "requests.parquet", "steps.parquet", "summary.json")
_REQ_TYPES = {"request_id": pa.string(), "replica": pa.int32(), "priority": pa.int64(), "arrival": pa.float64(),
              "first_scheduled": pa.float64(), "first_token": pa.float64(), "finish": pa.float64(),
              "input_tokens": pa.int64(), "output_tokens": pa.int64(), "cached_tokens": pa.int64(),
              "preemptions": pa.int32(), "finish_reason": pa.string()}
_STEP_TYPES = {c: (pa.float64() if c in ("start", "duration") else pa.int64()) for c in STEP_COLUMNS}


def environment_info() -> dict:
    """git sha, python and package versions, host: the provenance every manifest carries."""
    versions = {}
    for pkg in ("testbed", "simpy", "numpy", "pandas", "pyarrow", "torch", "triton", "transformers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    sha = os.environ.get("TESTBED_GIT_SHA") or sha  # set where the tree is a copy (e.g. on a benchmark machine)
    return {"git_sha": sha, "python": platform.python_version(), "versions": versions,
            "host": platform.node(), "platform": platform.platform(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_run(out_dir: str | Path, manifest: dict, records: Recorder, summary: dict) -> Path:
    """Write the four files of a run directory (creating it); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    req_cols = records.request_columns()
    step_cols = records.step_columns()
    pq.write_table(pa.table({c: pa.array(req_cols[c], type=_REQ_TYPES[c]) for c in REQUEST_COLUMNS}),
                   out / "requests.parquet")
    pq.write_table(pa.table({c: pa.array(step_cols[c], type=_STEP_TYPES[c]) for c in STEP_COLUMNS}),
                   out / "steps.parquet")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return out


@dataclass
class Run:
    path: Path
    manifest: dict
    summary: dict

    def requests(self, columns: list[str] | None = None) -> pd.DataFrame:
        return pd.read_parquet(self.path / "requests.parquet", columns=columns)

    def steps(self, columns: list[str] | None = None) -> pd.DataFrame:
        return pd.read_parquet(self.path / "steps.parquet", columns=columns)


class RunDirError(ValueError):
    """A run directory is missing a file or holds one that does not parse."""


def read_run(path: str | Path) -> Run:
    """Open a run directory; RunDirError names the missing or corrupt file."""
    p = Path(path)
    for name in FILES:
        if not (p / name).is_file():
            raise RunDirError(f"{p}: missing {name} (not a complete run directory; re-run the command that wrote it)")
    try:
        manifest = json.loads((p / "manifest.json").read_text())
        summary = json.loads((p / "summary.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(f"{p}: corrupt JSON ({e})") from e
    return Run(p, manifest, summary)


def find_runs(root: str | Path) -> list[Path]:
    """Directories under `root` (itself included) that hold a manifest.json."""
    r = Path(root)
    return sorted({m.parent for m in r.rglob("manifest.json")}) if r.is_dir() else []
