"""Run directories: the one on-disk schema both modes write and the dashboard reads.

<dir>/manifest.json  mode, config, trace, model, hardware, git sha, versions, seed, wall time
<dir>/requests.parquet  one row per request (REQUEST_COLUMNS, and `lora`, the adapter's name, in runs with LoRA)
<dir>/steps.parquet     one row per engine step (STEP_COLUMNS)
<dir>/summary.json      headline metrics (testbed.engine.metrics.summarize); deterministic for a seed
Data-parallel runs add the coordinator's record (what `--cost-model recorded:` replays):
<dir>/routes.parquet        one row per routed request (ROUTE_COLUMNS)
<dir>/publications.parquet  one row per stats report a replica sent the coordinator (PUBLICATION_COLUMNS)
Runs whose grammars compiled off the step loop (structured outputs) add when each was ready:
<dir>/grammars.parquet  one row per grammar outcome (GRAMMAR_COLUMNS)

A run directory is written whole or not at all: the files go to a hidden temporary directory
beside it, which then takes its place in one rename (an exchange with the old run when there is
one), so an interrupted write leaves the old run or nothing, never a mix.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from testbed.runs.arrow_columns import column
from testbed.engine.metrics import (ASYNC_STEP_COLUMNS, BASE_REQUEST_COLUMNS, BASE_STEP_COLUMNS, BLOCK_STEP_COLUMNS,
                                    GRAMMAR_COLUMNS, PIPELINE_STEP_COLUMNS, PUBLICATION_COLUMNS, REQUEST_COLUMNS,
                                    ROUTE_COLUMNS, STEP_COLUMNS, STEP_FLOAT_COLUMNS, Recorder)

if TYPE_CHECKING:  # reading tables imports pandas; writing a run needs only pyarrow
    import pandas as pd

FILES = ("manifest.json", "requests.parquet", "steps.parquet", "summary.json")
_REQ_TYPES = {"request_id": pa.string(), "replica": pa.int32(), "priority": pa.int64(), "arrival": pa.float64(),
              "first_scheduled": pa.float64(), "first_token": pa.float64(), "finish": pa.float64(),
              "input_tokens": pa.int64(), "output_tokens": pa.int64(), "cached_tokens": pa.int64(),
              "preemptions": pa.int32(), "finish_reason": pa.string(), "seq": pa.int64()}
OPTIONAL_STEP_COLUMNS = PIPELINE_STEP_COLUMNS + ASYNC_STEP_COLUMNS  # written where a run has them
_STEP_TYPES = {c: (pa.float64() if c in STEP_FLOAT_COLUMNS else pa.int64())
               for c in STEP_COLUMNS + OPTIONAL_STEP_COLUMNS}
_OPTIONAL_TABLES = {  # file -> (Recorder attribute, columns, float columns, string columns): written when not empty
    "routes.parquet": ("routes", ROUTE_COLUMNS, ("arrival", "sent", "routed", "added"), ("request_id",)),
    "publications.parquet": ("publications", PUBLICATION_COLUMNS, ("sampled", "received", "kv_usage"), ()),
    "grammars.parquet": ("grammars", GRAMMAR_COLUMNS, ("ready",), ("request_id", "error")),
}


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


RUN_FILES = frozenset(FILES) | frozenset(_OPTIONAL_TABLES)  # every file a run directory may hold
MANIFEST_KEYS = ("mode", "config", "trace", "model", "git_sha", "versions", "created")


def check_output(out_dir: str | Path) -> Path:
    """The run directory to (re)write, checked before any work: a new path, an empty folder, or a run
    directory this tool wrote (replaced whole); anything else is RunDirError naming the path.
    Invariant: a folder is replaced only when it holds nothing but run files (RUN_FILES, all plain files)
    and its manifest.json is one of ours (MANIFEST_KEYS, mode sim or real), so no foreign file is ever deleted."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output {out}: exists and is not a directory; give the path of a new run directory")
    if out.is_dir():
        entries = list(out.iterdir())
        extra = sorted(p.name for p in entries if p.name not in RUN_FILES or p.is_symlink() or not p.is_file())
        if extra:
            raise RunDirError(f"--output {out}: a folder that is not a run directory (it holds {', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}), and only a run directory is replaced; "
                              f"give a new path, e.g. {out / 'NAME'}")
        if entries and not _is_our_manifest(out / "manifest.json"):
            raise RunDirError(f"--output {out}: its manifest.json is not a testbed run manifest, so the folder is "
                              "not replaced; give a new path or move the folder away")
    if out.parent.exists() and not out.parent.is_dir():
        raise RunDirError(f"--output {out}: {out.parent} is not a directory")
    return out


