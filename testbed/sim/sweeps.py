"""Sweeps: many simulations from a list of configurations, one summary row each (`testbed.sweep`).

A configuration is a flat mapping of EngineConfig fields (`max_num_batched_tokens`, `policy`,
`data_parallel_size`, ...), `run_simulation` keywords (`model`, `gpu`, `cost_model`, `request_rate`,
`burstiness`, `limit`, `slo_ttft`, ...) and three more keys: `trace` (overrides the sweep's trace),
`like` (a run directory whose KV-cache size and max_model_len fill the unset engine settings, as
`testbed simulate --like`; its recorded requests are the trace unless one is given) and `name` (the
run directory's name under `output`). Every configuration is checked before the first simulation.

Parallelism is a pool's ordered `map(fn, iterable)`: by default a local process pool of `jobs` workers;
any pool with that method works, e.g. `ray.util.multiprocessing.Pool(ray_address=...)` spreads a sweep
over a Ray cluster. Invariant: the rows are in the order of `configs` and each is deterministic for its
seed, so a sweep's table is the same whatever the pool, the number of workers or their finishing order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import pandas as pd

from testbed.engine.config import EngineConfig
from testbed.engine.metrics import check_slos

ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))
RUN_KEYS = ("model", "gpu", "cost_model", "request_rate", "burstiness", "limit", "trace_format", "slo_ttft",
            "slo_tpot")
OTHER_KEYS = ("trace", "like", "name")


class Pool(Protocol):
    """What a sweep needs of a pool: `map` that returns results in the order of its inputs."""

    def map(self, fn, iterable, /) -> Iterable: ...


class SweepError(RuntimeError):
    """Some configurations failed; `results` holds every row (theirs with `error` set)."""

    def __init__(self, message: str, results: pd.DataFrame) -> None:
        super().__init__(message)
        self.results = results


def _run_defaults() -> dict[str, Any]:
    from testbed.sim.run import run_simulation
    params = inspect.signature(run_simulation).parameters
    return {k: params[k].default for k in RUN_KEYS}


def _job(index: int, config: Mapping[str, Any], trace: str | Path | None, output: Path | None) -> dict:
    """The checked, fully resolved form of one configuration (what a worker process receives)."""
    where = f"configs[{index}]"
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: expected a mapping of settings, got {type(config).__name__}")
    unknown = sorted(set(config) - {*ENGINE_KEYS, *RUN_KEYS, *OTHER_KEYS})
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(map(repr, unknown))}; allowed: EngineConfig fields "
                         f"({', '.join(ENGINE_KEYS)}), run_simulation keywords ({', '.join(RUN_KEYS)}), "
                         f"{', '.join(OTHER_KEYS)}")
    engine = {k: config[k] for k in ENGINE_KEYS if k in config}
    try:
        EngineConfig(**engine)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    run = {**_run_defaults(), **{k: config[k] for k in RUN_KEYS if k in config}}
    try:
        check_slos(run["slo_ttft"], run["slo_tpot"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    like = config.get("like")
    if like is not None and not Path(like).is_dir():
        raise ValueError(f"{where}: like={like!r} is not a run directory")
    source = config.get("trace", trace) or like
    if source is None:
        raise ValueError(f"{where}: no trace: pass sweep(configs, trace=...) or give the configuration a 'trace' "
                         "(or 'like') key")
    if not Path(source).exists():
        raise ValueError(f"{where}: trace {str(source)!r} does not exist")
    name = str(config.get("name", f"{index:03d}"))
    if output is not None and (not name or Path(name).name != name or name.startswith(".")):
        raise ValueError(f"{where}: name {name!r} must be a plain folder name (it names the run directory)")
    return {"index": index, "given": dict(config), "engine": engine, "run": run, "trace": str(source),
            "like": None if like is None else str(like), "name": name,
            "output": None if output is None else str(output / name)}


def run_job(job: dict) -> dict:
    """One simulation (in a worker process): the row of its configuration and flattened summary. Anything
    the simulator says on stderr (rejections, a cost-model fallback) goes to the row's `warnings`, so
    parallel workers never interleave their messages."""
    from testbed.sim.like import like_config
    from testbed.sim.run import run_simulation
    row = {"name": job["name"], "run_dir": job["output"], "error": None, "warnings": ""}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            config = EngineConfig(**job["engine"])
            if job["like"] is not None:
                config = like_config(job["like"], config)
            _, summary = run_simulation(job["trace"], config, output=job["output"], progress=False, **job["run"])
        row.update(flatten(summary))
    except Exception as e:  # noqa: BLE001 - reported per configuration; the sweep raises once all are done
        row["error"] = f"{type(e).__name__}: {e}"
    row["warnings"] = err.getvalue().strip()
    return row


def _settings(todo: list[dict]) -> pd.DataFrame:
    """One column per key any configuration gave (first-seen order), holding the value each simulation used:
    its own, else the default (the sweep's trace, EngineConfig's and run_simulation's defaults)."""
    keys = list(dict.fromkeys(k for j in todo for k in j["given"] if k != "name"))
    defaults = EngineConfig().to_dict()

    def used(j: dict, k: str):
        if k in j["engine"]:
            return j["engine"][k]
        if k in RUN_KEYS:
            return j["run"][k]
        if k == "trace":
            return j["trace"]
        return j["given"].get(k, defaults.get(k))

    return pd.DataFrame({k: [used(j, k) for j in todo] for k in keys}, index=range(len(todo)))


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A summary as one level of dotted keys ('ttft_s.p99')."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def sweep(configs: Iterable[Mapping[str, Any]], trace: str | Path | None = None, *, jobs: int = 1,
          output: str | Path | None = None, pool: Pool | None = None) -> pd.DataFrame:
    """Simulate every configuration and return one row each, in order: the configuration's keys (with the
    values used), `name`, `run_dir` (its run directory under `output`, when given), `error`, `warnings`,
    then the summary's metrics as dotted columns (`goodput`, `ttft_s.p99`, `prefix_cache_hit_rate`, ...).

    `jobs` worker processes run them (1: in this process); `pool` replaces that with any pool whose `map`
    keeps order. Bad configurations fail before any simulation; a configuration that fails while
    simulating does not stop the others: SweepError is raised at the end with every row in `.results`."""
    if not (isinstance(jobs, int) and jobs >= 1):
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    out = None if output is None else Path(output)
    todo = [_job(i, c, trace, out) for i, c in enumerate(configs)]
    names = [j["name"] for j in todo]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if out is not None and dupes:
        raise ValueError(f"configurations share the name(s) {', '.join(dupes)}; each names its own run directory")
    if out is not None:
        from testbed.runs.rundir import check_output
        for j in todo:
            check_output(j["output"])
    if pool is not None:
        rows = list(pool.map(run_job, todo))
    elif jobs == 1 or len(todo) <= 1:
        rows = [run_job(j) for j in todo]
    else:
        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=_context()) as ex:
            rows = list(ex.map(run_job, todo))
    table = pd.concat([_settings(todo), pd.DataFrame(rows)], axis=1)
    failed = [r for r in rows if r["error"] is not None]
    if failed:
        first = failed[0]
        raise SweepError(f"{len(failed)} of {len(rows)} configurations failed; the first, {first['name']!r}: "
                         f"{first['error']}", table)
    return table


def _context() -> multiprocessing.context.BaseContext:
    """fork from a single-threaded parent (a script needs no `__main__` guard); spawn, a fresh interpreter per
    worker, from a threaded one such as a notebook kernel, where forking is unsafe."""
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """Every combination of the given values, the last axis varying fastest:
    grid(policy=["fcfs", "priority"], request_rate=[2, 4]) -> 4 configurations."""
    combos: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        values = list(values)
        if not values:
            raise ValueError(f"grid axis {key!r} has no values")
        combos = [{**c, key: v} for c in combos for v in values]
    return combos

