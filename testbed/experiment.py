"""What every experiment notebook (experiments/) records and writes, the same way each time.

`start(output_dir, seeds)` moves to the repository root, makes the output folder and writes its
environment.json (git sha, Python and package versions, platform, seeds, engine defaults);
`save_figure` writes a PNG with fixed metadata and shows it; `save_table` writes a CSV and shows it.
Invariant: none of them writes a timestamp, a host name or anything else that changes between two runs
on one machine, so a rerun with the same parameters reproduces every file byte for byte.
"""
from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.engine.config import EngineConfig
from testbed.runs.rundir import environment_info

PACKAGES = ("testbed", "simpy", "numpy", "pandas", "pyarrow", "matplotlib", "nbclient", "jupytext", "ipykernel")


def repo_root() -> Path:
    """The checkout this testbed runs from (its traces/ and benchmarks/ are the notebooks' inputs)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "traces").is_dir():
        raise RuntimeError(f"{root} is not a testbed checkout (no traces/): the notebooks run from a clone "
                           "with the package installed in editable mode (make setup)")
    return root


def environment(seeds: dict[str, int]) -> dict[str, Any]:
    """Provenance of a notebook's results: git sha, Python, package versions, platform, seeds, engine defaults."""
    info = environment_info()
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"git_sha": info["git_sha"], "python": platform.python_version(), "platform": info["platform"],
            "versions": versions, "seeds": dict(seeds), "engine_defaults": EngineConfig().to_dict()}


def start(output_dir: str | Path, seeds: dict[str, int]) -> tuple[Path, dict[str, Any]]:
    """Work from the repository root, create `output_dir` and write its environment.json; returns both."""
    os.chdir(repo_root())
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(seeds)
    (out / "environment.json").write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    return out, env


TRACES_DIR_ENV = "TESTBED_TRACES_DIR"  # the folder holding the full public traces (not in the repository)


def trace_path(full: bool, bundled: str, public: str) -> Path:
    """The trace a notebook reads: `bundled` (a file in the repository, the CI-sized default) or, with `full`,
    `public` in the folder of full public traces that TESTBED_TRACES_DIR names; FileNotFoundError saying what
    to fetch or set when it is missing."""
    if not full:
        path = Path(bundled)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (run the notebooks from the repository's root)")
        return path
    folder = os.environ.get(TRACES_DIR_ENV)
    if not folder:
        raise FileNotFoundError(f"full=True reads the public trace {public}: download it and set {TRACES_DIR_ENV} "
                                "to its folder (traces/README.md names the sources)")
    path = Path(folder) / public
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing ({TRACES_DIR_ENV}={folder}; traces/README.md names the sources)")
    return path


def save_figure(fig, path: str | Path) -> None:
    """Write `fig` as a PNG with fixed metadata (no software string or date), close it, and show it in the
    notebook; the bytes depend only on the figure and the matplotlib version."""
    from IPython.display import Image, display

    from testbed.runs.plots import to_png
    png = to_png(fig)
    Path(path).write_bytes(png)
    display(Image(data=png))


def save_table(df: pd.DataFrame, path: str | Path, float_format: str = "%.6g") -> None:
    """Write `df` as CSV (floats to 6 significant digits) and show it in the notebook, every row."""
    from IPython.display import display
    df.to_csv(path, index=False, float_format=float_format)
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 250):
        display(df)
