"""`testbed simulate --like RUN_DIR`: simulate the workload a recorded run served, on the cache it had.

The run's requests become the trace (`load_trace` reads a run directory as the trace of the requests it
recorded); its KV-cache size and max_model_len fill the engine settings the flags left unset, so the
simulator schedules into the same memory as the run (a real `bench serve`, `replay`, or another simulation).
`run_setup` gives the model and GPU presets and the engine flags the run recorded, which `testbed simulate
--like` takes for every flag not given on its command line. `run_workload` gives the requests a run served, for a
replay of its own timeline (`testbed calibrate`): from the trace it served where that is at hand.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from testbed.engine.config import EngineConfig
from testbed.runs.rundir import Run, RunDirError, entry_name, read_run
from testbed.specs.hardware import get_gpu_spec
from testbed.specs.presets import get_model_spec


def run_cache(run: Run) -> tuple[int, int | None]:
    """(KV blocks per replica, max_model_len or None) a run served with: from its manifest (`testbed simulate`
    and `replay` record both; `bench serve` records the server's max_model_len), else the blocks from its
    step records (a `bench serve` run with --server-log-steps)."""
    m = run.manifest
    server_model = (m.get("server") or {}).get("model") or {}
    max_len = m.get("max_model_len") or server_model.get("max_model_len")
    blocks = m.get("num_gpu_blocks")
    if blocks is None:
        total = run.steps(columns=["kv_blocks_total"])["kv_blocks_total"]
        blocks = int(total.max()) if len(total) else None
    if blocks is None:
        raise RunDirError(f"{run.path}: the run records no KV-cache size (no num_gpu_blocks in manifest.json and no "
                          "step records; a `bench serve` run needs --server-log-steps); pass --num-gpu-blocks")
    return int(blocks), (int(max_len) if max_len else None)


def like_config(run: str | Path | Run, config: EngineConfig) -> EngineConfig:
    """`config` with num_gpu_blocks, num_cpu_blocks (the swap pool) and max_model_len taken from the run (a directory, or one already read)
    where they are unset (None)."""
    run = run if isinstance(run, Run) else read_run(run)
    blocks, max_len = run_cache(run)
    cpu = config.num_cpu_blocks if config.num_cpu_blocks is not None else run.manifest.get("num_cpu_blocks")
    return dataclasses.replace(config, num_gpu_blocks=config.num_gpu_blocks or blocks,
                               max_model_len=config.max_model_len or max_len, num_cpu_blocks=cpu)


def _preset(value, lookup) -> str | None:
    """The preset name a manifest's model or hardware entry maps to, or None."""
    name = entry_name(value)
    if name is None:
        return None
    try:
        return lookup(name).name
    except (ValueError, KeyError):
        return None


def run_setup(run: Run) -> tuple[str | None, str | None, dict]:
    """(model preset, GPU preset, engine flags) a run recorded: presets where its manifest names one (None
    otherwise), engine flags from a `simulate` or `replay` manifest (a `bench serve` run records the client's
    flags, not the server's: none then)."""
    m = run.manifest
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config = m.get("config") if isinstance(m.get("config"), dict) else {}
    engine = {k: v for k, v in config.items() if k in fields} if set(config) <= fields else {}
    return _preset(m.get("model"), get_model_spec), _preset(m.get("hardware"), get_gpu_spec), engine


def run_workload(run: Run, trace: str | Path | None, seed: int):
    """(requests, the trace file they came from) a run served: from `trace`, or where none is given the trace file its
    manifest names if it is here, drawn as the run drew them (its --request-rate, --burstiness and --limit, `seed`);
    else from the run directory itself, the file then None (it holds every request's lengths and arrival, not a
    prefix-caching run's prompts: load_trace then says so). A trace that does not give the run's requests is a
    ValueError."""
    from testbed.workload.trace import load_trace
    tr = run.manifest.get("trace") or {}
    source = trace if trace is not None else tr.get("path")
    if source is None or (trace is None and not Path(source).is_file()):
        return load_trace(str(run.path), seed=seed), None
    reqs = load_trace(source, request_rate=tr.get("request_rate"), burstiness=tr.get("burstiness") or 1.0, seed=seed,
                      limit=tr.get("limit"), fmt=tr.get("format") or "auto")
    served = set(run.requests(columns=["request_id"])["request_id"])
    ours = {r.id for r in reqs}
    if not served <= ours:
        missing = sorted(served - ours)
        raise ValueError(f"{source} is not the trace {run.path} served: {len(missing)} of its requests are not in it "
                         f"(e.g. {missing[0]!r}); give that trace with --trace")
    return reqs, str(source)