def entry_name(value) -> str | None:
    """The name a manifest's `model` or `hardware` entry gives: a plain name, or a dict's "name" (None else)."""
    name = value.get("name") if isinstance(value, dict) else value
    return name if isinstance(name, str) else None


def _is_our_manifest(path: Path) -> bool:
    """Whether `path` is a manifest.json that write_run wrote (a JSON object with MANIFEST_KEYS, mode sim/real)."""
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(m, dict) and all(k in m for k in MANIFEST_KEYS) and m.get("mode") in ("sim", "real")


def write_run(out_dir: str | Path, manifest: dict, records: Recorder, summary: dict | Callable[[], dict],
              columns: tuple[dict, dict] | None = None) -> tuple[Path, dict]:
    """Write the four files of a run directory, replacing any run already there in one rename; returns its path
    and the summary written. `summary`: the summary, or what computes it (called here while another thread writes
    the tables: their encoding and compression run outside the GIL). `columns`: the records' (request_columns(),
    step_columns()), where the caller has them."""
    out = check_output(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        with ThreadPoolExecutor(1) as pool:
            tables = pool.submit(_write_tables, tmp, records, columns)
            try:
                if callable(summary):
                    summary = summary()
            finally:
                tables.result()  # the tables written (or their error raised)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; a run directory is an ordinary folder
        old = _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out, summary


def _write_tables(tmp: Path, records: Recorder, columns: tuple[dict, dict] | None) -> None:
    """The run's parquet tables into `tmp`: requests, steps, and the optional tables its records hold."""
    req_cols, step_cols = columns or (records.request_columns(), records.step_columns())
    table = {c: column(req_cols[c], _REQ_TYPES[c]) for c in REQUEST_COLUMNS}
    if records.loras:  # a run with LoRA adapters: each request's adapter by name (null: the base model)
        table["lora"] = pa.array([records.loras.get(r) for r in req_cols["request_id"]], pa.string())
    _write_table(pa.table(table), tmp / "requests.parquet")
    _write_table(pa.table({c: column(step_cols[c], _STEP_TYPES[c])  # a pipeline-parallel or async run's too
                           for c in STEP_COLUMNS + OPTIONAL_STEP_COLUMNS if c in step_cols}),
                 tmp / "steps.parquet")
    for name, (attr, names, floats, strings) in _OPTIONAL_TABLES.items():
        rows = getattr(records, attr)
        if rows:
            typ = {c: pa.float64() if c in floats else pa.string() if c in strings else pa.int64() for c in names}
            _write_table(pa.table({c: column(col, typ[c]) for c, col in zip(names, zip(*rows))}), tmp / name)


def _write_table(table: pa.Table, path: Path) -> None:
    """One parquet table, its float columns (times and durations, nearly every value distinct) written without a
    dictionary: encoding them in one costs more time and bytes than it saves (the values read back the same)."""
    pq.write_table(table, path, use_dictionary=[f.name for f in table.schema if f.type != pa.float64()])


def _swap_into_place(new: Path, target: Path) -> Path | None:
    """Put directory `new` at `target` atomically; returns where the old `target` went (to delete), if any."""
    if not target.exists():
        os.rename(new, target)
        return None
    if _exchange(new, target):
        return new
    aside = target.with_name(f".{target.name}.{os.getpid()}.old")  # no atomic exchange on this system:
    os.rename(target, aside)  # a moment without `target`
    os.rename(new, target)
    return aside


def _exchange(a: Path, b: Path) -> bool:
    """Linux renameat2(RENAME_EXCHANGE): swap two paths in one step; False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@dataclass
class Run:
    path: Path
    manifest: dict
    summary: dict

    def requests(self, columns: list[str] | None = None) -> pd.DataFrame:
        return _read_frame(self.path / "requests.parquet", columns)

    def steps(self, columns: list[str] | None = None) -> pd.DataFrame:
        """steps.parquet; the block-move columns of a run written before they existed read as 0."""
        path = self.path / "steps.parquet"
        have = set(pq.read_schema(path).names)
        absent = [c for c in (columns or STEP_COLUMNS) if c in BLOCK_STEP_COLUMNS and c not in have]
        frame = _read_frame(path, [c for c in columns if c not in absent] if columns is not None else None)
        for c in absent:
            frame[c] = 0
        return frame

    def step_column_names(self) -> list[str]:
        """The columns steps.parquet holds (`scheduled` only in async runs recorded since it existed)."""
        return pq.read_schema(self.path / "steps.parquet").names

    def dp_table(self, name: str) -> pd.DataFrame | None:
        """'routes' or 'publications' of a data-parallel run, or 'grammars'; None when the run has none."""
        path = self.path / f"{name}.parquet"
        return _read_frame(path) if path.is_file() else None

    def request_column_names(self) -> list[str]:
        """The columns requests.parquet holds (`lora` only in runs with LoRA adapters)."""
        return pq.ParquetFile(self.path / "requests.parquet").schema_arrow.names

    def request_column(self, name: str) -> list:
        """One column of requests.parquet as a list (read with pyarrow alone, no pandas)."""
        return pq.ParquetFile(self.path / "requests.parquet").read(columns=[name]).column(name).to_pylist()


def _read_frame(path: Path, columns: list[str] | None = None) -> pd.DataFrame:
    import pandas as pd
    return pd.read_parquet(path, columns=columns)


class RunDirError(ValueError):
    """A run directory is missing a file or holds one that does not parse."""


def read_run(path: str | Path) -> Run:
    """Open a run directory whose four files are readable (the parquet files with the expected columns);
    RunDirError names the missing or corrupt file."""
    p = Path(path)
    for name in FILES:
        if not (p / name).is_file():
            raise RunDirError(f"{p}: missing {name} (not a complete run directory; re-run the command that wrote it)")
    try:
        manifest = json.loads((p / "manifest.json").read_text())
        summary = json.loads((p / "summary.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(f"{p}: corrupt JSON ({e})") from e
    problem = _records_problem(p)
    if problem is not None:
        raise RunDirError(problem)
    return Run(p, manifest, summary)


def _records_problem(path: str | Path) -> str | None:
    """Why a run's parquet records are unusable (unreadable, truncated, lacking columns), or None.
    Reads each file's footer and schema, not its rows (a data-parallel run's tables too, when present)."""
    p = Path(path)
    tables = [("requests.parquet", BASE_REQUEST_COLUMNS), ("steps.parquet", BASE_STEP_COLUMNS)]  # seq, block moves: optional
    tables += [(name, columns) for name, (_, columns, *_) in _OPTIONAL_TABLES.items() if (p / name).exists()]
    for name, columns in tables:
        try:
            have = set(pq.read_schema(p / name).names)
        except (OSError, pa.ArrowException) as e:
            return f"{p}: {name} is not a readable parquet file ({e})"
        missing = [c for c in columns if c not in have]
        if missing:
            return f"{p}: {name} lacks the columns {', '.join(missing)}"
    return None


def find_runs(root: str | Path) -> list[Path]:
    """Directories under `root` (itself included) that hold a manifest.json, hidden ones (a write in
    progress, or an old run about to be deleted) left out."""
    r = Path(root)
    if not r.is_dir():
        return []
    return sorted({m.parent for m in r.rglob("manifest.json")
                   if not any(part.startswith(".") for part in m.relative_to(r).parts)})
